"""The Python API of ktconvert: what the command line does, returning result objects (``ktconvert.results``).

    import ktconvert
    r = ktconvert.convert_cpu("/models/Qwen3-30B-A3B", "out", method="amxint4", numa=2)
    r.sglang_args        # '--kt-method AMXINT4 --kt-weight-path out --kt-threadpool-count 2'
    ktconvert.verify("out", source="/models/Qwen3-30B-A3B", hashes=True).ok

Sources (`src`): a checkpoint folder, a .safetensors or .gguf file, or ``hf://ORG/NAME[@REV]`` /
``ms://ORG/NAME[@REV]`` (downloaded and checked against the hub's hashes first).

Progress protocol: the `progress` argument, when given, is a ``ktconvert.progress.Progress`` (or any object with
the same methods): ``start(total_bytes, total_items, label)`` per phase, ``advance(nbytes, items=0, detail="")``
(called from worker threads), ``message(text)``. ``ktconvert.progress.make_progress()`` builds the renderers the
command line uses.

Exceptions (``ktconvert.errors``; each names file, tensor, expected and found): UsageError (an option value that
cannot work, listing those that do; UnknownNameError for an unknown name), InputError (unreadable or unsupported
input: ManifestError, ShapeError, NumericError), OutputError (OUT not empty, locked by another ktconvert process,
not writable, disk full), VerifyError, RemoteError (hub), NativeError. ``KtConvertError`` is their base;
``.exit_code`` is the command line's exit code for it. Nothing is written to OUT before every check passed.
"""
from __future__ import annotations

import time

from ktconvert.cpu.convert import convert_cpu
from ktconvert.cpu.output import CpuOutput
from ktconvert.cpu.plan import CpuOptions, plan_cpu
from ktconvert.errors import UsageError
from ktconvert.gpu.convert import convert_gpu
from ktconvert.gpu.output import GpuOutput
from ktconvert.gpu.plan import GpuOptions, plan_gpu
from ktconvert.inputs import open_input
from ktconvert.inspect import inspect as _inspect
from ktconvert.onepass import write_outputs
from ktconvert.results import ConvertResult, InspectResult, PlanResult, VerifyResult
from ktconvert.verify.run import verify as _verify

__all__ = ["ConvertResult", "CpuOptions", "GpuOptions", "InspectResult", "PlanResult", "VerifyResult", "convert",
           "convert_cpu", "convert_gpu", "inspect", "plan", "verify"]


def _options(value, cls):
    """CpuOptions / GpuOptions from an instance, a dict of its fields, or None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls.make(**value)
    raise UsageError(f"expected {cls.__name__} or a dict of its fields", found=type(value).__name__)


def convert(src, outputs, *, threads: int | None = None, resume: bool = False, force: bool = False,
            progress=None) -> list[ConvertResult]:
    """Write several outputs of `src` reading it once: outputs = [(out folder, CpuOptions | GpuOptions | dict of
    CpuOptions fields), ...] (RTN on every side; GPTQ runs one output at a time: use convert_cpu / convert_gpu).
    Each output's bytes equal what convert_cpu / convert_gpu write alone. Every plan is checked before any OUT
    is created; outputs must be different folders. Returns one ConvertResult per output, in order.
    """
    t0 = time.monotonic()
    input = open_input(src)
    built = []
    for out, options in outputs:
        options = options if isinstance(options, (CpuOptions, GpuOptions)) else _options(options, CpuOptions)
        if options.quant == "gptq":
            raise UsageError("--quant gptq writes one output at a time", hint="convert each output on its own")
        if isinstance(options, CpuOptions):
            plan = plan_cpu(input, options, out=out, threads=threads)
            plan.refuse_dropped_biases()
            built.append(CpuOutput(out, plan, resume=resume, force=force))
        else:
            built.append(GpuOutput(out, plan_gpu(input, options), resume=resume, force=force))
    folders = [o.out_dir.resolve() for o in built]
    if len(set(folders)) != len(folders):
        raise UsageError("every output needs its own folder", found=", ".join(map(str, folders)))
    return write_outputs(built, threads=threads, progress=progress, timings={"plan": time.monotonic() - t0})


def plan(src, cpu=None, gpu=None, *, out=None, threads: int | None = None, **cpu_option_values) -> PlanResult:
    """What converting `src` would write, checked without reading weights: cpu (CpuOptions or its fields; or
    give the fields as keywords, e.g. plan(src, method="amxint4", numa=2)) and / or gpu (GpuOptions or its
    fields). out: the CPU output folder whose free disk is checked. Raises on every problem (a NUMA count that
    cannot work lists the ones that do)."""
    cpu = _options(cpu, CpuOptions) or (CpuOptions.make(**cpu_option_values) if cpu_option_values else None)
    gpu = _options(gpu, GpuOptions)
    if cpu is None and gpu is None:
        raise UsageError("nothing to plan", expected="CPU options (method=...) and / or GPU options (gpu=...)")
    input = open_input(src)
    return PlanResult(source=input.spec, cpu=None if cpu is None else plan_cpu(input, cpu, out=out, threads=threads),
                      gpu=None if gpu is None else plan_gpu(input, gpu))


def inspect(path) -> InspectResult:
    """Describe checkpoint `path` from its headers and config.json only: family, layers, experts, dims, dtypes,
    quantization, bytes per component, expert layout and what each kt-kernel method can do with it."""
    return InspectResult(**_inspect(path))


def verify(out, *, source=None, hashes: bool = False, tokens: int = 8, layers=None, sample_experts="4",
           threshold: float | None = None, remote: str | None = None, hub: str = "hf", revision: str | None = None,
           endpoint: str | None = None) -> VerifyResult:
    """Check output folder `out` (or a .tar.zst bundle, or with remote="" the hub repo `out`): structure, hashes
    (hashes=True: every file and tensor against ktconvert.json), numerics (the native kernels on the written
    files; against `source` when given: layers None = first/middle/last, "all" or "1,3"; sample_experts: experts
    per layer, a count or "all"; tokens: random activations; threshold: the MoE relative-L2 limit, default per
    method) and remote (remote=REPO: the hub copy's hashes). Never raises for a failed check: result.ok."""
    return VerifyResult.from_dict(_verify(out, source=source, hashes=hashes, tokens=tokens, layers=layers,
                                          experts=sample_experts, threshold=threshold, remote=remote, hub=hub,
                                          revision=revision, endpoint=endpoint))

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

from ktconvert import inspection as inspect_module
from ktconvert.activation.placement import plan_placement, render_placement
from ktconvert.architecture import families as _families
from ktconvert.cpu.convert import convert_cpu
from ktconvert.cpu.output import CpuOutput
from ktconvert.cpu.plan import CpuOptions, plan_cpu, render as render_cpu_plan
from ktconvert.envinfo import env_info
from ktconvert.errors import UsageError
from ktconvert.gpu.convert import convert_gpu
from ktconvert.gpu.experts import EXPERT_SCHEMES
from ktconvert.gpu.output import GpuOutput
from ktconvert.gpu.plan import QUANTS as GPU_QUANTS, GpuOptions, plan_gpu, render_gpu
from ktconvert.inputs import open_input
from ktconvert.methods import METHODS, all_methods, writable_names
from ktconvert.onepass import write_outputs
from ktconvert.quant.row_quant import ROW_QUANT
from ktconvert.results import ConvertResult, InspectResult, PlanResult, VerifyResult
from ktconvert.testing.tiny import make_tiny_model
from ktconvert.verification import report_html, run as verify_run

__all__ = ["ConvertResult", "CpuOptions", "GpuOptions", "InspectResult", "PlanResult", "VerifyResult", "convert",
           "convert_cpu", "convert_gpu", "env_info", "families", "inspect", "make_tiny_model", "methods", "plan",
           "verify"]


def _options(value, cls):
    """CpuOptions / GpuOptions from an instance, a dict of its fields, or None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls.make(**value)
    raise UsageError(f"expected {cls.__name__} or a dict of its fields", found=type(value).__name__)


def _target_options(value):
    """CpuOptions / GpuOptions of one output of convert(): an instance, or a dict of its fields (one with
    "experts" describes the GPU checkpoint, else a CPU output)."""
    if isinstance(value, (CpuOptions, GpuOptions)):
        return value
    return _options(value, GpuOptions if isinstance(value, dict) and "experts" in value else CpuOptions)


def convert(src, outputs, *, threads: int | None = None, resume: bool = False, force: bool = False,
            progress=None) -> list[ConvertResult]:
    """Write several outputs of `src` reading it once: outputs = [(out folder, CpuOptions | GpuOptions | a dict of
    either's fields: one with "experts" is a GPU checkpoint), ...] (RTN on every side; GPTQ runs one output at a
    time: use convert_cpu / convert_gpu).
    Each output's bytes equal what convert_cpu / convert_gpu write alone. Every plan is checked before any OUT
    is created; outputs must be different folders. Returns one ConvertResult per output, in order.
    """
    t0 = time.monotonic()
    input = open_input(src)
    built = []
    for out, options in outputs:
        options = _target_options(options)
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


def plan(src, cpu=None, gpu=None, *, out=None, threads: int | None = None, placement: dict | None = None,
         **cpu_option_values) -> PlanResult:
    """What converting `src` would write, checked without reading weights: cpu (CpuOptions or its fields; or
    give the fields as keywords, e.g. plan(src, method="amxint4", numa=2)) and / or gpu (GpuOptions or its
    fields). out: the CPU output folder whose free disk is checked. placement: which routed experts SGLang-KT
    would keep on the GPU, {"ratio": R (--kt-gpu-experts-ratio) or "per_layer": N (--kt-num-gpu-experts),
    "stats": an expert_activation.pt (frequency placement; None: SGLang's uniform)}, their VRAM with the gpu
    options' expert scheme (without gpu: placement's "experts" / "group_size", default w4a16 / 128). Raises on
    every problem (a NUMA count that cannot work lists the ones that do)."""
    cpu = _options(cpu, CpuOptions) or (CpuOptions.make(**cpu_option_values) if cpu_option_values else None)
    gpu = _options(gpu, GpuOptions)
    if cpu is None and gpu is None and placement is None:
        raise UsageError("nothing to plan", expected="CPU options (method=...), GPU options (gpu=...) and / or "
                                                     "a GPU expert placement (placement=...)")
    input = open_input(src)
    return PlanResult(source=input.spec, cpu=None if cpu is None else plan_cpu(input, cpu, out=out, threads=threads),
                      gpu=None if gpu is None else plan_gpu(input, gpu),
                      placement=None if placement is None else _plan_placement(src, gpu, placement))


def _plan_placement(src, gpu, placement: dict) -> dict:
    """activation.placement.plan_placement with the GPU checkpoint's scheme: `gpu`'s when planned, else the
    placement dict's "experts" / "group_size" (default w4a16, 128)."""
    values = dict(placement)
    experts, group_size = values.pop("experts", "w4a16"), values.pop("group_size", 128)
    if gpu is not None:
        experts, group_size = gpu.experts, gpu.group_size
    return plan_placement(src, gpu_experts=experts, group_size=group_size, **values)


def inspect(path, expert_orientation: str | None = None) -> InspectResult:
    """Describe checkpoint `path` from its headers and config.json only: family, layers, experts, dims, dtypes,
    quantization, bytes per component, expert layout (as detected: layout, orientation and why; expert_orientation
    "out" / "in" settles square fused tensors) and what each kt-kernel method can do with it."""
    return InspectResult(**inspect_module.inspect(path, expert_orientation))


def verify(out, *, source=None, hashes: bool = False, tokens: int = 8, layers=None, sample_experts="4",
           threshold: float | None = None, remote: str | None = None, hub: str = "hf", revision: str | None = None,
           endpoint: str | None = None, calibration=None, compare=None, report=None) -> VerifyResult:
    """Check output folder `out` (or a .tar.zst bundle, or with remote="" the hub repo `out`): structure, hashes
    (hashes=True: every file and tensor against ktconvert.json), numerics (the native kernels on the written
    files; against `source` when given: layers None = first/middle/last, "all" or "1,3"; sample_experts: experts
    per layer, a count or "all"; tokens: random activations; threshold: the MoE relative-L2 limit, default per
    method) and remote (remote=REPO: the hub copy's hashes). calibration: a JSON-lines calibration file; the
    numerics then run on the hidden states its tokens produce in `source` (compare: a second output side by
    side). Never raises for a failed check: result.ok.
    report: also write the HTML page of what was measured there (verification.report_html: per-layer error
    curves, layer x expert heat map, worst experts, thresholds), also for a failed verification; its folder must
    exist and lie outside `out` (OutputError / UsageError before anything runs); result.report is its path."""
    target = None if report is None else report_html.check_target(report, out)
    result = verify_run.verify(out, source=source, hashes=hashes, tokens=tokens, layers=layers,
                               experts=sample_experts, threshold=threshold, remote=remote, hub=hub,
                               revision=revision, endpoint=endpoint, calibration=calibration, compare=compare)
    if target is not None:
        result["report"] = str(report_html.write_report(target, result))
    return VerifyResult.from_dict(result)


def families() -> dict:
    """{"families": {family: [config.json model_type values]}} of every architecture manifest."""
    return {"families": {name: list(m.model_types) for name, m in sorted(_families().items())}}


def methods() -> dict:
    """{"methods": [...]}: every CPU method with kt-kernel's name, whether ktconvert writes it, its layouts, group
    sizes, NUMA rule (n/k multiples) and whether kt-kernel needs AMX to run it."""
    return {"methods": [{"name": m.name, "kt_method": m.kt_method, "writable": m.writable,
                         "converted": m.needs_conversion, "layouts": list(m.layouts) if m.writable else [],
                         "group_sizes": list(m.group_sizes), "n_multiple": m.n_multiple, "k_multiple": m.k_multiple,
                         "needs_amx": m.needs_amx, "description": (m.__doc__ or "").strip().splitlines()[0]}
                        for m in all_methods()]}


# ---------------------------------------------------------------- what the command line asks

_CHOICES = {"method": writable_names, "cpu-quant": lambda: ROW_QUANT.names() + ["gptq"],
            "gpu-quant": lambda: list(GPU_QUANTS), "experts": lambda: sorted(EXPERT_SCHEMES)}


def default_method() -> str:
    """The CPU method `demo` and the docs use when none is given (the one whose class sets ``default``)."""
    return next(m.name for m in all_methods() if m.default)


def choices(kind: str) -> list[str]:
    """The values an option of `kind` accepts ("method", "cpu-quant", "gpu-quant", "experts"), from the
    registries."""
    return _CHOICES[kind]()


def choose(kind: str, value: str) -> str:
    """`value` as the canonical choice of `kind` (case-insensitive; method aliases accepted); UsageError listing
    the choices otherwise."""
    if kind == "method":
        method = METHODS.get(value).configured()
        return method.name
    matches = [c for c in choices(kind) if c.lower() == str(value).strip().lower()]
    if not matches:
        raise UsageError(f"unknown {kind} {value!r}", expected=" or ".join(choices(kind)))
    return matches[0]


def render(result) -> str:
    """A result object as the text the command line prints."""
    if isinstance(result, ConvertResult):
        return result.summary()
    if isinstance(result, PlanResult):
        parts = [render_cpu_plan(result.cpu.report)] if result.cpu is not None else []
        parts += [render_gpu(result.gpu.report)] if result.gpu is not None else []
        return "\n\n".join(parts + ([render_placement(result.placement)] if result.placement is not None else []))
    if isinstance(result, VerifyResult):
        text = verify_run.render(result.to_dict())
        return text + (f"\nreport: {result.report}" if result.report else "")
    return inspect_module.render(result.to_dict())

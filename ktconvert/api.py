"""The Python API of ktconvert: what the command line does, returning result objects (``ktconvert.results``).

    import ktconvert
    r = ktconvert.convert_cpu("/models/Qwen3-30B-A3B", "out", method="amxint4", numa=2)
    r.sglang_args        # '--kt-method AMXINT4 --kt-weight-path out --kt-threadpool-count 2'
    ktconvert.verify("out", source="/models/Qwen3-30B-A3B", hashes=True).ok

Sources (`src`): a checkpoint folder, a .safetensors or .gguf file, or ``hf://ORG/NAME[@REV]`` /
``ms://ORG/NAME[@REV]`` (downloaded and checked against the hub's hashes first).

Progress protocol: the `progress` argument, when given, is a ``ktconvert.util.progress.Progress`` (or any object with
the same methods): ``start(total_bytes, total_items, label)`` per phase (optional ``unit="items"``: what an item
is), ``advance(nbytes, items=0, detail="")`` (called from worker threads), ``message(text)``.
``ktconvert.util.progress.make_progress()`` builds the renderers the command line uses.

Exceptions (``ktconvert.errors``; each names file, tensor, expected and found): UsageError (an option value that
cannot work, listing those that do; UnknownNameError for an unknown name), InputError (unreadable or unsupported
input: ManifestError, ShapeError, NumericError), OutputError (OUT not empty, locked by another ktconvert process,
not writable, disk full), VerifyError, RemoteError (hub), NativeError. ``KtConvertError`` is their base;
``.exit_code`` is the command line's exit code for it. Nothing is written to OUT before every check passed.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from ktconvert.run import inspection as inspect_module
from ktconvert.activation import stats as activation_stats
from ktconvert.activation.placement import plan_placement, render_placement
from ktconvert.architectures.manifests import families as _families
from ktconvert.distributed import ray_convert as ray_executor
from ktconvert.distributed import ray_gptq, ray_plan
from ktconvert.run.local import convert_here, plan_outputs, target_list  # noqa: F401  (plan_outputs: API)
from ktconvert.cpu import convert as cpu_convert
from ktconvert.cpu.options import CpuOptions
from ktconvert.util.envinfo import env_info
from ktconvert.errors import UsageError
from ktconvert.util.extras import require
from ktconvert.gpu import convert as gpu_convert
from ktconvert.gpu.options import GpuOptions
from ktconvert.kinds import KINDS
from ktconvert.run.inputs import open_input
from ktconvert.launchcheck import run as launch_check
from ktconvert.distributed.merge import merge
from ktconvert.methods import all_methods
from ktconvert.ops import batch as ops_batch, bundle as ops_bundle, hub as ops_hub
from ktconvert.distributed import batch_ray
from ktconvert.run.planning import plan_targets, render_combined
from ktconvert.results import ConvertResult, InspectResult, PlanResult, VerifyResult
from ktconvert.examples.tiny import make_tiny_model
from ktconvert.verification import report_html, run as verify_run
from ktconvert.vocabulary import choices, choose  # noqa: F401  (the API's vocabulary, asked by the CLI)

__all__ = ["ConvertResult", "CpuOptions", "GpuOptions", "InspectResult", "PlanResult", "VerifyResult", "batch",
           "bundle", "check", "convert", "convert_cpu", "convert_gpu", "env_info", "expert_stats", "families",
           "inspect", "load_jobs", "make_tiny_model", "merge", "methods", "plan", "publish", "unbundle", "verify"]

EXECUTORS = ("local", "ray")            # where a conversion runs: this process, or Ray tasks (ray_executor)


def _options(value, cls):
    """CpuOptions / GpuOptions from an instance, a dict of its fields, or None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls.make(**value)
    raise UsageError(f"expected {cls.__name__} or a dict of its fields", found=type(value).__name__)


def convert(src, targets, *, threads: int | None = None, resume: bool = False, force: bool = False,
            progress=None, layers=None, verify_source_hash: bool = False, executor: str = "local",
            ray_address: str | None = None, parts: int | None = None, parts_dir=None,
            workers: int | None = None) -> list[ConvertResult]:
    """Write several outputs of `src` reading it once, each from every decoded layer as it goes by.

    targets: a list of tables, one per output: {"cpu": OUT, "method": ..., "numa": ..., ...} or {"gpu": OUT,
    "experts": ..., ...}: the key of an output kind (ktconvert.kinds.KINDS) holding OUT, with the fields of its
    options (CpuOptions / GpuOptions; ktconvert.run.targets: unknown keys and wrong types are UsageErrors naming the
    target and the key); or the path of a targets file holding them as [[targets]] tables; or (out, options) pairs
    (CpuOptions | GpuOptions | any kind's options, or a dict of their fields). RTN / MSE only:
    GPTQ runs one output at a time (use convert_cpu / convert_gpu).
    Each output's bytes, manifest included, equal what convert_cpu / convert_gpu write alone. Every plan is
    checked (also the free disk the outputs need together) before any OUT is created; two targets may not share
    a folder. resume continues each output from its own journal (a complete one is left as is). layers: a MoE
    layer range ("A-B"): every output becomes that part (as convert_cpu's `layers`). verify_source_hash: as
    convert_cpu's. executor, ray_address, parts, parts_dir: where it runs, as convert_cpu's (`workers` is
    for GPTQ, which convert does not run: UsageError). Returns one ConvertResult per output, in order.
    """
    if _on_ray(executor, layers, ray_address, parts, parts_dir, workers):
        return ray_executor.convert_on_ray(src, targets, parts=parts, address=ray_address, parts_dir=parts_dir,
                                           threads=threads, resume=resume, force=force, progress=progress,
                                           verify_source_hash=verify_source_hash)
    return convert_here(src, targets, threads=threads, resume=resume, force=force, progress=progress,
                        layers=layers, verify_source_hash=verify_source_hash)


def convert_cpu(src, out, options: CpuOptions | None = None, *, threads: int | None = None, resume: bool = False,
                force: bool = False, progress=None, layers=None, verify_source_hash: bool = False,
                executor: str = "local", ray_address: str | None = None, parts: int | None = None, parts_dir=None,
                workers: int | None = None, **option_values) -> ConvertResult:
    """Convert the routed experts of checkpoint `src` (a folder, a .safetensors / .gguf file, hf://ORG/NAME[@REV]
    or ms://ORG/NAME) for kt-kernel into the folder `out`.

    options: a CpuOptions, or its fields as keywords (method, numa, layout, quant, group_size, include_dense,
    include_mtp, allow_drop_bias, calibration; see CpuOptions). threads: worker threads (default: all cores; bytes
    never depend on it). resume: continue an interrupted run in `out` (a complete one is left as is); force:
    empty `out` first. progress: a ktconvert.util.progress.Progress (start / advance / message are called).
    layers: MoE layers ("1-3,7": ranges and lists, as parts.parse_layers reads them; (A, B) inclusive; or a list):
    `out` becomes a part holding those layers' files and ktconvert-part.json (`ktconvert merge` joins the parts).
    verify_source_hash: hash also the source files whose sha256 a Hugging Face cache blob name gives (else taken
    from the name) and raise InputError where they differ.
    executor: "local" (this process) or "ray": the MoE layers split into `parts` ranges of about equal bytes
    (None: the cluster's CPUs / threads), each a Ray task with `threads` CPUs on the cluster at `ray_address`
    (None: RAY_ADDRESS or a local instance) writing into `parts_dir` (None: OUT.parts next to `out`; a folder
    every node sees), merged into `out` here: the same bytes (ktconvert.distributed.ray_convert; needs the [ray] extra).
    With quant "gptq", "ray" keeps the layers in order and splits each layer's work instead: the calibration
    samples into `workers` slices (None: the cluster's CPUs), each layer's experts into as many owners, one Ray
    task of one CPU each, `out` written here: the bytes of this process's GPTQ (ktconvert.distributed.ray_gptq).
    Not with `layers`; ray_address / parts / parts_dir / workers only with "ray", `workers` only with "gptq" and
    parts / parts_dir not with it (UsageError).
    Raises UsageError (exit 2), MissingExtraError (2: quant "gptq" without the [gpu] extra, "ray" without the
    [ray] extra), InputError (3), OutputError (1, e.g. `out` not empty or locked by another process); nothing is
    written before every check passed. Returns the ConvertResult.
    """
    return _convert_one(cpu_convert.convert_cpu, CpuOptions, src, out, options, option_values, layers=layers,
                        executor=executor, ray_address=ray_address, parts=parts, parts_dir=parts_dir,
                        workers=workers, threads=threads, resume=resume, force=force, progress=progress,
                        verify_source_hash=verify_source_hash)


def convert_gpu(src, out, options: GpuOptions | None = None, *, threads: int | None = None, resume: bool = False,
                force: bool = False, progress=None, layers=None, verify_source_hash: bool = False,
                executor: str = "local", ray_address: str | None = None, parts: int | None = None, parts_dir=None,
                workers: int | None = None, **option_values) -> ConvertResult:
    """Write the SGLang-KT GPU checkpoint (SGLang's --model) of HF safetensors checkpoint `src` (a folder, or
    hf://ORG/NAME[@REV] / ms://ORG/NAME) into the folder `out`.

    options: a GpuOptions, or its fields as keywords (experts, group_size, quant, linears, include_mtp,
    calibration; see GpuOptions). threads / resume / force / progress / layers / verify_source_hash / executor /
    ray_address / parts / parts_dir / workers as for convert_cpu. Raises UsageError (exit 2), MissingExtraError
    (2: the [gpu] extra, or [ray] for executor "ray", is not installed), InputError (3), OutputError (1); nothing
    is written before every check passed. Returns the ConvertResult.
    """
    return _convert_one(gpu_convert.convert_gpu, GpuOptions, src, out, options, option_values, layers=layers,
                        executor=executor, ray_address=ray_address, parts=parts, parts_dir=parts_dir,
                        workers=workers, threads=threads, resume=resume, force=force, progress=progress,
                        verify_source_hash=verify_source_hash)


def _convert_one(local, options_class, src, out, options, option_values: dict, *, layers, executor, ray_address,
                 parts, parts_dir, workers, **run) -> ConvertResult:
    """One output: `local` (cpu.convert.convert_cpu / gpu.convert.convert_gpu) in this process, for quant "gptq"
    on Ray with its stream's steps as Ray tasks (ray_gptq.ray_streams); otherwise on Ray the one-target convert.
    options: `options_class`, a dict of its fields or None (then made of `option_values`). run: threads, resume,
    force, progress, verify_source_hash."""
    options = _options(options, options_class) or options_class.make(**option_values)
    on_ray = _on_ray(executor, layers, ray_address, parts, parts_dir, workers, options.quant)
    if on_ray and getattr(options, "calibration", None) is not None and options.quant != "gptq":
        raise UsageError("--executor ray is not available with --method llamafile --calibration",
                         hint="the importance matrix's calibration forward runs every layer in order: convert locally")
    if on_ray and options.quant != "gptq":
        return convert(src, [(out, options)], executor=executor, ray_address=ray_address, parts=parts,
                       parts_dir=parts_dir, **run)[0]
    stream = functools.partial(ray_gptq.ray_streams, address=ray_address, workers=workers) if on_ray else None
    return local(src, out, options, layers=layers, gptq_stream=stream, **run)


def _on_ray(executor: str, layers, ray_address, parts, parts_dir, workers=None, quant: str | None = None) -> bool:
    """True for executor "ray" (its extra checked), False for "local"; UsageError for another executor, for
    Ray's options without it, for one part (`layers`) with it, for `workers` without quant "gptq" (its
    calibration samples are what they split) and for parts / parts_dir with it (its layers cannot be split)."""
    name = str(executor).strip().lower()
    if name not in EXECUTORS:
        raise UsageError(f"unknown executor {executor!r}", expected=" or ".join(EXECUTORS))
    ray_only = [flag for flag, value in (("--ray-address", ray_address), ("--parts", parts),
                                         ("--parts-dir", parts_dir), ("--workers", workers)) if value is not None]
    if name == "local" and ray_only:
        raise UsageError(f"{ray_only[0]} needs --executor ray")
    if name == "ray" and layers is not None:
        raise UsageError("--layers writes one part by itself; --executor ray splits the layers (--parts)")
    if name == "ray" and quant == "gptq" and (parts is not None or parts_dir is not None):
        raise UsageError(f"{'--parts' if parts is not None else '--parts-dir'} is not available with --quant gptq "
                         f"(each layer needs the previous one's outputs)",
                         hint="--quant gptq on Ray splits the calibration samples instead: --workers N")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise UsageError("--workers must be a whole number of at least 1", found=repr(workers))
    if name == "ray" and quant != "gptq" and workers is not None:
        raise UsageError("--workers is for --quant gptq of cpu / gpu (it splits the calibration samples)",
                         hint="other conversions on Ray split the layers: --parts N")
    if name == "ray":
        require("ray", "--executor ray")
    return name == "ray"


def plan(src, cpu=None, gpu=None, *, out=None, threads: int | None = None, placement: dict | None = None,
         targets=None, executor: str = "local", ray_address: str | None = None, parts: int | None = None,
         workers: int | None = None, nodes: int | None = None, node_cpus=None, node_memory=None,
         node_rate: float | None = None, **cpu_option_values) -> PlanResult:
    """What converting `src` would write, checked without reading weights: cpu (CpuOptions or its fields; or
    give the fields as keywords, e.g. plan(src, method="amxint4", numa=2)) and / or gpu (GpuOptions or its
    fields). out: the CPU output folder whose free disk is checked. targets (instead of cpu / gpu / out): the
    outputs of one `convert` pass, as convert takes them (tables, pairs or a targets file): each planned, with
    the pass's combined figures (plan_targets: source bytes read once, the outputs' bytes, peak RAM, disk per
    filesystem). placement: which routed experts SGLang-KT would keep on the GPU, {"ratio": R
    (--kt-gpu-experts-ratio) or "per_layer": N (--kt-num-gpu-experts), "stats": an expert_activation.pt (frequency
    placement; None: SGLang's uniform)}, their VRAM with the gpu options' (or the first GPU target's) expert
    scheme (else placement's "experts" / "group_size", default w4a16 / 128). Raises on every problem (a NUMA
    count that cannot work lists the ones that do).
    executor "ray": also what the Ray run (convert's executor="ray", parts / workers / ray_address as there,
    `threads` CPUs per part) asks of the cluster: result.ray (distributed.ray_plan: per part or GPTQ step its
    CPUs and memory, per node what it runs at once, the default parts / workers and why, bytes read and written
    per part or shipped per layer, the storage bandwidth at `node_rate` GB/s per node). The cluster: nodes x
    node_cpus x node_memory (a size: "512G") described, else the live one at ray_address / RAY_ADDRESS (joined,
    no task started), else none (figures per task). UsageError for those options without executor "ray"."""
    cpu = _options(cpu, CpuOptions) or (CpuOptions.make(**cpu_option_values) if cpu_option_values else None)
    gpu = _options(gpu, GpuOptions)
    wanted = None if targets is None else target_list(targets)
    quant = next((o.quant for o in (cpu, gpu) if o is not None and o.quant == "gptq"), None)
    on_ray = _on_ray(executor, None, ray_address, parts, None, workers, quant)
    cluster, rate = _ray_plan_options(on_ray, ray_address, nodes, node_cpus, node_memory, node_rate)
    if on_ray:
        threads = max(1, threads or 1) if quant is None else threads     # a part's CPUs, as the run's
    if wanted is not None:
        if cpu is not None or gpu is not None or out is not None:
            raise UsageError("plan takes targets or cpu / gpu / out options, not both")
        planned, combined = plan_targets(open_input(src), wanted, threads)
        gpu = next((GpuOptions.make(**t.values) for t in wanted if t.kind == "gpu"), None)   # placement's scheme
        ray = None if not on_ray else ray_plan.plan_on_ray(
            [(t["kind"], t["plan"], t["out"]) for t in planned], cluster, threads=threads, parts=parts,
            workers=workers, node_rate=rate, address=ray_address)
        return PlanResult(source=str(getattr(src, "spec", src)), targets=planned, combined=combined,
                          placement=None if placement is None else _plan_placement(src, gpu, placement), ray=ray)
    if cpu is None and gpu is None and placement is None:
        raise UsageError("nothing to plan", expected="CPU options (method=...), GPU options (gpu=...), targets "
                                                     "and / or a GPU expert placement (placement=...)")
    input = open_input(src)
    cpu_plan, gpu_plan = (None if options is None else KINDS.get(name).plan(input, options, out=out, threads=threads)
                          for name, options in (("cpu", cpu), ("gpu", gpu)))
    planned = [(name, one, out if name == "cpu" else None) for name, one in (("cpu", cpu_plan), ("gpu", gpu_plan))
               if one is not None]
    if on_ray and not planned:
        raise UsageError("--executor ray plans a conversion", expected="--method and / or --experts, or targets")
    ray = None if not on_ray else ray_plan.plan_on_ray(planned, cluster, threads=threads, parts=parts,
                                                       workers=workers, node_rate=rate, address=ray_address)
    return PlanResult(source=input.spec, cpu=cpu_plan, gpu=gpu_plan,
                      placement=None if placement is None else _plan_placement(src, gpu, placement), ray=ray)


def _ray_plan_options(on_ray: bool, ray_address, nodes, node_cpus, node_memory, node_rate) -> tuple:
    """(cluster, node rate in bytes per second) of a Ray plan (ray_plan.cluster_of / check_rate); UsageError for
    a cluster description or rate without executor "ray"."""
    given = [flag for flag, value in (("--nodes", nodes), ("--node-cpus", node_cpus), ("--node-memory", node_memory),
                                      ("--node-rate", node_rate)) if value is not None]
    if not on_ray:
        if given:
            raise UsageError(f"{given[0]} needs --executor ray")
        return None, None
    return ray_plan.cluster_of(ray_address, nodes, node_cpus, node_memory), ray_plan.check_rate(node_rate)


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
           endpoint: str | None = None, calibration=None, compare=None, report=None, max_length: int = 2048,
           num_samples: int | None = None) -> VerifyResult:
    """Check output folder `out` (or a .tar.zst bundle, or with remote="" the hub repo `out`): structure, hashes
    (hashes=True: every file and tensor against ktconvert.json), numerics (the native kernels on the written
    files; against `source` when given: layers None = first/middle/last, "all" or "1,3"; sample_experts: experts
    per layer, a count or "all"; tokens: random activations; threshold: the MoE relative-L2 limit, default per
    method) and remote (remote=REPO: the hub copy's hashes). calibration: a JSON-lines calibration file; the
    numerics then run on the hidden states its tokens produce in `source` (compare: a second output side by
    side; max_length / num_samples: tokens per sample and samples read, as expert_stats). Never raises for a
    failed check: result.ok; raises MissingExtraError (exit 2) when calibration is given, or `out` is a GPU
    checkpoint, without the [gpu] extra.
    report: also write the HTML page of what was measured there (verification.report_html: per-layer error
    curves, layer x expert heat map, worst experts, thresholds), also for a failed verification; its folder must
    exist and lie outside `out` (OutputError / UsageError before anything runs); result.report is its path."""
    if calibration is not None:
        require("gpu", "verify --calibration")
    target = None if report is None else report_html.check_target(report, out)
    result = verify_run.verify(out, source=source, hashes=hashes, tokens=tokens, layers=layers,
                               experts=sample_experts, threshold=threshold, remote=remote, hub=hub,
                               revision=revision, endpoint=endpoint, calibration=calibration, compare=compare,
                               max_length=max_length, num_samples=num_samples)
    if target is not None:
        result["report"] = str(report_html.write_report(target, result))
    return VerifyResult.from_dict(result)


def check(weights, command=None, *, model=None, flags_from=None, cpu_flags: str | None = None,
          deep: bool = False) -> launch_check.CheckResult:
    """Check an SGLang-KT launch command against the weights folder `weights` (any kt-kernel folder or GGUF, with
    or without ktconvert.json), the model and the CPU: the method, NUMA parts, group size, experts, H and I the files
    hold (from headers, names and byte sizes only), the kt-kernel build the CPU loads and what it runs.

    command: the launch command's words (a list; VAR=value words before it are its environment) or one string,
    or just its --kt-* flags; flags_from: a file holding it. model: the model's folder (or config.json) SGLang
    serves (default: the command's --model-path, else the weights' config.json). cpu_flags: another host's CPU flags
    (a list, a cpuinfo / lscpu file or a kt-kernel build name; default: this machine). deep: also decode sampled
    experts and, with ktconvert.json, hash every file.
    Returns a CheckResult: findings (one per mismatch: flag, given, holds, effect, works, severity, line),
    exit_code (4 when kt-kernel would return garbage, crash or refuse; 0 otherwise), works (the flags that work),
    fixed (the corrected command), identified, model, host, bytes_read. Raises InputError (exit 3) for a
    malformed folder (missing shards, layers in different formats, truncated files), UsageError (2) for a
    --cpu-flags value that names no flag.
    """
    return launch_check.check(weights, command, model=model, flags_from=flags_from, cpu_flags=cpu_flags, deep=deep)


def expert_stats(src, out, calibration, *, max_length: int = 2048, num_samples: int | None = None,
                 dtype: str = "float32", report=None, force: bool = False, progress=None) -> dict:
    """Count the calibration tokens each routed expert of checkpoint `src` receives (the model's own router, a
    float forward one decoder layer at a time; dtype "float32" or "bfloat16") into `out` (.pt, the file SGLang-KT's
    frequency placement reads), and the HTML page to `report` when given. calibration: JSON lines of {"text": ...}
    or {"input_ids": [...]}; max_length tokens per sample, the first num_samples samples. Existing files are
    refused unless force. Raises MissingExtraError (exit 2) without the [gpu] extra, before anything is written;
    InputError / OutputError as convert_cpu. Returns {path, report, model_type, layers, moe_layers, experts,
    top_k, tokens, samples, sglang_args, coverage: [{ratio, gpu_experts, routed_share}]}."""
    return activation_stats.expert_stats(src, out, calibration, max_length=max_length, num_samples=num_samples,
                                         dtype=dtype, report=report, force=force, progress=progress)


def bundle(out, dest, *, level: int = ops_bundle.DEFAULT_LEVEL, progress=None, force: bool = False) -> dict:
    """Pack output folder `out` into one deterministic zstd tar `dest` (.tar.zst, ktconvert.json first; level
    1-22), every file checked against the manifest on the way (VerifyError when one differs). An existing `dest`
    is refused (OutputError) unless `force`. Returns {"path", "files", "bytes_in", "bytes_out", "ratio"}."""
    return ops_bundle.bundle(out, dest, level=level, progress=progress, force=force)


def unbundle(src, dest, *, progress=None) -> dict:
    """Restore bundle `src` (.tar.zst) into the new folder `dest`, verifying every file against the bundled
    ktconvert.json; nothing is left behind on failure (VerifyError / InputError). Returns the bundle check's
    report ({"ok", "checked", "problems", ...}) + "dest"."""
    return ops_bundle.unbundle(src, dest, progress=progress)


def publish(out, repo: str, *, hub: str = "hf", revision: str | None = None, private: bool = False,
            endpoint: str | None = None, progress=None, base_model: str | None = None) -> dict:
    """Upload output folder `out` to hub repo `repo` (hub "hf" or "modelscope"; endpoint: the hub's URL, default
    HF_ENDPOINT / MODELSCOPE_ENDPOINT; the token from HF_TOKEN / MODELSCOPE_API_TOKEN or a stored login, never
    printed) after re-hashing it against its ktconvert.json, with a model card stating the launch flags (metadata
    base_model: `base_model`, default the hf:// source ktconvert.json records), then
    check the remote hashes. Resumable: a second call sends only what the hub lacks. VerifyError when `out` or
    the remote does not match, RemoteError (exit 5) on hub failures. Returns {"ok", "hub", "repo", "revision",
    "url", "checked", "missing", "extra", "mismatched", "unverified", "problems", "bytes", "files"}."""
    return ops_hub.publish(out, repo, hub=hub, revision=revision, private=private, endpoint=endpoint,
                           progress=progress, base_model=base_model)


def load_jobs(path) -> list[dict]:
    """Read a TOML job file (examples/jobs.toml): every key typed and checked (InputError naming the job and the
    key), local sources resolved against the file's folder. Returns the jobs as dicts, in file order."""
    return ops_batch.load_jobs(path)


def batch(jobs, *, keep_going: bool = False, dry_run: bool = False, progress=None, executor: str = "local",
          ray_address: str | None = None, summary=None):
    """Run `jobs` (load_jobs' list, or the path of a job file) in order: convert (resumably), bundle, publish; a
    failed job is recorded, not raised, and stops the run unless keep_going. executor "ray": every job a Ray task
    on the cluster at `ray_address` (ops.batch_ray), the same summary. Returns {"ok", "exit_code" (the first
    failed job's), "jobs": [{"name", "status" ok | failed | skipped, "source", "bytes", "outputs", "wall_s",
    "error"?}]}; with dry_run (reads no weights) each output's CPU plan instead: [{"job", "source", "out",
    "publish", "bundle", "plan" (the plan report; None for hub sources), "note"?}]. summary: a file the result is
    also written to as JSON (renamed into place, never written through a symlink)."""
    job_list = jobs if isinstance(jobs, list) else ops_batch.load_jobs(jobs)
    if dry_run:
        return ops_batch.plan_jobs(job_list)
    if _on_ray(executor, None, ray_address, None, None):
        result = batch_ray.run_jobs_on_ray(job_list, keep_going=keep_going, progress=progress, address=ray_address)
    else:
        result = ops_batch.run_jobs(job_list, keep_going=keep_going, progress=progress)
    if summary is not None:
        from ktconvert.formats.fileio import write_atomic

        write_atomic(Path(summary), (json.dumps(result, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return result


def families() -> dict:
    """{"families": {family: [config.json model_type values]}} of every architecture manifest."""
    return {"families": {name: list(m.model_types) for name, m in sorted(_families().items())}}


def methods() -> dict:
    """{"methods": [...]}: every CPU method with kt-kernel's name, whether ktconvert writes it, its layouts, group
    sizes, NUMA rule (n/k multiples) and whether kt-kernel needs AMX to run it."""
    return {"methods": [{"name": m.name, "kt_method": m.kt_method, "writable": m.writable,
                         "converted": m.needs_conversion, "layouts": list(m.layouts) if m.writable else [],
                         "group_sizes": list(m.group_sizes), "quants": list(m.quants), "n_multiple": m.n_multiple,
                         "k_multiple": m.k_multiple, "needs_amx": m.needs_amx,
                         "needs_avx512": m.needs_avx512, "description": (m.__doc__ or "").strip().splitlines()[0]}
                        for m in all_methods()]}


# ---------------------------------------------------------------- what the command line asks

def default_method() -> str:
    """The CPU method `demo` and the docs use when none is given (the one whose class sets ``default``)."""
    return next(m.name for m in all_methods() if m.default)


_DICT_RENDERERS = {"publish": lambda r: ops_hub.render_remote(r) + f"\n{r['url']}",
                   "batch": ops_batch.render_summary, "batch-plan": ops_batch.render_plans,
                   "expert-stats": activation_stats.render}


def render(result, kind: str | None = None) -> str:
    """A result object as the text the command line prints; the dicts of publish / batch / expert_stats with
    kind "publish", "batch" ("batch-plan": batch's dry_run list) or "expert-stats"."""
    if kind is not None:
        return _DICT_RENDERERS[kind](result)
    if isinstance(result, ConvertResult):
        return result.summary()
    if isinstance(result, PlanResult):
        parts = [f"{t['name']}:\n" + KINDS.get(t["kind"]).render(t["plan"].report) for t in result.targets or []]
        parts += [render_combined(result.source, result.targets, result.combined)] if result.targets else []
        parts += [KINDS.get(name).render(one.report) for name, one in (("cpu", result.cpu), ("gpu", result.gpu))
                  if one is not None]
        parts += [ray_plan.render(result.ray)] if result.ray is not None else []
        return "\n\n".join(parts + ([render_placement(result.placement)] if result.placement is not None else []))
    if isinstance(result, VerifyResult):
        text = verify_run.render(result.to_dict())
        return text + (f"\nreport: {result.report}" if result.report else "")
    return inspect_module.render(result.to_dict())

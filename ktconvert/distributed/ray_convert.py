"""``--executor ray``: one conversion (one or several outputs of one source) as Ray tasks, one per layer range.

    plan every output on the driver (all checks, no weight read) -> N ranges of MoE layers of about equal source
    bytes (parts.balanced_ranges) -> one Ray task per range: ``conversion.convert_here(..., layers=range, resume=True)`` into
    PARTS_DIR/<OUT name>/layers-A-B (CPUs: --threads; memory: the plan's peak RAM estimate; the options of a
    local run, --verify-source-hash included) -> on the driver,
    ``merge`` of each output's parts into its OUT (byte-identical to a single run; every part file proven, reused
    finished parts included, and the parts' source sample required to be SRC's as the driver sees it now)

What runs where: the driver plans, shows progress and merges (hard links: no byte copied when PARTS_DIR and OUT
share a filesystem); each task reads only the source files holding its layers and writes its part. SRC and
PARTS_DIR must be the same path on every node (a shared filesystem), or SRC a hub source: then the driver plans
from its small files and shard headers, and each task downloads only the shards it reads into its node's cache
(ops.hub_shards), all at the commit the driver planned from. The hub endpoint variables and
KTCONVERT_MANIFEST_PATH set on the driver reach the tasks through Ray's runtime_env (``TASK_ENV``). Hub tokens
never do (Ray writes a task's runtime_env into its log files, world-readable): they reach a task only when one of
its sources or targets is a hub, as an argument of the task held in memory (``remote_task``: inline in the task's
spec, never in a log, spilled object or file), set in the worker's environment while the task runs. A task whose
worker dies is retried by Ray (``max_retries``) and resumes from its part's journal, so the bytes are the same.
Progress: every task reports its bytes to a small actor the driver reads twice a second.

``import ray`` happens only here, inside the functions: ``ktconvert --help`` never loads it.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from ktconvert.run.local import convert_here, plan_outputs, target_list
from ktconvert.cpu import sizes
from ktconvert.errors import KtConvertError, OutputError, UsageError
from ktconvert.formats.out_manifest import MANIFEST_NAME, load_manifest
from ktconvert.run.inputs import open_input
from ktconvert.distributed.merge import merge, unfinished
from ktconvert.run.outputs import result_of
from ktconvert.ops.remote_names import TOKEN_ENV
from ktconvert.distributed.parts import balanced_ranges, source_sample
from ktconvert.util.progress import Progress
from ktconvert.run.targets import is_gptq

MAX_RETRIES = 3               # Ray re-runs a task whose worker died this many times (each resumes its part)
POLL_SECONDS = 0.5
# what a task reads from the environment as the driver does, sent in runtime_env: hub endpoints, family manifests
TASK_ENV = ("HF_ENDPOINT", "MODELSCOPE_ENDPOINT", "KTCONVERT_MANIFEST_PATH")
TOKEN_VARS = tuple(var for names in TOKEN_ENV.values() for var in names)    # never in runtime_env: hub_tokens


class PartFailed(KtConvertError):
    """A part's conversion failed on its worker; exit_code is the part's own error's."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def convert_on_ray(src, targets: list, *, parts: int | None = None, address: str | None = None, parts_dir=None,
                   threads: int | None = None, resume: bool = False, force: bool = False, progress=None,
                   verify_source_hash: bool = False, runtime_env: dict | None = None) -> list:
    """Convert `targets` ([(OUT, CpuOptions | GpuOptions | dict of their fields)], as ktconvert.api.convert) of
    `src` on a Ray cluster (`address`; None: the one this process is connected to, else a local instance) in
    `parts` layer ranges (None: the cluster's CPUs / threads per task). threads: CPUs per task (default 1).
    resume: an OUT already complete is left alone (its ktconvert.json checked against the plan, as a local
    --resume), an interrupted merge finished. Part folders are always resumed (a rerun after a failure continues
    where the tasks stopped; parts of other options are refused); force: OUTs and their parts emptied first.
    verify_source_hash: as api.convert's, in every task. runtime_env: Ray's runtime_env of the tasks (e.g.
    {"env_vars": {...}}; TASK_ENV's variables set here are added). UsageError for a --quant gptq target (each
    layer needs the previous one's outputs). Returns one ConvertResult per OUT."""
    t0 = time.monotonic()
    progress = progress or Progress()
    cpus = max(1, threads or 1)
    wanted = target_list(targets)
    refuse_gptq(wanted)
    spec, orientation = source_spec(src)
    input = open_input(spec, orientation, in_part=True)
    source = {"src": pinned_spec(spec, input.hub), "expert_orientation": orientation, "listing": input.listing}
    outputs = plan_outputs(input, wanted, threads=cpus)
    todo = [k for k, output in enumerate(outputs) if not _finished(output, resume)]
    timings = {"plan": time.monotonic() - t0}
    if todo:
        _check_outs([outputs[k] for k in todo], force, resume)
        _convert_parts(source, verify_source_hash, outputs, todo, parts, address, parts_dir, force, cpus,
                       task_runtime_env(runtime_env), hub_tokens(is_hub(spec)), progress, timings)
    timings["total"] = time.monotonic() - t0
    return [result_of(o, load_manifest(o.out_dir) if k in todo else None, timings if k in todo else {})
            for k, o in enumerate(outputs)]


def _convert_parts(source: dict, verify_source_hash, outputs, todo, parts, address, parts_dir, force, cpus,
                   runtime_env: dict, tokens: dict, progress, timings: dict) -> None:
    """The outputs numbered `todo` as Ray tasks of `parts` layer ranges on `source` (open_input's keywords, as
    every task opens it), merged into their OUTs; timings completed with convert and merge seconds. runtime_env:
    the task option {"runtime_env": ...} or {}; tokens: hub_tokens, handed to every task (``remote_task``)."""
    t0 = time.monotonic()
    ray = connect(address)
    layers = outputs[0].layers
    count = parts or max(1, min(len(layers), int(ray.cluster_resources().get("CPU", 1)) // cpus))
    layer_bytes = _layer_bytes(outputs[0].source, layers)
    ranges = balanced_ranges(layer_bytes, count)
    folders = _part_folders(outputs, ranges, parts_dir, force)
    resources = {"num_cpus": cpus, "memory": _memory(outputs, cpus), "max_retries": MAX_RETRIES, **runtime_env}
    _check_feasible(ray, resources)
    _run_tasks(ray, (source, verify_source_hash), outputs, todo, ranges, folders, resources, tokens, progress,
               sum(layer_bytes.values()))
    timings["convert"] = time.monotonic() - t0
    t1 = time.monotonic()
    identity = source_sample(outputs[0].source, source["listing"])    # what reused parts must have read
    for k in todo:
        merge(outputs[k].out_dir, [folders[(k, r)] for r in ranges], source=identity)
    timings["merge"] = time.monotonic() - t1


def _finished(output, resume: bool) -> bool:
    """With resume, True for an OUT a finished run or merge left, once its ktconvert.json is found to record this
    plan (ResumeMismatchError otherwise, as a local --resume)."""
    out = output.out_dir
    if not resume or unfinished(out) or not (out / MANIFEST_NAME).is_file():
        return False
    output.check_finished()
    return True


def refuse_gptq(targets: list) -> None:
    """UsageError for a --quant gptq target: its layers cannot run as independent parts."""
    for target in targets:
        if is_gptq(target):
            raise UsageError(f"{target.name}: layer-range parts are not available with --quant gptq",
                             hint="GPTQ needs every layer in order: convert it alone with cpu / gpu "
                                  "(--executor ray --workers N splits its calibration samples instead)")


def task_runtime_env(runtime_env: dict | None) -> dict:
    """The task option {"runtime_env": ...}: `runtime_env` with TASK_ENV's variables set on the driver added to
    its env_vars (its own values win); {} when there is nothing to set. No hub token is added (``hub_tokens``)."""
    env = dict(runtime_env or {})
    env_vars = {**{k: os.environ[k] for k in TASK_ENV if os.environ.get(k)}, **env.get("env_vars", {})}
    if env_vars:
        env["env_vars"] = env_vars
    return {"runtime_env": env} if env else {}


def is_hub(spec) -> bool:
    """Whether `spec` (a source, or a publish target) names a hub: hf://... or ms://..."""
    return str(spec).startswith(("hf://", "ms://"))


def hub_tokens(needed: bool) -> dict[str, str]:
    """{variable: value} of the hub token variables set on the driver (TOKEN_VARS) when `needed` (a source or
    target of the tasks is a hub), else {}: what ``remote_task`` hands the tasks."""
    return {var: os.environ[var] for var in TOKEN_VARS if needed and os.environ.get(var)}


def remote_task(ray, fn, tokens: dict, **options):
    """``ray.remote(fn).options(**options)``, called the same way (``.remote(*args)``). With `tokens` (hub_tokens)
    the task gets them as a first argument, inline in its spec (memory only: Ray logs a task's runtime_env, not its
    arguments), and runs fn with them set in its worker's environment (``token_env``)."""
    if not tokens:
        return ray.remote(fn).options(**options)
    return _TokenTask(ray.remote(_with_tokens(fn)).options(**options), tokens)


class _TokenTask:
    def __init__(self, remote, tokens: dict):
        self.remote_function, self.tokens = remote, tokens

    def remote(self, *args):
        return self.remote_function.remote(self.tokens, *args)


def _with_tokens(fn):
    def call(tokens: dict, *args):
        with token_env(tokens):
            return fn(*args)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "task")
    return call


@contextmanager
def token_env(tokens: dict):
    """`tokens` set in os.environ while the block runs, the previous values restored after (a worker is reused)."""
    saved = {var: os.environ.get(var) for var in tokens}
    os.environ.update(tokens)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def source_spec(src) -> tuple[str, str | None]:
    """(SRC as every node opens it: an absolute path or a hub spec, --expert-orientation) of `src` (a path, a
    spec or an opened inputs.Input)."""
    spec = str(getattr(src, "spec", src))
    orientation = getattr(src, "hub", {}).get("expert_orientation")
    if not is_hub(spec):
        spec = str(Path(spec).resolve())
    return spec, orientation


def pinned_spec(spec: str, hub: dict) -> str:
    """A hub `spec` at the commit the driver planned from (every task reads the same revision); else `spec`."""
    if not hub.get("revision"):
        return spec
    scheme, rest = spec.split("://", 1)
    return f"{scheme}://{rest.split('@', 1)[0]}@{hub['revision']}"


def _check_outs(outputs: list, force: bool, resume: bool) -> None:
    """Every OUT new or empty (emptied with force; with resume also one holding a finished or unfinished merge,
    which the merge finishes): refused here, before any task starts."""
    for output in outputs:
        out = output.out_dir
        if out.exists() and not out.is_dir():
            raise OutputError("output path exists and is not a directory", file=str(out))
        if out.exists() and any(out.iterdir()):
            if resume and (unfinished(out) or (out / MANIFEST_NAME).is_file()):
                continue
            if not force:
                raise OutputError("output directory exists and is not empty", file=str(out),
                                  hint="pass --force to start over, or --resume to finish an interrupted run")
            shutil.rmtree(out)


def connect(address: str | None):
    """The ray module, connected to `address` (or the cluster this process already joined, or a new local one)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    return ray


def _check_feasible(ray, resources: dict) -> None:
    """UsageError when no live node has the CPUs and memory a task asks for (Ray would wait for one forever)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not any(n.get("CPU", 0) >= resources["num_cpus"] and n.get("memory", 0) >= resources["memory"]
               for n in nodes):
        largest = max(nodes, key=lambda n: (n.get("CPU", 0), n.get("memory", 0)), default={})
        raise UsageError("no Ray node can run a part", expected=f"{resources['num_cpus']} CPUs and "
                         f"{resources['memory'] >> 20} MiB (the plan's peak RAM estimate)",
                         found=f"at most {largest.get('CPU', 0):g} CPUs, {int(largest.get('memory', 0)) >> 20} MiB",
                         hint="use fewer --threads per part")


def _layer_bytes(source, layers: list[int]) -> dict[int, int]:
    """{MoE layer: source bytes of its expert matrices} (what the ranges balance and the progress counts)."""
    layer_bytes = dict.fromkeys(layers, 0)
    for job in source.matrix_jobs(layers):
        layer_bytes[job.layer] += job.nbytes
    return layer_bytes


def _part_folders(outputs: list, ranges: list, parts_dir, force: bool) -> dict:
    """{(output index, range): absolute part folder}: PARTS_DIR/<OUT name>/layers-A-B (PARTS_DIR default
    OUT.parts next to the first OUT). With force the folders of these outputs are emptied first."""
    first = outputs[0].out_dir.resolve()
    root = Path(parts_dir).resolve() if parts_dir else first.with_name(first.name + ".parts")
    names = [o.out_dir.name for o in outputs]
    if len(set(names)) != len(names):
        names = [f"{k}-{name}" for k, name in enumerate(names)]
    if force:
        for name in names:
            shutil.rmtree(root / name, ignore_errors=True)
    return {(k, r): root / names[k] / f"layers-{r[0]}-{r[1]}" for k in range(len(outputs)) for r in ranges}


def _memory(outputs: list, cpus: int) -> int:
    """Bytes a task declares: the largest of the outputs' peak RAM estimates with `cpus` workers."""
    info = outputs[0].source.info
    estimates = [o.plan.report.get("peak_ram_bytes") or 0 for o in outputs]
    estimates.append(sizes.peak_ram(outputs[0].source, info.hidden, info.intermediate, 1, cpus)["peak_ram_bytes"])
    return int(max(estimates))


def _run_tasks(ray, source: tuple, outputs, todo: list[int], ranges, folders, resources: dict, tokens: dict,
               progress, total: int) -> None:
    """One task per range with `resources` (Ray task options) and `tokens` on `source` ((source,
    verify_source_hash) as run_part takes them), writing the parts of the outputs numbered `todo`; the driver's
    progress sums what the tasks report, out of `total` (the source bytes of every MoE layer's experts).
    PartFailed names a failed part."""
    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    task = remote_task(ray, run_part, tokens, **resources)
    cpus = resources["num_cpus"]
    refs = {}
    for index, r in enumerate(ranges):
        targets = [(str(folders[(k, r)]), outputs[k].plan.options) for k in todo]
        refs[task.remote(*source, targets, r, cpus, board, index)] = r
    progress.start(total, len(outputs[0].layers), f"{len(ranges)} parts on Ray: "
                   + " + ".join(outputs[k].label() for k in todo), unit="layers")
    shown, pending = 0, list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_SECONDS)
        for ref in ready:
            _raise_failed(ray, ref, refs[ref], folders)
        done_bytes, done_layers = ray.get(board.totals.remote())
        if done_bytes > shown:
            progress.advance(done_bytes - shown, items=max(0, done_layers - progress.items_done))
            shown = done_bytes
    progress.advance(max(0, total - shown), items=max(0, len(outputs[0].layers) - progress.items_done))


def _raise_failed(ray, ref, layer_range, folders) -> None:
    where = ", ".join(str(f) for (k, r), f in folders.items() if r == layer_range)
    try:
        outcome = ray.get(ref)
    except ray.exceptions.RayError as exc:
        raise PartFailed(f"part {where}: Ray task failed after {MAX_RETRIES} retries "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", 1) from None
    if outcome.get("error"):
        raise PartFailed(f"part {where}: {outcome['error']}", outcome["exit_code"])


class ProgressBoard:
    """Ray actor: the bytes and layers each part reported so far (a retried part reports afresh)."""

    def __init__(self):
        self.parts: dict[int, tuple[int, int]] = {}

    def report(self, part: int, nbytes: int, layers: int) -> None:
        self.parts[part] = (nbytes, layers)

    def totals(self) -> tuple[int, int]:
        return sum(b for b, _ in self.parts.values()), sum(n for _, n in self.parts.values())


class BoardProgress(Progress):
    """A task's progress: its counters sent to the ProgressBoard every `interval` seconds and at the end."""

    def __init__(self, board, part: int, interval: float = POLL_SECONDS):
        super().__init__(interval=interval)
        self.board, self.part = board, part

    def _on_advance(self, nbytes: int, due: bool) -> None:
        if due:
            self.board.report.remote(self.part, self.bytes_done, self.items_done)

    def _on_done(self, status: str) -> None:
        self.board.report.remote(self.part, self.bytes_done, self.items_done)


def run_part(source: dict, verify_source_hash: bool, targets: list, layer_range: tuple[int, int], threads: int,
             board, index: int) -> dict:
    """A Ray task: the part `layer_range` of every target of `source` (open_input's keywords: the pinned spec,
    the orientation and the hub listing the driver planned from), resumed from its journal when a previous
    attempt of this task died. Returns {} or {"error": one line, "exit_code": n} for a ktconvert error."""
    progress = BoardProgress(board, index)
    try:
        with progress:
            convert_here(open_input(**source, in_part=True), targets, threads=threads, resume=True,
                         layers=layer_range, progress=progress, verify_source_hash=verify_source_hash)
    except KtConvertError as exc:
        return {"error": str(exc), "exit_code": exc.exit_code}
    return {}

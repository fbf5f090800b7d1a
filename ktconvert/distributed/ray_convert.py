"""``--executor ray``: one conversion (one or several outputs of one source) as Ray tasks, one per layer range.

    plan every output on the driver (all checks, no weight read) -> N ranges of MoE layers of about equal source
    bytes (parts.balanced_ranges) -> one Ray task per range: ``convert_here(..., layers=range, resume=True)`` into
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

No single point of failure besides the driver: progress is what the finished tasks returned plus what the running
ones report to a small actor (pinned softly to the driver's node, restarted by Ray wherever it can run, and fed
again by the next reports); when that actor is lost or unreachable the driver says so in one line and goes on
counting finished parts. Before any task: the plan's resources are checked against the live nodes, and a
pre-flight task on each node that may run a part checks its ktconvert version, SRC and that the parts folder is
the driver's (``preflight``: exit 3 naming the node, before a byte of output). Parts already there are kept only
when they record this ktconvert version and these options (``parts.stale_reason``; others are converted again).
A task first looks at its part's lock: a holder Ray has given up on (an earlier attempt of the same task, a task
on a dead node) or a dead pid on its host is taken over, a live one named with its host (``parts.lock_state``).
A part whose task runs on a node Ray has declared dead (a frozen node: Ray never finds its worker dead, so never
retries the task) is started again by the driver (``_restart_lost``). Ray's own messages and the driver's fault
notes go to PARTS_DIR/ray.log, one line per fault on the progress (``ray_runtime.ray_output``).

``import ray`` happens only inside functions (here and in the modules beside this one): ``ktconvert --help``
never loads it.
"""
from __future__ import annotations

import os
import shutil
import socket
import time
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path

from ktconvert.run.local import convert_here, plan_outputs, target_list
from ktconvert.cpu import sizes
from ktconvert.errors import EXIT_ERROR, KtConvertError, OutputError, UsageError
from ktconvert.formats.out_manifest import MANIFEST_NAME, load_manifest
from ktconvert.run.inputs import open_input
from ktconvert.distributed.merge import merge, unfinished
from ktconvert.distributed.preflight import preflight
from ktconvert.distributed.ray_progress import POLL_SECONDS, BoardProgress, BoardWatch, start_board
from ktconvert.distributed.ray_runtime import (RAY_LOG, connect, note_fault, ray_initialized, ray_output,
                                               shut_down_after)
from ktconvert.run.output import lock_folder
from ktconvert.run.outputs import result_of
from ktconvert.ops.remote_names import TOKEN_ENV
from ktconvert.distributed.parts import (balanced_ranges, lock_state, read_task_record, source_sample, stale_reason,
                                         task_record_path, write_task_record)
from ktconvert.util.progress import Progress
from ktconvert.run.targets import is_gptq

MAX_RETRIES = 3               # Ray re-runs a task whose worker died this many times (each resumes its part)
NODE_CHECK_SECONDS = 5        # how often the driver looks for running parts on nodes Ray counts dead
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
    `parts` layer ranges (None: what the nodes run at once by CPUs and memory, ``default_parts``). threads: CPUs
    per task (default 1). resume: an OUT already complete is left alone (its ktconvert.json checked against the
    plan, as a local --resume), an interrupted merge finished. Part folders are always resumed (a rerun after a
    failure continues where the tasks stopped; parts of another version or other options are converted again);
    force: OUTs and their parts emptied first.
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
    joined_here = not ray_initialized()
    ray = connect(address)
    resources = {"num_cpus": cpus, "memory": part_memory(outputs, cpus), "max_retries": MAX_RETRIES, **runtime_env}
    nodes = check_feasible(ray, resources)
    root = parts_root(outputs, parts_dir)
    root.mkdir(parents=True, exist_ok=True)
    with ray_output(root / RAY_LOG, progress), shut_down_after(ray, joined_here):
        for line in preflight(ray, nodes, source["src"], _source_files(outputs[0].source, source), root,
                              runtime_env):
            progress.message(line)
        layers = outputs[0].layers
        count = parts or default_parts(nodes, resources, len(layers))
        layer_bytes = moe_layer_bytes(outputs[0].source, layers)
        ranges = balanced_ranges(layer_bytes, count)
        folders = _part_folders(outputs, ranges, root, force)
        _redo_stale(outputs, todo, ranges, folders, progress)
        _run_tasks(ray, (source, verify_source_hash), outputs, todo, ranges, folders, resources, tokens, progress,
                   layer_bytes, root / RAY_LOG)
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
        spec = os.path.abspath(spec)      # symlinks kept: the name the user gave is the one other nodes have
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


def check_feasible(ray, resources: dict) -> list[dict]:
    """The live nodes (ray.nodes() entries) with the CPUs and memory a task asks for; UsageError when there is
    none (Ray would wait for one forever)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    able = [n for n in alive if n["Resources"].get("CPU", 0) >= resources["num_cpus"]
            and n["Resources"].get("memory", 0) >= resources["memory"]]
    nodes = [n["Resources"] for n in alive]
    if not able:
        largest = max(nodes, key=lambda n: (n.get("CPU", 0), n.get("memory", 0)), default={})
        raise UsageError("no Ray node can run a part", expected=f"{resources['num_cpus']} CPUs and "
                         f"{resources['memory'] >> 20} MiB (the plan's peak RAM estimate)",
                         found=f"at most {largest.get('CPU', 0):g} CPUs, {int(largest.get('memory', 0)) >> 20} MiB",
                         hint="use fewer --threads per part")
    return able


def default_parts(nodes: list[dict], resources: dict, layers: int) -> int:
    """--parts when not given: as many tasks of `resources` ({"num_cpus", "memory"}) as the `nodes` (ray.nodes()
    entries) run at once, each node by its CPUs and its memory, at most one per MoE layer; at least 1."""
    at_once = sum(tasks_at_once(n["Resources"], resources["num_cpus"], resources["memory"])[0] for n in nodes)
    return max(1, min(layers, at_once))


def tasks_at_once(node: dict, cpus: float, memory: int) -> tuple[int, str]:
    """(how many tasks of `cpus` CPUs and `memory` bytes a node with resources `node` ({"CPU", "memory"}) runs
    at once, what bounds it: "CPUs" or "memory"): Ray schedules by what tasks declare."""
    by_cpus, by_memory = int(node.get("CPU", 0) // cpus), int(node.get("memory", 0) // max(1, memory))
    return min(by_cpus, by_memory), "CPUs" if by_cpus <= by_memory else "memory"


def _source_files(source, opened: dict) -> dict[str, int] | None:
    """{absolute path: bytes} of the weight files a local SRC's plan reads, which the pre-flight finds on every
    node; None for a hub source (each node downloads what it reads)."""
    if opened["listing"] or is_hub(opened["src"]):
        return None
    return {os.path.abspath(path): os.stat(path).st_size for path in sorted(source.files())}


def moe_layer_bytes(source, layers: list[int]) -> dict[int, int]:
    """{MoE layer: source bytes of its expert matrices} (what the ranges balance and the progress counts)."""
    layer_bytes = dict.fromkeys(layers, 0)
    for job in source.matrix_jobs(layers):
        layer_bytes[job.layer] += job.nbytes
    return layer_bytes


def parts_root(outputs: list, parts_dir) -> Path:
    """PARTS_DIR as an absolute path (symlinks kept: other nodes know it by that name), default OUT.parts next to
    the first OUT."""
    first = Path(os.path.abspath(outputs[0].out_dir))
    return Path(os.path.abspath(parts_dir)) if parts_dir else first.with_name(first.name + ".parts")


def _part_folders(outputs: list, ranges: list, root: Path, force: bool) -> dict:
    """{(output index, range): absolute part folder}: PARTS_DIR/<OUT name>/layers-A-B (`root`: parts_root). With
    force the folders of these outputs are emptied first."""
    names = [o.out_dir.name for o in outputs]
    if len(set(names)) != len(names):
        names = [f"{k}-{name}" for k, name in enumerate(names)]
    if force:
        for name in names:
            shutil.rmtree(root / name, ignore_errors=True)
    return {(k, r): root / names[k] / f"layers-{r[0]}-{r[1]}" for k in range(len(outputs)) for r in ranges}


def _redo_stale(outputs: list, todo: list[int], ranges: list, folders: dict, progress) -> None:
    """Empty the part folders another ktconvert version or other options wrote (``parts.stale_reason``), saying
    so in one line each; one whose lock a live task holds is left to that task (its own run reports it)."""
    for k in todo:
        options = outputs[k].journal_options()
        for r in ranges:
            folder = folders[(k, r)]
            why = stale_reason(folder, options)
            if why is None:
                continue
            try:
                fd = lock_folder(folder)
            except OutputError:
                continue
            try:
                shutil.rmtree(folder)
            finally:
                os.close(fd)
            task_record_path(folder).unlink(missing_ok=True)
            progress.message(f"part {folder}: {why}; converting it again")


def part_memory(outputs: list, cpus: int) -> int:
    """Bytes a task declares: the largest of the outputs' peak RAM estimates with `cpus` workers."""
    info = outputs[0].source.info
    estimates = [o.plan.report.get("peak_ram_bytes") or 0 for o in outputs]
    estimates.append(sizes.peak_ram(outputs[0].source, info.hidden, info.intermediate, 1, cpus)["peak_ram_bytes"])
    return int(max(estimates))


def _run_tasks(ray, source: tuple, outputs, todo: list[int], ranges, folders, resources: dict, tokens: dict,
               progress, layer_bytes: dict[int, int], log: Path) -> None:
    """One task per range with `resources` (Ray task options) and `tokens` on `source` ((source,
    verify_source_hash) as run_part takes them), writing the parts of the outputs numbered `todo`; the driver's
    progress counts the finished parts and what the running ones report (``BoardWatch``), out of the source bytes
    of every MoE layer's experts (`layer_bytes`). PartFailed names a failed part."""
    board = start_board(ray)
    task = remote_task(ray, run_part, tokens, **resources)
    cpus = resources["num_cpus"]
    refs, sizes = {}, {}
    for index, r in enumerate(ranges):
        targets = [(str(folders[(k, r)]), outputs[k].plan.options) for k in todo]
        call = (*source, targets, r, cpus, board, index)
        refs[task.remote(*call)] = (index, r, call)
        sizes[index] = [layer_bytes[layer] for layer in layer_bytes if r[0] <= layer <= r[1]]
    total, layers = sum(layer_bytes.values()), len(outputs[0].layers)
    progress.start(total, layers, f"{len(ranges)} parts on Ray: " + " + ".join(outputs[k].label() for k in todo),
                   unit="layers")
    watch, finished, checked = BoardWatch(ray, board, progress), set(), time.monotonic()
    shown, pending = (0, 0), list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_SECONDS)
        for ref in ready:
            index, r, _ = refs[ref]
            for note in _outcome(ray, ref, r, folders, log):
                note_fault(note, progress)
            finished.add(index)
        if pending and time.monotonic() - checked > NODE_CHECK_SECONDS:
            pending, checked = _restart_lost(ray, task, refs, pending, progress), time.monotonic()
        running = {i: nbytes for i, (nbytes, _) in watch.poll().items() if i not in finished}
        now = (sum(sum(sizes[i]) for i in finished) + sum(running.values()),
               sum(len(sizes[i]) for i in finished)
               + sum(sum(1 for upto in accumulate(sizes[i]) if upto <= nbytes) for i, nbytes in running.items()))
        if now[0] > shown[0] or now[1] > shown[1]:
            progress.advance(max(0, now[0] - shown[0]), items=max(0, now[1] - shown[1]))
            shown = (max(now[0], shown[0]), max(now[1], shown[1]))
    progress.advance(max(0, total - shown[0]), items=max(0, layers - shown[1]))


def _restart_lost(ray, task, refs: dict, pending: list, progress) -> list:
    """`pending` with each task whose part's task record puts it on a node Ray counts dead replaced by the same task
    started again (`refs` updated; the lost one cancelled), one fault note each: Ray retries a task only once it
    finds its worker dead, which a frozen node's never is (its node declared dead, the task stays pending); the new
    attempt takes the lost one's part lock over (``parts.lock_state``)."""
    alive, kept = None, []
    for ref in pending:
        index, r, call = refs[ref]
        folder = call[2][0][0]
        record = read_task_record(folder)
        if record.get("task_id") != ref.task_id().hex() or not record.get("node_id"):
            kept.append(ref)              # not started yet, or the record is of another attempt
            continue
        alive = alive if alive is not None else alive_nodes()
        if record["node_id"] in alive:
            kept.append(ref)
            continue
        try:
            ray.cancel(ref)
        except Exception:                 # noqa: BLE001  whatever Ray says of a task on a dead node: it is replaced
            pass
        new = task.remote(*call)
        refs[new] = refs[ref]
        kept.append(new)
        note_fault(f"part {folder}: its Ray node {record['node_id'][:16]} is dead and Ray has not retried it; "
                   "started again", progress)
    return kept


def _outcome(ray, ref, layer_range, folders, log: Path) -> list[str]:
    """The notes of a finished part's task (locks taken over); PartFailed when it failed (naming Ray's `log` when
    Ray gave up on it)."""
    where = ", ".join(str(f) for (k, r), f in folders.items() if r == layer_range)
    try:
        outcome = ray.get(ref)
    except ray.exceptions.RayError as exc:
        raise PartFailed(f"part {where}: Ray gave up on its task ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}; details: {log}); the same command with --resume goes on "
                         "from the parts done", 1) from None
    if outcome.get("error"):
        raise PartFailed(f"part {where}: {outcome['error']}", outcome["exit_code"])
    return outcome.get("notes", [])


def this_task() -> dict:
    """{"host", "pid", "node_id", "task_id"} of the Ray task running this code (a part's lock holder)."""
    import ray

    context = ray.get_runtime_context()
    return {"host": socket.gethostname(), "pid": os.getpid(), "node_id": context.get_node_id(),
            "task_id": context.get_task_id()}


def alive_nodes() -> set[str]:
    """The ids of the nodes Ray counts alive."""
    import ray

    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def run_part(source: dict, verify_source_hash: bool, targets: list, layer_range: tuple[int, int], threads: int,
             board, index: int) -> dict:
    """A Ray task: the part `layer_range` of every target of `source` (open_input's keywords: the pinned spec,
    the orientation and the hub listing the driver planned from), resumed from its journal when a previous
    attempt of this task died. Each part's lock is looked at first (``parts.lock_state``: a stale holder's taken
    over, a live one's refused naming its host) and the task recorded as the part's (``parts.write_task_record``).
    Returns {"notes": [lines]} or {"error": one line, "exit_code": n} for a ktconvert error or a live holder."""
    me, notes = this_task(), []
    progress = BoardProgress(board, index)
    try:
        for folder, _ in targets:
            state, text = lock_state(folder, me, alive_nodes)
            if state == "held":
                return {"error": f"its lock is {text}: wait for that task or stop it", "exit_code": EXIT_ERROR}
            if state == "taken":
                notes.append(f"part {folder}: {text}")
            write_task_record(folder, me)
        with progress:
            convert_here(open_input(**source, in_part=True), targets, threads=threads, resume=True,
                         layers=layer_range, progress=progress, verify_source_hash=verify_source_hash)
    except KtConvertError as exc:
        return {"error": str(exc), "exit_code": exc.exit_code}
    except OSError as exc:                # the parts folder itself (its task record): not writable there
        return {"error": f"{exc.strerror or exc}: {exc.filename}", "exit_code": EXIT_ERROR}
    return {"notes": notes}

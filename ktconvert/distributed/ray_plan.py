"""``ktconvert plan --executor ray``: what a Ray run of a plan would ask of the cluster, before anything runs.

    cluster = cluster_of(address, nodes, node_cpus, node_memory)     # live, given or None (validated first)
    report = plan_on_ray(planned, cluster, threads=, parts=, workers=, node_rate=)

Layer-range parts (RTN / mse outputs, ``ray_convert.convert_on_ray``): the CPUs (``--threads``) and memory (the
run's ``ray_convert.part_memory``: the plan's peak RAM estimate) every part task declares, the nodes able to run one
(``ray_convert.check_feasible``) and the parts each runs at once (``ray_convert.tasks_at_once``), the part count
(``--parts``, else ``ray_convert.default_parts``), each part's MoE layers (``parts.balanced_ranges`` over
``ray_convert.moe_layer_bytes``), the source bytes it reads (``run.outputs.part_files``) and about the bytes it
writes (the outputs' layer bytes in proportion to its source bytes, the files of no layer with the first part),
and the storage bandwidth the busy nodes need at a per-node conversion rate (``--node-rate``, else NODE_RATE).
GPTQ (``ray_gptq``): the workers and each step's memory (``step_resources``: ``--workers`` or
``default_workers``, ``task_memory``), each step's tasks (``gptq.distributed.contiguous``: slices and owners),
per node the tasks it runs at once, and the bytes shipped between tasks per MoE layer (``shipped_per_layer``).

The cluster is the live one at ``--ray-address`` / RAY_ADDRESS (``ray.nodes()`` read after joining it; no task
is started), N identical nodes described by ``--nodes N --node-cpus C --node-memory SIZE`` (``GivenCluster``, which
answers ``nodes()`` as Ray does, so the run's own functions read it), or none (then the figures are per task).
Every figure is computed from the plan and the model's dims, none measured, except NODE_RATE's default.
"""
from __future__ import annotations

import math
import os
import re
import socket
import sys
from contextlib import contextmanager

from ktconvert.cpu.plan import gib
from ktconvert.errors import KtConvertError, UsageError
from ktconvert.kinds import KINDS
from ktconvert.run.local import target_output
from ktconvert.run.outputs import part_files
from ktconvert.gptq.calibration import load_samples
from ktconvert.gptq.distributed import contiguous
from ktconvert.util.extras import require
from ktconvert.distributed.parts import balanced_ranges
from ktconvert.distributed.ray_convert import check_feasible, default_parts, moe_layer_bytes, part_memory, tasks_at_once
from ktconvert.distributed.ray_runtime import connect, route_to_log, temp_log
from ktconvert.distributed import ray_gptq

# One node's conversion rate (source bytes per second, all its parts together) when --node-rate is not given:
# measured, README "Benchmarks" (bench_convert.py: the INT4 AMX method, T=2, 2 cores, every hash): 0.87 GB/s.
NODE_RATE = 0.87e9
NODE_RATE_SOURCE = "measured: 2 cores, every hash; README Benchmarks"
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?", re.IGNORECASE)


class GivenCluster:
    """N identical nodes of C CPUs and M bytes of memory, answering ``nodes()`` / ``cluster_resources()`` as a
    joined ``ray`` does (no GPUs): the cluster the run's functions are asked about when there is no live one."""

    def __init__(self, count: int, cpus: float, memory: int):
        self.count, self.cpus, self.memory = count, cpus, memory

    def nodes(self) -> list[dict]:
        return [{"NodeID": f"given-{i}", "NodeManagerHostname": f"node {i}", "Alive": True,
                 "Resources": {"CPU": float(self.cpus), "memory": float(self.memory)}} for i in range(self.count)]

    def cluster_resources(self) -> dict:
        return {"CPU": float(self.cpus * self.count), "memory": float(self.memory * self.count)}

    def describe(self) -> str:
        return f"{self.count} nodes given (--nodes), {self.cpus:g} CPUs and {gib(self.memory)} each"


def parse_size(text, flag: str = "--node-memory") -> int:
    """Bytes of a size written as a number with an optional unit: K / M / G / T (powers of 1000; Ray's `ray start
    --memory` takes bytes) or KiB / MiB / GiB / TiB (powers of 1024), e.g. 512G, 1.5T, 256GiB. UsageError
    otherwise."""
    match = _SIZE.fullmatch(str(text).strip())
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"{flag} is not a size", expected="a positive number of bytes, or with K, M, G, T (10^3...) "
                         "or KiB, MiB, GiB, TiB (2^10...), e.g. 512G", found=str(text))
    number, unit, binary = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def cluster_of(address: str | None = None, nodes: int | None = None, node_cpus=None, node_memory=None):
    """The cluster a Ray plan is figured for, its options checked first: a GivenCluster of `nodes` x `node_cpus`
    CPUs x `node_memory` (a size: parse_size; all three or none, not with `address`), else "live" when `address`
    or RAY_ADDRESS names a cluster to join or this process joined one (``joined``), else None. UsageError for a
    bad or partial description."""
    described = {"--nodes": nodes, "--node-cpus": node_cpus, "--node-memory": node_memory}
    given = [flag for flag, value in described.items() if value is not None]
    if not given:
        joined_here = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        return "live" if address or os.environ.get("RAY_ADDRESS") or joined_here else None
    if address:
        raise UsageError(f"{given[0]} describes a cluster; --ray-address reads a live one: give one or the other")
    if len(given) < len(described):
        missing = [flag for flag in described if flag not in given]
        raise UsageError(f"{given[0]} needs {' and '.join(missing)} too", expected="--nodes N --node-cpus C "
                         "--node-memory SIZE (N identical nodes)")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise UsageError("--nodes must be a whole number of at least 1", found=repr(nodes))
    if isinstance(node_cpus, bool) or not isinstance(node_cpus, (int, float)) or not node_cpus >= 1:
        raise UsageError("--node-cpus must be a number of at least 1", found=repr(node_cpus))
    return GivenCluster(nodes, node_cpus, parse_size(node_memory))


def check_rate(node_rate) -> float | None:
    """--node-rate (GB/s) in bytes per second, None when not given; UsageError when it is not a positive number."""
    if node_rate is None:
        return None
    if isinstance(node_rate, bool) or not isinstance(node_rate, (int, float)) or not 0 < node_rate < math.inf:
        raise UsageError("--node-rate must be a positive number of GB/s", found=repr(node_rate))
    return float(node_rate) * 1e9


@contextmanager
def joined(address: str | None):
    """The ``ray`` module joined to the cluster at `address` (None: RAY_ADDRESS, or the one this process joined)
    as the run joins it (``ray_runtime.connect``, Ray's messages to a log file, never stdout); disconnected after
    when this call joined it. KtConvertError (one line) when there is no cluster there."""
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    was_joined = ray.is_initialized()
    try:
        if not was_joined:
            _reachable(target)
        connect(target)
    except (OSError, RuntimeError, ValueError) as exc:
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise KtConvertError(f"cannot join the Ray cluster at {target} ({text})",
                             hint="start it (`ray start --head`), or describe one: --nodes N --node-cpus C "
                                  "--node-memory SIZE") from None
    route_to_log(temp_log())
    try:
        yield ray
    finally:
        if not was_joined:
            ray.shutdown()


def _reachable(address: str, timeout: float = 5.0) -> None:
    """OSError when `address` is HOST:PORT and nothing answers there within `timeout` seconds (ray.init would
    retry for minutes); other forms ("auto", ray://...) are left to Ray."""
    host, _, port = str(address).rpartition(":")
    if host and port.isdigit() and "://" not in address:
        socket.create_connection((host, int(port)), timeout=timeout).close()


def plan_on_ray(planned: list, cluster, *, threads: int | None = None, parts: int | None = None,
                workers: int | None = None, node_rate: float | None = None, address: str | None = None) -> dict:
    """What a Ray run of `planned` ([(kind name, plan, OUT or None)], one `convert` pass, planned with `threads`
    workers) asks of `cluster` (cluster_of's: a GivenCluster, "live" or None): layer-range parts, or for one
    --quant gptq output its steps (module docstring). node_rate: bytes per second per node (check_rate; None:
    NODE_RATE). Raises what the run raises before its tasks (no node can run a task, --parts beyond the MoE layers)."""
    gptq = [entry for entry in planned if entry[1].options.quant == "gptq"]
    if gptq and len(planned) > 1:
        raise UsageError("--quant gptq on Ray writes one output", hint="plan it with --method or --experts alone")
    if gptq and node_rate is not None:
        raise UsageError("--node-rate is for layer-range parts: GPTQ on Ray reads the source per step, no rate "
                         "of it is known at scale (docs/scale.md)")
    if cluster == "live":
        with joined(address) as ray:
            return _figures(planned, ray, True, threads, parts, workers, node_rate, bool(gptq), address)
    return _figures(planned, cluster, False, threads, parts, workers, node_rate, bool(gptq), address)


def _figures(planned, cluster, live: bool, threads, parts, workers, node_rate, gptq: bool, address) -> dict:
    where = {"from": "live" if live else "given" if cluster is not None else "none",
             "address": (address or os.environ.get("RAY_ADDRESS")) if live else None,
             "description": None if live or cluster is None else cluster.describe()}
    if gptq:
        return {"mode": "gptq", "cluster": where, **_gptq(planned[0][1], cluster, workers)}
    return {"mode": "parts", "cluster": where, **_parts(planned, cluster, threads, parts, node_rate)}


def _node_name(node: dict) -> str:
    host = node.get("NodeManagerHostname") or "?"
    return host if str(node.get("NodeID", "")).startswith("given-") else f"{host} (id {node.get('NodeID', '')[:12]})"


def _nodes(cluster, cpus: float, memory: int) -> list[dict]:
    """Each live node's resources and the tasks of `cpus` CPUs and `memory` bytes it runs at once
    (``ray_convert.tasks_at_once``), with the memory they declare together."""
    if cluster is None:
        return []
    rows = []
    for node in (n for n in cluster.nodes() if n.get("Alive")):
        resources = node["Resources"]
        at_once, bound = tasks_at_once(resources, cpus, memory)
        rows.append({"node": _node_name(node), "cpus": resources.get("CPU", 0),
                     "memory_bytes": int(resources.get("memory", 0)), "gpus": resources.get("GPU", 0),
                     "tasks_at_once": at_once, "bound": bound, "declared_bytes": at_once * memory})
    return rows


def _parts(planned: list, cluster, threads, parts, node_rate) -> dict:
    """The figures of a layer-range run (module docstring)."""
    cpus = max(1, threads or 1)                              # as convert_on_ray: --threads CPUs per part
    outputs = [target_output(KINDS.get(kind), out or "OUT", plan) for kind, plan, out in planned]
    resources = {"num_cpus": cpus, "memory": part_memory(outputs, cpus)}
    source, layers = outputs[0].source, outputs[0].layers
    nodes = _nodes(cluster, cpus, resources["memory"])
    count, why = parts, "given"
    if cluster is not None:
        able = check_feasible(cluster, resources)           # UsageError when no node can run a part
        if parts is None:
            count = default_parts(able, resources, len(layers))
            why = (f"what the {_count(len(able), 'able node')} run at once, "
                   f"{sum(n['tasks_at_once'] for n in nodes)} ({_bounds(nodes)}), at most one per MoE layer, "
                   f"{len(layers)}")
    elif parts is None:
        why = "what the live nodes run at once, known when it runs (give --parts N, or --ray-address / --nodes)"
    layer_bytes = moe_layer_bytes(source, layers)
    sizes = {path: os.stat(path).st_size for path in source.files()}
    rest = sum(f["bytes"] for o in outputs for f in o.plan.report.get("files", []) if f.get("layer") is None)
    written = sum(o.plan.report["total_bytes"] for o in outputs)
    ranges = []
    for first, last in (balanced_ranges(layer_bytes, count) if count else []):
        part = [target_output(KINDS.get(kind), out or "OUT", plan, layers=(first, last))
                for kind, plan, out in planned]
        held = sum(b for layer, b in layer_bytes.items() if first <= layer <= last)
        reads = part_files(part[0], source.matrix_jobs(part[0].layers))
        ranges.append({"layers": [first, last], "moe_layers": len(part[0].layers), "cpus": cpus,
                       "memory_bytes": resources["memory"], "source_read_bytes": sum(sizes[p] for p in reads),
                       "output_bytes": (written - rest) * held // max(1, sum(layer_bytes.values()))
                       + (rest if part[0].writes_rest else 0)})
    return {"task": {"cpus": cpus, "memory_bytes": resources["memory"]}, "nodes": nodes,
            "parts": {"count": count, "from": "--parts" if parts else "default" if count else None, "why": why,
                      "ranges": ranges},
            "storage": _storage(nodes, count, source.file_bytes(), written, ranges, node_rate)}


def _bounds(nodes: list[dict]) -> str:
    by = {bound: sum(1 for n in nodes if n["bound"] == bound and n["tasks_at_once"]) for bound in ("CPUs", "memory")}
    return ", ".join(f"{k} bound by {bound}" for bound, k in by.items() if k) or "no node can run one"


def _storage(nodes: list[dict], count, source_bytes: int, written: int, ranges: list, node_rate) -> dict:
    """The bandwidth the busy nodes need from the storage SRC and the parts folder are on, each node converting
    `node_rate` source bytes per second (NODE_RATE when None); computed."""
    rate = node_rate or NODE_RATE
    read = sum(r["source_read_bytes"] for r in ranges) or source_bytes
    out = sum(r["output_bytes"] for r in ranges) or written
    able = sum(1 for n in nodes if n["tasks_at_once"])
    busy = min(able, count) if nodes and count else None
    per_node = {"read_bytes_per_s": rate, "write_bytes_per_s": rate * out / max(1, read)}
    return {"node_rate_bytes_per_s": rate, "node_rate_from": "--node-rate" if node_rate else NODE_RATE_SOURCE,
            "source_read_bytes": read, "output_bytes": out, "per_node": per_node, "busy_nodes": busy,
            "read_bytes_per_s": None if busy is None else busy * per_node["read_bytes_per_s"],
            "write_bytes_per_s": None if busy is None else busy * per_node["write_bytes_per_s"],
            "seconds": None if busy is None else read / (busy * rate)}


def _gptq(plan, cluster, workers) -> dict:
    """The figures of a --quant gptq run on Ray (module docstring)."""
    require("gpu", "--quant gptq")
    source, options = plan.input.source, plan.options
    samples = load_samples(options.calibration, source.model_dir(), max_length=options.max_length,
                           num_samples=options.num_samples, vocab_size=source.info.config.get("vocab_size"))
    tokens, squares = ray_gptq.calibration_tokens(samples)
    info = source.info
    if cluster is not None:
        able = [n["Resources"] for n in ray_gptq.able_nodes(cluster)]
        count, memory = ray_gptq.step_resources(info, tokens, squares, able, workers)
        why = "given" if workers else ("as many of the largest task (at one worker per node) as each node's "
                                       "memory holds, at most its CPUs")
        gpus = 1 if cluster.cluster_resources().get("GPU", 0) >= 1 else 0
    else:
        count = workers or 1
        memory = ray_gptq.task_memory(info, tokens, squares, count)
        why = "given" if workers else ("the run takes what the live nodes' memory holds (give --workers N, or "
                                       "--ray-address / --nodes)")
        gpus = 0
    slices, owners = len(contiguous(len(samples), count)), len(contiguous(info.n_experts, count))
    tasks = {"record_slice": (slices, "run"), "capture_slice": (slices, "MoE layer"),
             "gate_up_hessian": (1, "MoE layer"), "solve_experts": (owners, "MoE layer"),
             "propagate_slice": (slices, "layer")}
    largest = max(memory.values())
    nodes = _nodes(cluster, ray_gptq.TASK_CPUS, largest)
    shipped = ray_gptq.shipped_per_layer(info, tokens, count, len(samples))
    return {"calibration": {"samples": len(samples), "tokens": tokens, "mask_elements": squares},
            "workers": {"count": count, "from": "--workers" if workers else "default" if cluster else "assumed",
                        "why": why},
            "steps": [{"step": step, "tasks": n, "per": per, "cpus": ray_gptq.TASK_CPUS, "gpus": gpus,
                       "memory_bytes": memory[step]} for step, (n, per) in tasks.items()],
            "largest_task_bytes": largest, "nodes": nodes, "moe_layers": len(plan.layers),
            "shipped_bytes_per_layer": shipped, "shipped_bytes": shipped * len(plan.layers)}


# ---------------------------------------------------------------------------------------------- as text

def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _count(n, what: str) -> str:
    return f"{n:g} {what}" + ("" if n == 1 else "s")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 \
        else f"{seconds / 3600:.1f} h"


def _cluster_line(report: dict) -> str:
    where = report["cluster"]
    if where["from"] == "live":
        return f"cluster: the live one at {where['address'] or 'this process joined'} ({len(report['nodes'])} nodes)"
    if where["from"] == "given":
        return f"cluster: {where['description']}"
    return ("cluster: none, figures per task\n    (--ray-address ADDR or RAY_ADDRESS reads a live one; --nodes N "
            "--node-cpus C --node-memory SIZE describes one)")


def _node_lines(report: dict, what) -> list[str]:
    """One line per node (one for all the given nodes, which are alike); what(n): n tasks as words."""
    lines, nodes = [], report["nodes"]
    given = report["cluster"]["from"] == "given"
    for n in nodes[:1] if given else nodes:
        name = f"each of {len(nodes)} nodes" if given else n["node"]
        lines.append(f"  {name}: {_count(n['cpus'], 'CPU')}, {gib(n['memory_bytes'])}: {what(n['tasks_at_once'])} "
                     f"at once (bound by {n['bound']}), declaring {gib(n['declared_bytes'])}")
    return lines


def render(report: dict) -> str:
    """The Ray figures as text (after the outputs' plans); computed, but for the default node rate (measured)."""
    if report["mode"] == "gptq":
        return _render_gptq(report)
    task, parts, storage = report["task"], report["parts"], report["storage"]
    lines = ["on Ray: layer-range parts (computed)", "  " + _cluster_line(report),
             f"  each part task declares {_count(task['cpus'], 'CPU')} (--threads) and {gib(task['memory_bytes'])} "
             f"(the plan's peak RAM estimate with {_count(task['cpus'], 'worker')})"]
    lines += _node_lines(report, lambda n: _count(n, "part"))
    lines.append(f"  parts: {parts['count']} ({parts['from']}: {parts['why']})" if parts["count"] else
                 f"  parts: {parts['why']}")
    if parts["ranges"]:
        lines.append(f"    {'MoE layers':<12} {'reads':>12} {'writes about':>14}")
        lines += [f"    {'{}-{}'.format(*r['layers']):<12} {_gb(r['source_read_bytes']):>12} "
                  f"{_gb(r['output_bytes']):>14}" for r in parts["ranges"]]
    per_node = storage["per_node"]
    lines += [f"  storage, at {storage['node_rate_bytes_per_s'] / 1e9:.2f} GB/s of source per node "
              f"({storage['node_rate_from']}):",
              f"    each node reads {_gb(per_node['read_bytes_per_s'])}/s and writes "
              f"{_gb(per_node['write_bytes_per_s'])}/s"]
    if storage["busy_nodes"]:
        lines.append(f"    {storage['busy_nodes']} nodes: {_gb(storage['read_bytes_per_s'])}/s read from SRC, "
                     f"{_gb(storage['write_bytes_per_s'])}/s written to the parts folder; "
                     f"{_gb(storage['source_read_bytes'])} read in about {_duration(storage['seconds'])}")
    return "\n".join(lines)


def _render_gptq(report: dict) -> str:
    cal, workers = report["calibration"], report["workers"]
    lines = ["on Ray: GPTQ, layers in order, each layer's work split (computed)", "  " + _cluster_line(report),
             f"  calibration: {_count(cal['samples'], 'sample')}, {_count(cal['tokens'], 'token')}",
             f"  workers: {workers['count']} ({workers['from']}: {workers['why']})",
             "  tasks, each declaring:"]
    lines += [f"    {s['step']:<16} {s['tasks']:>5} per {s['per']:<9}  {_count(s['cpus'], 'CPU')}"
              f"{', 1 GPU' if s['gpus'] else ''}, {gib(s['memory_bytes'])}" for s in report["steps"]]
    lines += _node_lines(report, lambda n: f"{n} of the largest task")
    lines += [f"  shipped between tasks: {_gb(report['shipped_bytes_per_layer'])} per MoE layer (captures to every "
              f"owner, written experts to every slice),", f"    {_gb(report['shipped_bytes'])} for "
              f"{_count(report['moe_layers'], 'MoE layer')}"]
    return "\n".join(lines)

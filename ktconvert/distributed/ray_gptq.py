"""``--quant gptq --executor ray``: the calibrated conversion with its forward split by calibration sample and each
layer's experts solved in parallel, on a Ray cluster; layers stay in order and the driver writes OUT.

``ray_streams`` gives the GPTQ writers (gptq.cpu / gpu.gptq ``write_gptq_layers``) a ``gptq.distributed.
DistributedStream`` whose steps (record, capture, gate/up Hessian, solve, propagate) run as Ray tasks of one CPU
each (the forward and the solve run at one torch thread without oneDNN, as in a single process, with the driver's
pinned CPU kernels: ``gptq.determinism.worker_env`` in the tasks' runtime_env; one GPU each where the cluster has
GPUs), retried up to ``MAX_RETRIES`` times when their worker dies. Their arguments are object references the
driver owns, so a re-run task computes the same bytes, and Ray rebuilds a lost result from its lineage. The
driver writes the files, the journal, the stream state (``--resume`` continues a run of either executor) and
ktconvert.json exactly as the single process does, which is what makes OUT byte-identical to it.

What runs where: the driver plans, holds the written layer's payloads and writes OUT (no shared filesystem needed
for OUT); every task opens SRC itself (the same path on every node, or a hub source each node downloads the
shards it reads from, at the commit the driver planned from). ``import ray`` happens inside the functions only.

Before any task, the pre-flight (``preflight``) checks every node's ktconvert version and SRC (exit 3 naming the
node). Resources: every task declares one CPU and the memory its step needs (``task_memory``: the figures of
gptq.distributed's docstring and docs/scale.md, computed from the model's dims, the calibration tokens and the
number of workers; computed, not measured). Without ``workers`` the count is what the cluster's memory holds
(``default_workers``: per node, as many of the largest task as fit, at most its CPUs). A step no live node has the
memory for is refused before any task runs (UsageError), where Ray would wait forever (``step_resources``: the
count and the memory, which ``ray_plan`` shows for ``plan --executor ray``).
"""
from __future__ import annotations

import functools
import os

from ktconvert.cpu.sizes import PROCESS_BASE_BYTES
from ktconvert.errors import KtConvertError, UsageError
from ktconvert.gptq.determinism import worker_env
from ktconvert.gptq.distributed import DistributedStream, contiguous
from ktconvert.distributed.preflight import preflight
from ktconvert.distributed.ray_runtime import route_to_log, temp_log
from ktconvert.distributed.ray_convert import (MAX_RETRIES, connect, hub_tokens, is_hub, pinned_spec, remote_task,
                                               source_spec, task_runtime_env, tasks_at_once)

TASK_CPUS = 1          # every step's task: its forward and solve run at one torch thread (gptq.determinism)


class RayTasks:
    """DistributedStream's executor on Ray: every step a task with `options` (Ray task options: num_cpus,
    max_retries, runtime_env ...) and the hub `tokens` (ray_executor.remote_task); handles are ObjectRefs."""

    def __init__(self, ray, options: dict, tokens: dict | None = None):
        self.ray, self.options, self.tokens, self.remotes = ray, options, tokens or {}, {}
        self.memory: dict[str, int] = {}      # {step function name: bytes its tasks declare} (task_memory)

    def submit(self, fn, *args, returns: int = 1):
        key = (fn, returns)
        if key not in self.remotes:
            memory = self.memory.get(getattr(fn, "__name__", ""), 0)
            self.remotes[key] = remote_task(self.ray, fn, self.tokens, num_returns=returns, memory=memory,
                                            **self.options)
        return self.remotes[key].remote(*args)

    def put(self, value):
        return self.ray.put(value)

    def get(self, handles: list) -> list:
        """The values of `handles`; a ktconvert error raised in a task as itself, any other failure (a task that
        still failed after its retries) as one KtConvertError line."""
        try:
            return self.ray.get(list(handles))
        except self.ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, KtConvertError):
                raise exc.cause from None
            raise KtConvertError(f"GPTQ on Ray: a task failed ({_first_line(exc.cause or exc)})") from None
        except self.ray.exceptions.RayError as exc:
            raise KtConvertError(f"GPTQ on Ray: a task failed after {MAX_RETRIES} retries "
                                 f"({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def ray_streams(input, *, address: str | None = None, workers: int | None = None,
                runtime_env: dict | None = None):
    """The stream class the GPTQ writers build (called as LayerStream is) for source `input` (inputs.Input, as
    the driver opened it) on the Ray cluster at `address` (None: RAY_ADDRESS, the one this process joined, or a
    local instance): `workers` slices of the calibration samples and as many owners of each layer's experts
    (None: ``default_workers``). runtime_env: Ray's runtime_env of the tasks (the driver's TASK_ENV variables
    added, its hub tokens never: they travel as task arguments, only with a hub source; and the CPU kernel pins
    in effect in the driver, which win: every task computes what the driver would)."""
    pins = worker_env()                    # pins this process first (gptq.determinism)
    if pins:
        runtime_env = dict(runtime_env or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **pins}
    ray = connect(address)
    route_to_log(temp_log())                 # the raylet's messages: never on stdout
    spec, orientation = source_spec(input)
    resources = ray.cluster_resources()
    options = {"num_cpus": TASK_CPUS, "max_retries": MAX_RETRIES, **task_runtime_env(runtime_env)}
    if resources.get("GPU", 0) >= 1:
        options["num_gpus"] = 1
    tasks = RayTasks(ray, options, hub_tokens(is_hub(spec)))     # a hub source: its tasks download shards
    return functools.partial(_stream, ray=ray, tasks=tasks, workers=workers, spec=pinned_spec(spec, input.hub),
                             orientation=orientation)


def _stream(source, samples, *args, ray, tasks: RayTasks, workers: int | None, **kw):
    """The DistributedStream of `source` and `samples` (called as LayerStream is) on `ray`, after the pre-flight
    on every node that can run a task (versions, and a local SRC's files); its workers counted and its tasks'
    memory set (``step_resources``; UsageError when no live node has the memory of the largest task)."""
    able = able_nodes(ray)
    spec = kw["spec"]
    files = None if is_hub(spec) else {os.path.abspath(p): os.stat(p).st_size for p in source.files()}
    preflight(ray, able, spec, files, None, {k: v for k, v in tasks.options.items() if k == "runtime_env"})
    count, tasks.memory = step_resources(source.info, *calibration_tokens(samples),
                                         [n["Resources"] for n in able], workers)
    return DistributedStream(source, samples, *args, tasks=tasks, workers=count, **kw)


def able_nodes(ray) -> list[dict]:
    """The live nodes (``ray.nodes()`` entries) that can run a step's task (TASK_CPUS CPUs)."""
    return [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= TASK_CPUS]


def calibration_tokens(samples) -> tuple[int, int]:
    """(tokens, the sum of each sample's length squared: its attention mask's elements) of the calibration
    samples: what ``task_memory`` and ``shipped_per_layer`` count."""
    return sum(len(s) for s in samples), sum(len(s) ** 2 for s in samples)


def step_resources(info, tokens: int, squares: int, nodes: list[dict], workers: int | None) -> tuple[int, dict]:
    """(workers, {step function name: bytes its tasks declare}) of a run on `nodes` (each node's resources:
    {"CPU", "memory"}, as ``ray.nodes()`` gives them): `workers`, or ``default_workers`` when None; the memory
    ``task_memory`` at that count. UsageError when no node has TASK_CPUS CPUs and the largest task's memory (Ray
    would wait for one forever)."""
    count = workers or default_workers(info, tokens, squares, nodes)
    memory = task_memory(info, tokens, squares, count)
    largest = max(memory.values())
    if not any(n.get("CPU", 0) >= TASK_CPUS and n.get("memory", 0) >= largest for n in nodes):
        step = max(memory, key=memory.get)
        raise UsageError("no Ray node can run a GPTQ step", expected=f"{TASK_CPUS} CPU and {largest >> 20} MiB "
                         f"({step}, {count} workers: docs/scale.md)",
                         found=f"at most {max((int(n.get('memory', 0)) for n in nodes), default=0) >> 20} MiB",
                         hint="use nodes with more memory, or more --workers (owners hold 1/N of the experts)")
    return count, memory


def task_memory(info, tokens: int, squares: int, workers: int) -> dict[str, int]:
    """{step function name: bytes one task holds} for a model of `info`'s dims (hidden H, intermediate I, experts
    E) calibrated on `tokens` tokens (`squares`: the sum of each sample's length squared: its attention mask) cut
    into `workers` slices and owners, BF16 (gptq.distributed's docstring; the DeepSeek-V3 figures of
    docs/scale.md): the layer without routed experts (attention about 4 H^2, a shared expert 3 H I), a slice's
    activations (hidden states in and out, 2 H per token, and its masks), every written expert (twice: the task's
    copy and the object store's) while propagating, the captured inputs (x2.5 while split into fit / held-out)
    and the Hessians on an owner and in the gate/up step, an owner's experts' source and written weights; each
    plus a process's base."""
    H, I, E, n = info.hidden, info.intermediate, info.n_experts, max(1, workers)
    layer = (4 * H * H + 3 * H * I) * 2
    captures = tokens * H * 2
    activations = -(-(2 * captures + 2 * squares) // n)
    experts = E * 3 * H * I * 2
    hessians = (H * H + I * I) * 4
    slice_task = PROCESS_BASE_BYTES + layer + activations
    return {"record_slice": slice_task, "capture_slice": slice_task,
            "propagate_slice": slice_task + 2 * experts,
            "gate_up_hessian": PROCESS_BASE_BYTES + captures + hessians,
            "solve_experts": PROCESS_BASE_BYTES + int(2.5 * captures) + hessians + -(-E // n) * 3 * H * I * 2 * 2}


def shipped_per_layer(info, tokens: int, workers: int, samples: int | None = None) -> int:
    """Bytes one MoE layer's steps send between tasks (docs/scale.md): every slice's captured inputs to every
    owner (tokens x H x 2 bytes, once per owner) and every written expert to every slice (E x 3 H I x 2 bytes,
    once per slice); the propagation's weights dominate. `workers` slices and owners, fewer where there are
    fewer `samples` (None: as many) or experts (``gptq.distributed.contiguous``)."""
    n = max(1, workers)
    owners, slices = len(contiguous(info.n_experts, n)), n if samples is None else len(contiguous(samples, n))
    return owners * tokens * info.hidden * 2 + slices * info.n_experts * 3 * info.hidden * info.intermediate * 2


def default_workers(info, tokens: int, squares: int, nodes: list[dict]) -> int:
    """Workers (slices and owners) when --workers is not given: on every node as many of the largest task (at
    one worker per node) as its memory holds, at most its CPUs (``tasks_at_once``); at least 1."""
    largest = max(task_memory(info, tokens, squares, max(1, len(nodes))).values())
    return max(1, sum(tasks_at_once(n, TASK_CPUS, largest)[0] for n in nodes))

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
"""
from __future__ import annotations

import functools

from ktconvert.errors import KtConvertError
from ktconvert.gptq.determinism import worker_env
from ktconvert.gptq.distributed import DistributedStream
from ktconvert.distributed.ray_convert import (MAX_RETRIES, connect, hub_tokens, is_hub, pinned_spec, remote_task,
                                               source_spec, task_runtime_env)


class RayTasks:
    """DistributedStream's executor on Ray: every step a task with `options` (Ray task options: num_cpus,
    max_retries, runtime_env ...) and the hub `tokens` (ray_executor.remote_task); handles are ObjectRefs."""

    def __init__(self, ray, options: dict, tokens: dict | None = None):
        self.ray, self.options, self.tokens, self.remotes = ray, options, tokens or {}, {}

    def submit(self, fn, *args, returns: int = 1):
        key = (fn, returns)
        if key not in self.remotes:
            self.remotes[key] = remote_task(self.ray, fn, self.tokens, num_returns=returns, **self.options)
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
    (None: the cluster's CPUs). runtime_env: Ray's runtime_env of the tasks (the driver's TASK_ENV variables
    added, its hub tokens never: they travel as task arguments, only with a hub source; and the CPU kernel pins
    in effect in the driver, which win: every task computes what the driver would)."""
    pins = worker_env()                    # pins this process first (gptq.determinism)
    if pins:
        runtime_env = dict(runtime_env or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **pins}
    ray = connect(address)
    spec, orientation = source_spec(input)
    resources = ray.cluster_resources()
    options = {"num_cpus": 1, "max_retries": MAX_RETRIES, **task_runtime_env(runtime_env)}
    if resources.get("GPU", 0) >= 1:
        options["num_gpus"] = 1
    count = workers or max(1, int(resources.get("CPU", 1)))
    tasks = RayTasks(ray, options, hub_tokens(is_hub(spec)))     # a hub source: its tasks download shards
    return functools.partial(DistributedStream, tasks=tasks, spec=pinned_spec(spec, input.hub),
                             orientation=orientation, workers=count)

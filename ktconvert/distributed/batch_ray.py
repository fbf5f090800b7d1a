"""`ktconvert batch JOBS.toml --executor ray`: the jobs of a job file as Ray tasks, one per job.

Jobs are independent (each its own source and outputs), so they run at once, as many as the cluster has CPUs for.
Inside a task a job runs exactly as in a local batch (``batch.run_job``): each output is converted (resumably),
then bundled and published, so bundle and publish always follow the conversion they depend on. The summary is
the local one: the same keys, jobs in file order, the exit code of the first failed job in file order. Without
keep_going, the jobs after a failed one (in file order) that have not finished yet are cancelled and reported
"skipped" (the local batch would not have started them; a cancelled conversion resumes on the next run).

A pre-flight task on every node checks its ktconvert version first (``preflight``: exit 3 naming the node).
Resources: a job's task declares the CPUs it converts with (its outputs' ``threads``; a job without sets them to
the CPUs of the smallest node that can run it, so that it never converts with more cores than it reserved) and the
memory the plan estimates for its largest output (``sizes.peak_ram`` on the source's headers; 0 where the driver
cannot open the source: the job then fails in its task with the error a local batch gives). A job's
paths must be the same on every node (a shared filesystem); the hub endpoint variables set on the driver reach
the tasks through Ray's runtime_env ``env_vars`` (``ray_executor.TASK_ENV``), its hub tokens only the tasks of jobs
with a hub source or a publish target, and never through runtime_env (``ray_executor.remote_task``).
"""
from __future__ import annotations

import os

from ktconvert.cpu import sizes
from ktconvert.errors import EXIT_ERROR, EXIT_USAGE, KtConvertError
from ktconvert.ops.batch import run_job
from ktconvert.util.progress import Progress
from ktconvert.distributed.preflight import preflight
from ktconvert.distributed.ray_runtime import ray_output, temp_log
from ktconvert.distributed.ray_convert import MAX_RETRIES, connect, hub_tokens, is_hub, remote_task, task_runtime_env
from ktconvert.run.inputs import open_input


def run_jobs_on_ray(jobs: list[dict], keep_going: bool = False, progress=None, address: str | None = None,
                    runtime_env: dict | None = None) -> dict:
    """Run every job of `jobs` (batch.load_jobs) as a Ray task on the cluster at `address` (None: the one this
    process joined, else a local instance); returns the summary batch.run_jobs returns."""
    progress = progress or Progress()
    ray = connect(address)
    with ray_output(temp_log(), progress):
        options = {"max_retries": MAX_RETRIES, **task_runtime_env(runtime_env)}
        able = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
        for line in preflight(ray, able, "", None, None, task_runtime_env(runtime_env)):     # every node's versions
            progress.message(line)
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        cpus = min((int(n.get("CPU", 0)) for n in nodes if n.get("CPU", 0) >= 1), default=1)
        pending, results = {}, [None] * len(jobs)
        for i, job in enumerate(jobs):
            job, resources = job_resources(_absolute(job), cpus)
            if not any(n.get("CPU", 0) >= resources["num_cpus"] and n.get("memory", 0) >= resources["memory"]
                       for n in nodes):               # Ray would wait for such a node forever
                results[i] = {"name": job["name"], "source": job["source"], "status": "failed", "bytes": 0,
                              "outputs": [], "exit_code": EXIT_USAGE, "wall_s": 0.0,
                              "error": f"no Ray node can run this job (it needs {resources['num_cpus']} CPUs and "
                                       f"{resources['memory'] >> 20} MiB): lower its threads"}
                continue
            task = remote_task(ray, run_job_task, hub_tokens(needs_hub(job)), **options, **resources)
            pending[task.remote(job)] = i
        refused = next((i for i, r in enumerate(results) if r is not None), None)
        if refused is not None and not keep_going:
            _cancel_after(ray, pending, refused)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(ready[0])
            results[index] = _outcome(ray, ready[0], jobs[index])
            progress.message(f"job {jobs[index]['name']}: {results[index]['status']}")
            if results[index]["status"] == "failed" and not keep_going:
                _cancel_after(ray, pending, index)
    results = [r if r is not None else {"name": job["name"], "status": "skipped", "source": job["source"]}
               for r, job in zip(results, jobs)]
    failed = next((r for r in results if r["status"] == "failed"), None)
    exit_code = failed.get("exit_code", EXIT_ERROR) if failed else 0
    return {"ok": exit_code == 0, "exit_code": exit_code, "jobs": results}


def _cancel_after(ray, pending: dict, index: int) -> None:
    """Cancel the pending jobs after job `index` in file order (removed from `pending`)."""
    for ref, later in list(pending.items()):
        if later > index:
            ray.cancel(ref)
            del pending[ref]


def needs_hub(job: dict) -> bool:
    """Whether a job talks to a hub: its source is hf:// / ms://, or one of its outputs is published."""
    return is_hub(job["source"]) or any(output.get("publish") for output in job["outputs"])


def _outcome(ray, ref, job: dict) -> dict:
    """The job's summary entry; a task Ray gave up on (worker died MAX_RETRIES times) is a failed job."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        return {"name": job["name"], "source": job["source"], "status": "failed", "bytes": 0, "outputs": [],
                "error": f"Ray task failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                "exit_code": EXIT_ERROR, "wall_s": 0.0}


def job_resources(job: dict, cpus: int) -> tuple[dict, dict]:
    """(the job with every output's ``threads`` set, {"num_cpus", "memory"} of its task): the largest ``threads``
    of its outputs, `cpus` where none is set; the largest of its outputs' peak RAM estimates at that many threads
    (0 when the source cannot be opened here)."""
    threads = max((o["cpu"].get("threads") or 0 for o in job["outputs"]), default=0) or max(1, cpus)
    outputs = [{**o, "cpu": {**o["cpu"], "threads": o["cpu"].get("threads") or threads}} for o in job["outputs"]]
    try:
        source = open_input(job["source"]).source
        info = source.info
        memory = max(sizes.peak_ram(source, info.hidden, info.intermediate, o["cpu"].get("numa", 1),
                                    o["cpu"]["threads"])["peak_ram_bytes"] for o in outputs)
    except KtConvertError:
        memory = 0
    return {**job, "outputs": outputs}, {"num_cpus": threads, "memory": int(memory)}


def _absolute(job: dict) -> dict:
    """The job with its output and bundle paths absolute (a worker's current folder is not the driver's)."""
    outputs = [{**o, "out": os.path.abspath(o["out"]),
                "bundle": os.path.abspath(o["bundle"]) if o["bundle"] else None} for o in job["outputs"]]
    return {**job, "outputs": outputs}


def run_job_task(job: dict) -> dict:
    """A Ray task: one job as a local batch runs it (quiet progress)."""
    return run_job(job, Progress())

"""`ktconvert batch JOBS.toml`: run conversion jobs (source → CPU outputs → publish targets / bundles) in order.

Job file (see examples/jobs.toml)::

    [defaults]                      # optional: keys every output inherits
    method = "amxint4"
    numa = 2

    [[jobs]]
    name = "qwen3-int4"             # optional; defaults to "job-N"
    source = "hf://Qwen/Qwen3-30B-A3B"   # local folder, hf://ORG/NAME or ms://ORG/NAME
    revision = "main"               # optional: hub revision to pin (becomes source@revision)

      [[jobs.outputs]]              # one or more; a job may instead put these keys at its own top level
      out = "out/qwen3-int4-numa2"
      method = "amxint4"            # cpu options: method numa layout quant group_size threads include_dense
      numa = 2                      #   include_mtp allow_drop_bias
      bundle = "dist/qwen3.tar.zst" # optional
        [[jobs.outputs.publish]]    # zero or more
        hub = "hf"                  # hf | modelscope
        repo = "me/Qwen3-30B-A3B-kt-amxint4-numa2"
        revision = "main"           # optional; private, endpoint optional too

Every conversion runs with resume on (a rerun continues or skips a finished output; publishing resumes too).
A failed job stops the run unless keep_going. The summary holds per job: status (ok / failed / skipped), wall time,
bytes written, each output's files root (sha256 over its manifest's sorted "path sha256" lines) and remote URLs.
"""
from __future__ import annotations

import time
import tomllib
from pathlib import Path

from ktconvert.errors import EXIT_ERROR, InputError, KtConvertError

CPU_KEYS = ("method", "numa", "layout", "quant", "group_size", "threads", "include_dense", "include_mtp",
            "allow_drop_bias")
OUTPUT_KEYS = set(CPU_KEYS) | {"out", "publish", "bundle"}
JOB_KEYS = {"name", "source", "revision", "outputs"} | OUTPUT_KEYS
PUBLISH_KEYS = {"hub", "repo", "revision", "private", "endpoint"}


def load_jobs(path) -> list[dict]:
    """Parse and check a job file; returns normalised jobs {name, source, outputs: [{out, cpu: {...}, publish,
    bundle}]} with relative paths resolved against the job file's folder. InputError naming the job and key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"cannot read job file ({exc})", file=str(path)) from None
    unknown = set(data) - {"defaults", "jobs"}
    if unknown or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise InputError("job file needs one or more [[jobs]] tables (and optionally [defaults])", file=str(path),
                         found=", ".join(sorted(unknown)) or "no [[jobs]]")
    defaults = data.get("defaults", {})
    _check_keys(defaults, set(CPU_KEYS) | {"publish"}, path, "[defaults]")
    return [_normalise(job, i, defaults, path) for i, job in enumerate(data["jobs"], 1)]


def _check_keys(table: dict, allowed: set, path: Path, where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}", file=str(path), expected=", ".join(sorted(allowed)))


def _normalise(job: dict, index: int, defaults: dict, path: Path) -> dict:
    name = str(job.get("name") or f"job-{index}")
    _check_keys(job, JOB_KEYS, path, f"job {name}")
    if "source" not in job:
        raise InputError(f"job {name}: 'source' is required", file=str(path))
    source = str(job["source"])
    if "://" not in source:
        source = str((path.parent / source).resolve()) if not Path(source).is_absolute() else source
    elif job.get("revision"):
        source = f"{source.split('@')[0]}@{job['revision']}"
    raw_outputs = job.get("outputs") or [{k: v for k, v in job.items() if k in OUTPUT_KEYS}]
    outputs = []
    for raw in raw_outputs:
        _check_keys(raw, OUTPUT_KEYS, path, f"job {name} output")
        merged = {**defaults, **raw}
        if "out" not in merged or "method" not in merged:
            raise InputError(f"job {name}: each output needs 'out' and 'method'", file=str(path))
        publish = merged.get("publish", [])
        publish = [publish] if isinstance(publish, dict) else list(publish)
        for target in publish:
            _check_keys(target, PUBLISH_KEYS, path, f"job {name} publish")
            if "repo" not in target:
                raise InputError(f"job {name}: publish target needs 'repo'", file=str(path))
        outputs.append({"out": str(path.parent / merged["out"]),
                        "cpu": {k: merged[k] for k in CPU_KEYS if k in merged},
                        "publish": publish,
                        "bundle": str(path.parent / merged["bundle"]) if merged.get("bundle") else None})
    return {"name": name, "source": source, "outputs": outputs}


def plan_jobs(jobs: list[dict]) -> list[dict]:
    """--dry-run: ktconvert.api.plan(...) for every output of every job (headers only, no weights read)."""
    from ktconvert.api import plan

    plans = []
    for job in jobs:
        for output in job["outputs"]:
            entry = {"job": job["name"], "source": job["source"], "out": output["out"],
                     "publish": [f"{t.get('hub', 'hf')}:{t['repo']}" for t in output["publish"]],
                     "bundle": output["bundle"]}
            if "://" in job["source"]:
                entry["plan"] = None
                entry["note"] = "hub source: downloaded and verified at run time, planned after download"
            else:
                cpu = output["cpu"]
                entry["plan"] = plan(job["source"], method=cpu["method"], numa=cpu.get("numa", 1),
                                     layout=cpu.get("layout", "safetensors"), group_size=cpu.get("group_size"),
                                     include_mtp=cpu.get("include_mtp", False), out=output["out"]).cpu.report
            plans.append(entry)
    return plans


def run_jobs(jobs: list[dict], keep_going: bool = False, progress=None) -> dict:
    """Run every job in order; returns {"ok", "exit_code", "jobs": [per-job summary]}. Never raises for a job's
    failure (it is recorded); stops after the first failure unless keep_going (the rest are "skipped")."""
    from ktconvert.progress import Progress

    progress = progress or Progress()
    results, stop, exit_code = [], False, 0
    for job in jobs:
        if stop:
            results.append({"name": job["name"], "status": "skipped", "source": job["source"]})
            continue
        progress.message(f"job {job['name']}: {job['source']} -> {len(job['outputs'])} output(s)")
        result = run_job(job, progress)
        results.append(result)
        if result["status"] == "failed":
            exit_code = exit_code or result.get("exit_code", EXIT_ERROR)
            stop = not keep_going
    return {"ok": exit_code == 0, "exit_code": exit_code, "jobs": results}


def run_job(job: dict, progress) -> dict:
    """Convert, bundle and publish every output of one job; failures are recorded, not raised."""
    t0 = time.monotonic()
    result = {"name": job["name"], "source": job["source"], "status": "ok", "bytes": 0, "outputs": []}
    try:
        for output in job["outputs"]:
            result["outputs"].append(_run_output(job["source"], output, progress))
            result["bytes"] += result["outputs"][-1]["bytes"]
    except KtConvertError as exc:
        result.update(status="failed", error=str(exc), exit_code=exc.exit_code)
    except OSError as exc:
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}", exit_code=EXIT_ERROR)
    result["wall_s"] = round(time.monotonic() - t0, 3)
    return result


def _run_output(source: str, output: dict, progress) -> dict:
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.ops.hub import files_digest, publish
    from ktconvert.cpu.convert import convert_cpu

    cpu = dict(output["cpu"])
    summary = str(convert_cpu(source, output["out"], resume=True, force=False, progress=progress, **cpu))
    manifest = load_manifest(output["out"])
    record = {"out": output["out"], "summary": summary, "method": manifest.get("method"),
              "numa": manifest.get("numa"), "bytes": sum(int(e["bytes"]) for e in manifest["files"].values()),
              "files_root": files_digest(manifest["files"]), "remotes": [], "bundle": None}
    if output["bundle"]:
        from ktconvert.ops.bundle import bundle

        Path(output["bundle"]).parent.mkdir(parents=True, exist_ok=True)
        record["bundle"] = bundle(output["out"], output["bundle"], progress=progress)
    for target in output["publish"]:
        remote = publish(output["out"], target["repo"], hub=target.get("hub", "hf"), revision=target.get("revision"),
                         private=bool(target.get("private", False)), endpoint=target.get("endpoint"),
                         progress=progress)
        record["remotes"].append({"hub": remote["hub"], "repo": remote["repo"], "revision": remote["revision"],
                                  "url": remote["url"], "ok": remote["ok"]})
    return record


def render_summary(summary: dict) -> str:
    lines = []
    for job in summary["jobs"]:
        line = f"{job['name']}: {job['status']}"
        if job["status"] != "skipped":
            line += f" in {job['wall_s']:.1f}s, {job.get('bytes', 0)} bytes"
        for output in job.get("outputs", []):
            line += f"\n  {output['out']} files root {output['files_root'][:16]}"
            line += "".join(f"\n  -> {r['url']}" for r in output["remotes"])
        if job.get("error"):
            line += f"\n  error: {job['error']}"
        lines.append(line)
    failed = sum(j["status"] == "failed" for j in summary["jobs"])
    lines.append(f"{len(summary['jobs'])} job(s), {failed} failed" + ("" if summary["ok"] else " -- FAILED"))
    return "\n".join(lines)


def render_plans(plans: list[dict]) -> str:
    from ktconvert.cpu.plan import render

    lines = []
    for entry in plans:
        head = f"== {entry['job']}: {entry['source']} -> {entry['out']}"
        if entry["publish"]:
            head += f" (publish {', '.join(entry['publish'])})"
        lines.append(head)
        lines.append(entry["note"] if entry["plan"] is None else render(entry["plan"]))
    return "\n".join(lines)

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
      method = "amxint4"            # the CPU output's options as a `convert` target takes them (method numa
      numa = 2                      #   layout quant group_size include_dense include_mtp allow_drop_bias), threads
      bundle = "dist/qwen3.tar.zst" # optional
        [[jobs.outputs.publish]]    # zero or more
        hub = "hf"                  # hf | modelscope
        repo = "me/Qwen3-30B-A3B-kt-amxint4-numa2"
        revision = "main"           # optional; private, endpoint optional too

Every conversion runs with resume on (a rerun continues or skips a finished output; publishing resumes too).
A bundle path may not lie inside a local source or an output folder (refused when the job file is read); a file
already at a bundle path is replaced only when it is that output's bundle from an earlier run (OutputError else).
A failed job stops the run unless keep_going. The summary holds per job: status (ok / failed / skipped), wall time,
bytes written, each output's files root (sha256 over its manifest's sorted "path sha256" lines) and remote URLs.
A job's outputs are CPU outputs (the ``cpu`` kind of ``kinds.KINDS``): their keys and types are that kind's target
fields (``OutputKind.target_fields``, fixed choices checked as written) plus ``threads``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ktconvert.errors import EXIT_ERROR, InputError, KtConvertError, OutputError
from ktconvert.formats.out_manifest import load_manifest
from ktconvert.kinds import KINDS
from ktconvert.ops.bundle import bundle, bundled_manifest
from ktconvert.ops.hub import files_digest, parse_source, publish
from ktconvert.run.inputs import open_input
from ktconvert.util.progress import Progress
from ktconvert.vocabulary import choices, choose
from ktconvert.util.toml_schema import Field, check_table as _check_table, read_toml

CPU = KINDS.get("cpu")                  # the kind of every output of a job
CPU_FIELDS = {**CPU.target_fields(choices=True), "threads": Field(int, 1)}
CPU_KEYS = tuple(CPU_FIELDS)
OUTPUT_FIELDS = {**CPU_FIELDS, "out": Field(str), "bundle": Field(str)}
OUTPUT_KEYS = set(OUTPUT_FIELDS) | {"publish"}
JOB_FIELDS = {"name": Field(str), "source": Field(str), "revision": Field(str), **OUTPUT_FIELDS}
JOB_KEYS = set(JOB_FIELDS) | {"outputs", "publish"}
PUBLISH_FIELDS = {"hub": Field(str, choices=("hf", "huggingface", "modelscope", "ms")), "repo": Field(str),
                  "revision": Field(str), "private": Field(bool), "endpoint": Field(str)}
DEFAULT_FIELDS = dict(CPU_FIELDS)


def load_jobs(path) -> list[dict]:
    """Parse and check a job file; returns normalised jobs {name, source, outputs: [{out, cpu: {...}, publish,
    bundle}]} with relative paths resolved against the job file's folder. Every key is checked against its type
    (a string "false" is not a boolean, true is not an integer); InputError naming the job and the key.

    Job files are trusted like a shell script: their paths are not confined to any folder, and a publish target's
    endpoint receives the hub token."""
    path = Path(path)
    data = read_toml(path, "job file")
    unknown = set(data) - {"defaults", "jobs"}
    if unknown or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise InputError("job file needs one or more [[jobs]] tables (and optionally [defaults])", file=str(path),
                         found=", ".join(sorted(unknown)) or "no [[jobs]] array of tables")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise InputError("[defaults] must be a table", file=str(path), found=repr(defaults)[:60])
    _check_table(defaults, DEFAULT_FIELDS, {"publish"}, path, "[defaults]")
    jobs = [_normalise(job, i, defaults, path) for i, job in enumerate(data["jobs"], 1)]
    names = [job["name"] for job in jobs]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise InputError(f"job name {twice!r} is used twice (the summary is keyed by name)", file=str(path))
    _check_bundle_paths(jobs, path)
    return jobs


def _check_bundle_paths(jobs: list[dict], path: Path) -> None:
    """InputError naming the job when a bundle path is (inside) a local source or an output folder of the job file:
    writing it there would replace a source file (or put a stray file into an output)."""
    roots = [("source", Path(job["source"]).resolve()) for job in jobs if "://" not in job["source"]]
    roots += [("output folder", Path(output["out"]).resolve()) for job in jobs for output in job["outputs"]]
    for job in jobs:
        for output in job["outputs"]:
            if not output["bundle"]:
                continue
            bundle = Path(output["bundle"]).resolve()
            for what, root in roots:
                if bundle == root or root in bundle.parents:
                    raise InputError(f"job {job['name']}: 'bundle' lies inside a {what}", file=str(path),
                                     expected=f"a path outside {root}", found=output["bundle"])


def _table(value, path: Path, where: str) -> dict:
    if not isinstance(value, dict):
        raise InputError(f"{where} must be a table", file=str(path), found=repr(value)[:60])
    return value


def _normalise(job, index: int, defaults: dict, path: Path) -> dict:
    job = _table(job, path, f"job {index}")
    name = job.get("name", f"job-{index}")
    where = f"job {name}" if isinstance(name, str) else f"job {index}"
    _check_table(job, JOB_FIELDS, {"outputs", "publish"}, path, where)
    if "source" not in job:
        raise InputError(f"{where}: 'source' is required", file=str(path))
    source = _source(job, path, where)
    raw_outputs = job.get("outputs", [{k: v for k, v in job.items() if k in OUTPUT_KEYS}])
    if not isinstance(raw_outputs, list) or not raw_outputs:
        raise InputError(f"{where}: 'outputs' must be an array of one or more tables", file=str(path),
                         found=repr(raw_outputs)[:60])
    return {"name": name, "source": source,
            "outputs": [_output(_table(raw, path, f"{where}: each of 'outputs'"), defaults, path, where)
                        for raw in raw_outputs]}


def _source(job: dict, path: Path, where: str) -> str:
    """Local sources resolved against the job file's folder; hub sources checked, with `revision` applied."""
    source = job["source"]
    if "://" not in source:
        if "revision" in job:
            raise InputError(f"{where}: 'revision' applies to hub sources (hf://, ms://) only", file=str(path),
                             found=f"local source {source!r}")
        return str((path.parent / source).resolve()) if not Path(source).is_absolute() else source
    try:
        parse_source(source)
    except InputError as exc:
        raise InputError(f"{where}: 'source' {exc}", file=str(path)) from None
    return f"{source.split('@')[0]}@{job['revision']}" if job.get("revision") else source


def _output(raw: dict, defaults: dict, path: Path, where: str) -> dict:
    _check_table(raw, OUTPUT_FIELDS, {"publish"}, path, f"{where} output")
    merged = {**defaults, **raw}
    if "out" not in merged or "method" not in merged:
        raise InputError(f"{where}: each output needs 'out' and 'method'", file=str(path))
    _check_choices(merged, path, where)
    publish = merged.get("publish", [])
    publish = [publish] if isinstance(publish, dict) else publish
    if not isinstance(publish, list) or not all(isinstance(t, dict) for t in publish):
        raise InputError(f"{where}: 'publish' must be a table or an array of tables", file=str(path),
                         found=repr(publish)[:60])
    for target in publish:
        _check_table(target, PUBLISH_FIELDS, set(), path, f"{where} publish")
        if "repo" not in target:
            raise InputError(f"{where}: publish target needs 'repo'", file=str(path))
    return {"out": str(path.parent / merged["out"]), "cpu": {k: merged[k] for k in CPU_KEYS if k in merged},
            "publish": publish, "bundle": str(path.parent / merged["bundle"]) if merged.get("bundle") else None}


def _check_choices(output: dict, path: Path, where: str) -> None:
    """The output's method and quant are names the registries hold (as `ktconvert cpu` accepts them), and quant
    is one a job can run (gptq needs a calibration file, which job files do not take): InputError (exit 3, like
    every other value of a job file that cannot work) naming the job and the key, before any job runs."""
    for key, kind in (("method", "method"), ("quant", "cpu-quant")):
        if key not in output:
            continue
        try:
            value = choose(kind, output[key])
        except KtConvertError as exc:
            raise InputError(f"{where}: {key!r} {exc}", file=str(path)) from None
        if key == "quant" and value == "gptq":
            raise InputError(f"{where}: 'quant' gptq needs a calibration file, which job files do not take",
                             file=str(path), expected=" or ".join(q for q in choices("cpu-quant") if q != "gptq"))


def plan_jobs(jobs: list[dict]) -> list[dict]:
    """--dry-run: the CPU plan of every output of every job, with every option the job gives it (headers only, no
    weights read)."""
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
                options = CPU.options.make(**{k: v for k, v in output["cpu"].items() if k != "threads"})
                entry["plan"] = CPU.plan(open_input(job["source"]), options, out=output["out"]).report
            plans.append(entry)
    return plans


def run_jobs(jobs: list[dict], keep_going: bool = False, progress=None) -> dict:
    """Run every job in order; returns {"ok", "exit_code", "jobs": [per-job summary]}. Never raises for a job's
    failure (it is recorded); stops after the first failure unless keep_going (the rest are "skipped")."""
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
    from ktconvert.cpu.convert import convert_cpu      # looked up when run (tests stand in for it)

    cpu = dict(output["cpu"])
    summary = str(convert_cpu(source, output["out"], resume=True, force=False, progress=progress, **cpu))
    manifest = load_manifest(output["out"])
    record = {"out": output["out"], "summary": summary, "method": manifest.get("method"),
              "numa": manifest.get("numa"), "bytes": sum(int(e["bytes"]) for e in manifest["files"].values()),
              "files_root": files_digest(manifest["files"]), "remotes": [], "bundle": None}
    if output["bundle"]:
        dest = Path(output["bundle"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        again = bundled_manifest(dest) == (Path(output["out"]) / "ktconvert.json").read_bytes()   # a rerun's
        if os.path.lexists(dest) and not again:
            raise OutputError("bundle path exists and is not this output's bundle", file=str(dest),
                              hint="remove it, or name another 'bundle' path in the job file")
        record["bundle"] = bundle(output["out"], dest, progress=progress, force=again)
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
    lines = []
    for entry in plans:
        head = f"== {entry['job']}: {entry['source']} -> {entry['out']}"
        if entry["publish"]:
            head += f" (publish {', '.join(entry['publish'])})"
        lines.append(head)
        lines.append(entry["note"] if entry["plan"] is None else CPU.render(entry["plan"]))
    return "\n".join(lines)

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

import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import EXIT_ERROR, InputError, KtConvertError
from ktconvert.safe_read import open_regular

MAX_JOB_FILE_BYTES = 16 << 20


@dataclass(frozen=True)
class Field:
    """One key of a job file: its TOML type (str, int or bool: a bool is never an int), and for ints the least
    value, for strings the allowed values (empty: any)."""

    kind: type
    minimum: int | None = None
    choices: tuple[str, ...] = ()

    def problem(self, value) -> str | None:
        """Why `value` does not fit, or None."""
        if type(value) is not self.kind:
            return f"must be {_KIND[self.kind]}, found {_KIND.get(type(value), type(value).__name__)} {value!r}"[:200]
        if self.minimum is not None and value < self.minimum:
            return f"must be an integer >= {self.minimum}, found {value!r}"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, found {value!r}"
        return None


_KIND = {str: "a string", int: "an integer", bool: "a boolean (true / false)", float: "a float", list: "an array",
         dict: "a table"}
CPU_FIELDS = {"method": Field(str), "numa": Field(int, 1), "layout": Field(str, choices=("safetensors", "kt")),
              "quant": Field(str), "group_size": Field(int, 1), "threads": Field(int, 1),
              "include_dense": Field(bool), "include_mtp": Field(bool), "allow_drop_bias": Field(bool)}
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
    data = _read_toml(path)
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
    return jobs


def _read_toml(path: Path) -> dict:
    """The job file's TOML (a regular file of at most MAX_JOB_FILE_BYTES)."""
    fd = open_regular(path, "job file")
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_JOB_FILE_BYTES + 1)
        if len(raw) > MAX_JOB_FILE_BYTES:
            raise InputError(f"job file is larger than {MAX_JOB_FILE_BYTES} bytes", file=str(path))
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"job file is not UTF-8 ({exc.reason} at byte {exc.start})", file=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"job file is not valid TOML ({exc})", file=str(path)) from None
    except RecursionError:
        raise InputError("job file is nested too deeply", file=str(path)) from None


def _check_table(table: dict, fields: dict[str, Field], other: set, path: Path, where: str) -> None:
    """Unknown keys and values of the wrong type are errors naming `where` and the key."""
    allowed = set(fields) | other
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}", file=str(path), expected=", ".join(sorted(allowed)))
    for key, spec in fields.items():
        if key in table and (problem := spec.problem(table[key])):
            raise InputError(f"{where}: {key!r} {problem}", file=str(path))


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
    from ktconvert.ops.hub import parse_source

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


def plan_jobs(jobs: list[dict]) -> list[dict]:
    """--dry-run: the CPU plan (cpu.plan.plan_cpu) of every output of every job (headers only, no weights read)."""
    from ktconvert.cpu.plan import CpuOptions, plan_cpu
    from ktconvert.inputs import open_input

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
                options = CpuOptions.make(method=cpu["method"], numa=cpu.get("numa", 1),
                                          layout=cpu.get("layout", "safetensors"), group_size=cpu.get("group_size"),
                                          include_mtp=cpu.get("include_mtp", False))
                entry["plan"] = plan_cpu(open_input(job["source"]), options, out=output["out"]).report
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

"""``ktconvert verify OUT``: is a converted folder loadable as its manifest says, and unchanged?

Checks, in order: manifest (``ktconvert.json`` present and parseable), integrity (its self hash, tool version and
source record: ``verification.identity``), structure (the output kind's own checks, ``kinds``: a CPU output's
``cpu.verify``: every expected expert tensor or .kt file present with the byte count that the recorded method, NUMA
count and model dims give, probed the way kt-kernel's loader probes, nothing extra; a GPU checkpoint's
``gpu.verify``), flags (the recorded kt-kernel / SGLang flags are the ones the kind, method, NUMA count and files
need: ``verification.launch``), hashes (``--hashes``: every file and tensor re-hashed against the manifest), source
(``--source``: the recorded source fingerprint, file sha256s with ``--hashes``), numerics (the kind's numeric
check: a CPU method's own, against ``--source`` when given, or on ``--calibration`` tokens) and remote
(``--remote``: ``ops.hub.verify_remote``). The folder is walked once (``verification.folder.OutputFolder``) and
every check reads that walk. Returns a dict; ``render`` makes the table.
"""
from __future__ import annotations

import os

from ktconvert.errors import InputError, KtConvertError, UsageError
from ktconvert.formats import out_manifest
from ktconvert.formats.out_manifest import load_manifest
from ktconvert.kinds import KINDS
from ktconvert.ops import bundle as ops_bundle, hub as ops_hub
from ktconvert.distributed.parts import parse_layers
from ktconvert.verification import calibrated
from ktconvert.verification.folder import OutputFolder
from ktconvert.verification.hashes import verify_hashes
from ktconvert.verification.identity import check_integrity, check_source
from ktconvert.verification.launch import check_launch

SHOWN_PER_KIND = 10      # problem lines of one kind the text rendering shows; the result (and --json) holds all


def verify(out, source=None, hashes: bool = False, tokens: int = 8, layers=None, experts="4", threshold=None,
           remote=None, hub: str = "hf", revision=None, endpoint=None, calibration=None, compare=None,
           max_length: int = 2048, num_samples=None) -> dict:
    """Verify output folder `out`. Returns {"ok": bool, "out", "problems": [one-line str], "checks": [{name,
    status ("ok" | "failed" | "skipped"), detail}], plus "hashes" / "numerics" / "remote" reports
    when those ran}. calibration: numerics on the hidden states these calibration tokens produce in `source`
    (verification.calibrated; `compare`: a second output side by side) instead of random probes; the numerics report's
    "probe" says which ("calibration" or "random"). InputError when `out` (a folder or bundle) does not exist."""
    if remote != "" and not os.path.lexists(out):     # nothing to verify: bad input (3), like a missing SRC
        raise InputError("OUT does not exist", file=str(out))
    if remote == "" and os.path.lexists(out):         # a local OUT is no hub repo id: ktconvert.json records none
        raise UsageError("--remote needs the hub repo to compare OUT with (ktconvert.json records no published "
                         "repo)", file=str(out), expected=f"verify {out} --remote OWNER/NAME, or verify OWNER/NAME "
                         "--remote for a hub repo's own ktconvert.json", found="--remote without REPO")
    if isinstance(source, str) and source.startswith(("hf://", "ms://")):   # as cpu / gpu take SRC: download once,
        source = str(ops_hub.resolve_source(source)[0])                    # every file checked against the hub
    if isinstance(layers, str):               # one --layers syntax (parts.parse_layers): 1-3, 1,3,5, 1-3,7, all
        layers = "all" if layers.strip().lower() == "all" else parse_layers(layers)
    result = {"ok": True, "out": str(out), "problems": [], "checks": []}
    if str(out).endswith(".tar.zst"):
        report = ops_bundle.verify_bundle(out)
        result["bundle"] = report
        _add_check(result, "bundle", report["problems"], f"{report['checked']} members hashed while streaming")
        return result
    if remote == "":  # `verify REPO --remote`: OUT names a hub repo; its own ktconvert.json is the reference
        _add_report(result, "remote", ops_hub.verify_remote(None, str(out), hub, revision, endpoint))
        return result
    try:
        manifest = load_manifest(out)
    except InputError as exc:
        _add_check(result, "manifest", [str(exc)], "")
        _identify_unrecorded(result, out)
        return result
    _add_check(result, "manifest", [], _manifest_summary(manifest))
    _add_check(result, "integrity", *check_integrity(manifest))
    folder = OutputFolder.scan(out)
    kind = manifest.get("kind", "cpu")          # a manifest from before kinds were recorded: a CPU output
    report, rows = KINDS.get(kind).verify_structure(out, manifest, folder, source=source, experts=experts) \
        if kind in KINDS else (None, [])
    if report is not None:
        result[kind] = report
    for name, problems, detail in rows:
        _add_check(result, name, problems, detail)
    if not rows:
        _skip(result, "structure", "skipped", f"no structure rules for kind {kind!r}")
    problems, detail = check_launch(manifest)      # ktconvert.json's "." is the folder itself: shown as its path,
    _add_check(result, "flags", problems, detail and out_manifest.sglang_args(manifest, os.path.abspath(out)))
    if hashes:
        report = verify_hashes(out, manifest, folder)
        result["hashes"] = report
        _add_check(result, "hashes", report["problems"],
                   f"{report['files_checked']} files, {report['tensors_checked']} tensors re-hashed")
    else:
        _skip(result, "hashes", "skipped", "use --hashes")
    if source is not None:
        _add_check(result, "source", *check_source(manifest, source, hashes))
    else:
        _skip(result, "source", "skipped", "use --source SRC")
    if calibration is None and compare is not None:
        numerics = {"ok": False, "problems": ["--compare needs --calibration (side by side on calibration tokens)"]}
    else:
        numerics = None if kind not in KINDS else KINDS.get(kind).numerics(
            out, manifest, folder, source=source, tokens=tokens, layers=layers, experts=experts, threshold=threshold,
            calibration=calibration, compare=compare, max_length=max_length, num_samples=num_samples)
    if numerics is None and calibration is not None:
        numerics = {"ok": False, "problems": [f"--calibration checks CPU expert outputs, not kind {kind!r}"]}
    if numerics is not None:
        _add_report(result, "numerics", numerics)
    if remote is not None:
        _add_report(result, "remote", ops_hub.verify_remote(manifest, remote, hub, revision, endpoint))
    else:
        _skip(result, "remote", "skipped", "use --remote REPO")
    return result


def _add_check(result: dict, name: str, problems: list[str], detail: str) -> None:
    """One row; its problems join result["problems"] unless an earlier line already says the same (one truncated
    shard is seen by the structure, hashes and numerics checks: one line)."""
    result["checks"].append({"name": name, "status": "failed" if problems else "ok", "detail": detail})
    for problem in problems:
        if not any(problem == seen or problem in seen for seen in result["problems"]):
            result["problems"].append(problem)
    result["ok"] = result["ok"] and not problems


def _identify_unrecorded(result: dict, out) -> None:
    """A folder without ktconvert.json (kt-kernel's own converter, a published folder, a native checkpoint): what
    its headers say it holds (`ktconvert check`'s identification), as an "identified" row and result["identified"];
    nothing can be verified against a record, so the result stays failed."""
    from ktconvert.launchcheck.identify import identify
    from ktconvert.launchcheck.readers import Reads

    if not os.path.isdir(out) or os.path.lexists(os.path.join(out, "ktconvert.json")):
        return
    try:
        identity, _ = identify(out, Reads())
    except KtConvertError as exc:
        _skip(result, "identified", "skipped", f"not identifiable from its headers ({exc})")
        return
    result["identified"] = identity.to_dict()
    what = ", ".join(f"{k} {v}" for k, v in (("NUMA", identity.numa), ("group size", identity.group_size)) if v)
    detail = (f"{identity.method or 'unknown method'} ({identity.layout}{', ' + what if what else ''}), "
              f"{len(identity.layers)} MoE layers x {identity.experts} experts, H {identity.hidden}, "
              f"I {identity.intermediate}: from its headers; `ktconvert check {out} -- <launch flags>` checks the "
              f"flags")
    _skip(result, "identified", "info", detail)


def _skip(result: dict, name: str, status: str, detail: str) -> None:
    result["checks"].append({"name": name, "status": status, "detail": detail})


def _add_report(result: dict, name: str, report: dict) -> None:
    """Record a sub-check's report ({"ok", "problems", "summary"}) as one row."""
    result[name] = report
    problems = list(report.get("problems", []))
    if not report.get("ok", False) and not problems:
        problems = [f"{name}: check failed"]
    _add_check(result, name, problems, str(report.get("summary", report.get("detail", ""))))


def _manifest_summary(manifest: dict) -> str:
    model = manifest["model"]
    numa = "" if manifest.get("kind") == "gpu" else f", numa {manifest['numa']}"     # a GPU checkpoint has none
    return (f"{manifest.get('method')}{numa}, layout {manifest['layout']}, "
            f"{len(model.get('layers', []))} MoE layers x {model.get('experts')} experts, "
            f"{len(manifest['files'])} files")


def render(result: dict) -> str:
    """Human-readable summary: one row per check, then the problems."""
    rows = [("check", "status", "detail")] + [(c["name"], c["status"], c["detail"]) for c in result["checks"]]
    width = [max(len(str(r[i])) for r in rows) for i in range(2)]
    lines = [f"verify {result.get('out', '')}"]
    lines += [f"  {r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip() for r in rows]
    numerics = result.get("numerics") or {}
    if numerics.get("probe") == "calibration" and numerics.get("layers"):
        lines.append("MoE output vs source on the tokens of --calibration FILE:")
        lines += calibrated.render_rows(numerics)
    problems = result.get("problems", [])
    lines.append("result: OK" if result.get("ok") else f"result: FAILED ({len(problems)} problem line(s))")
    shown: dict[str, int] = {}
    for problem in problems:                  # at most SHOWN_PER_KIND lines of one kind (same ending, "missing")
        kind = problem.rsplit(": ", 1)[-1] if ": " in problem else problem
        shown[kind] = shown.get(kind, 0) + 1
        if shown[kind] <= SHOWN_PER_KIND:
            lines.append(f"  - {problem}")
    lines += [f"  ({n - SHOWN_PER_KIND} more '{kind}' lines; --json lists every problem line)"
              for kind, n in shown.items() if n > SHOWN_PER_KIND]
    return "\n".join(lines)

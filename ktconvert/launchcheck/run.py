"""``ktconvert check WEIGHTS [--model M] -- <launch command>``: will kt-kernel 0.7.2 compute correctly with these
files and these flags on this (or another) CPU?

Steps: parse the command (``command``); identify the folder from its headers (``identify``); the model SGLang
starts kt-kernel with (``model``); the host's kt-kernel build and backend (``hostcpu``, ``runtime``); every
mismatch (``rules``); with ``deep`` a sampled decode and the hashes (``deep``). ``CheckResult.exit_code`` is 4 when
any finding is an error (garbage, a crash or a refusal), else 0; a malformed folder raises InputError (3).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.formats.out_manifest import FLAG_ORDER
from ktconvert.launchcheck import deep as deep_module, rules
from ktconvert.launchcheck.command import Launch, parse_command, read_flags_file
from ktconvert.launchcheck.hostcpu import host as host_of
from ktconvert.launchcheck.identify import identify
from ktconvert.launchcheck.model import model_dims, weight_config
from ktconvert.launchcheck.readers import Reads
from ktconvert.launchcheck.runtime import check_runtime

EXIT_MISMATCH = 4


@dataclass(frozen=True)
class CheckResult:
    """weights; identified (Identity.to_dict); model (ModelDims.to_dict); host; backend; launch (the parsed
    command, or None); findings [Finding.to_dict]; works (the flags that work, one string); fixed (the command with
    every fix applied, or None when nothing needs fixing or no command was given); deep (--deep's report);
    bytes_read {"headers", "json", "data", "total"}; notes."""

    weights: str
    identified: dict
    model: dict
    host: dict
    backend: str
    launch: dict | None
    findings: list
    works: str
    fixed: str | None
    bytes_read: dict
    notes: list = field(default_factory=list)
    deep: dict | None = None

    @property
    def errors(self) -> list:
        return [f for f in self.findings if f["severity"] == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else EXIT_MISMATCH

    def to_dict(self) -> dict:
        return {"ok": self.ok, "exit_code": self.exit_code, "weights": self.weights, "identified": self.identified,
                "model": self.model, "host": self.host, "backend": self.backend, "launch": self.launch,
                "findings": self.findings, "works": self.works, "fixed": self.fixed, "bytes_read": self.bytes_read,
                "notes": self.notes, "deep": self.deep}

    def render(self, fix: bool = False) -> str:
        return render(self, fix)


def check(weights, command=None, *, model=None, flags_from=None, cpu_flags: str | None = None,
          deep: bool = False) -> CheckResult:
    """The check (module doc). command: the launch command's words (or one string); flags_from: a file holding
    it (its words come first)."""
    words = (read_flags_file(flags_from) if flags_from is not None else []) + _words(command)
    launch = parse_command(words) if words else None
    parsed = launch or parse_command([])
    weights = Path(weights)
    reads = Reads()
    identity, manifest = identify(weights, reads)
    dims, notes = model_dims(model, launch, weights, identity, manifest, reads)
    machine = host_of(cpu_flags, parsed.env)
    quant = {}
    if identity.method == "GPTQ_INT4":
        qc, where, more = weight_config(weights, parsed.value("kt-weight-path"), reads)
        quant, notes = {"config": qc, "file": where}, notes + more
    backend, runtime = check_runtime(identity, machine, parsed.env, quant)
    findings = rules.file_findings(identity)
    recorded = (identity.facts.get("ktconvert.json") or {}).get("flags")
    numa_found, numa = [], identity.numa
    if identity.method is not None:
        if launch is not None:
            findings += rules.method_findings(identity, launch)
        numa_found, numa = rules.numa_findings(identity, parsed, backend, recorded)
        if launch is not None:
            findings += numa_found
        findings += runtime + rules.model_findings(identity, dims, parsed)
        if launch is not None:
            findings += rules.other_findings(identity, launch, weights)
    report = None
    if deep:
        report, found = deep_module.deep_check(identity, reads, manifest)
        findings += found
    works = _works(identity, weights, numa, findings)
    fixes, env = _fixes(findings)
    fixed = launch.fixed(fixes, env) if launch is not None and (fixes or env) else None
    return CheckResult(str(weights), identity.to_dict(), dims.to_dict(), machine.to_dict(), backend,
                       None if launch is None else launch.to_dict(), [f.to_dict() for f in findings], works, fixed,
                       {**reads.counts, "total": reads.total}, notes + identity.notes, report)


def _words(command) -> list[str]:
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(w) for w in command]


def _works(identity, weights: Path, numa: int | None, findings) -> str:
    """The kt-kernel flags these files need, as SGLang arguments (plus any environment word a finding asks for)."""
    if identity.method is None:
        return ""
    flags = {"kt-method": identity.method, "kt-weight-path": str(weights)}
    if numa is not None:
        flags["kt-threadpool-count"] = numa
    env = {k: v for f in findings for k, v in f.env.items()}
    order = [k for k in FLAG_ORDER if k in flags]
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] +
                    [f"--{k} {shlex.quote(str(flags[k]))}" for k in order])


def _fixes(findings) -> tuple[dict, dict]:
    fixes, env = {}, {}
    for f in findings:
        fixes.update(f.fix)
        env.update(f.env)
    return fixes, env


def render(result: CheckResult, fix: bool = False) -> str:
    ident, lines = result.identified, []
    lines.append(f"{result.weights}: {ident['layout']}, " + (f"method {ident['method']}" if ident["method"] else
                                                            "no kt-kernel method reads it"))
    for key in ("method", "numa", "group_size", "layers", "experts", "intermediate", "hidden", "gguf_types",
                "ktconvert.json"):
        if key in ident["how"]:
            lines.append(f"  {key}: {ident['how'][key]}")
    model = result.model
    if model["source"]:
        lines.append(f"model: {model['source']}: experts {model['experts']}, intermediate {model['intermediate']}, "
                     f"hidden {model['hidden']}")
    host = result.host
    lines.append(f"cpu: {host['flags_from']}: kt-kernel loads its {host['build']} build ({host['why']})" +
                 (f"; {result.backend}" if result.backend else ""))
    for note in result.notes:
        lines.append(f"note: {note}")
    order = {"error": 0, "warning": 1, "note": 2}
    for f in sorted(result.findings, key=lambda f: order[f["severity"]]):
        lines.append(f"{f['severity']}: {f['line']}")
    if result.deep is not None:
        d = result.deep
        lines.append(f"deep: {d['matrices_checked']} matrices decoded (layers {d['layers']}, experts "
                     f"{d['experts']}, {d['bytes_read']} bytes)" + (f"; hashes: {d['hashes']['files_checked']} "
                                                                    "files" if d.get("hashes") else ""))
    b = result.bytes_read
    lines.append(f"read {b['total']} bytes ({b['headers']} of headers, {b['json']} of JSON, {b['data']} of data)")
    if result.works:
        lines.append(f"works: {result.works}")
    if fix and result.fixed:
        lines.append(f"fixed: {result.fixed}")
    lines.append(("ok: no mismatch" if result.launch is not None else "ok: the files are usable") if result.ok else
                 f"{len(result.errors)} mismatch{'es' if len(result.errors) != 1 else ''} kt-kernel turns into "
                 "garbage, a crash or a refusal")
    return "\n".join(lines)


__all__ = ["CheckResult", "Launch", "check", "render"]

"""One thing ``ktconvert check`` found: which flag (or environment variable, or the files, or the host), the value
given, what the files hold, what kt-kernel 0.7.2 does with it, and the value that works.

``severity``: "error" (kt-kernel returns garbage, crashes or refuses to start: exit 4), "warning" (worth a look,
does not change the exit code) or "note". ``fix``: {option: [values]} / ``env``: {VAR: value} that ``--fix`` puts
into the command.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EFFECTS = {
    "garbage": "kt-kernel runs and returns garbage (silently)",
    "zeros": "kt-kernel runs and returns zeros (silently)",
    "crash": "kt-kernel crashes (segfault / abort)",
    "refusal": "kt-kernel refuses to start",
    "": "",
}


@dataclass
class Finding:
    flag: str
    given: str | None
    holds: str
    effect: str = ""
    works: str | None = None
    severity: str = "error"
    fix: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def line(self) -> str:
        head = self.flag if self.given is None else f"{self.flag} {self.given}"
        if self.given is None and self.flag.startswith("--"):
            head += " (not given)"
        parts = [f"{head}: {self.holds}"]
        if self.effect:
            parts.append(EFFECTS.get(self.effect, self.effect))
        if self.works:
            parts.append(f"use {self.works}")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {"flag": self.flag, "given": self.given, "holds": self.holds, "effect": self.effect,
                "works": self.works, "severity": self.severity, "line": self.line(),
                **({"fix": self.fix} if self.fix else {}), **({"env": self.env} if self.env else {})}


def option_fix(option: str, value, spelling: str | None = None) -> tuple[str, dict]:
    """(the text of "use ..." and the --fix entry) for setting `option` (canonical, no dashes) to `value`."""
    values = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    spelling = spelling if spelling and spelling.startswith("--") else "--" + option   # not AMX_METHOD's name
    return f"{spelling} {' '.join(values)}", {option: values}

"""The bases of CpuOptions / GpuOptions (one frozen set of options per output, built from keywords named as on
the command line, values case-insensitive, validated before anything is opened) and of CpuPlan / GpuPlan (what
the plan found: the opened input, the layers, and a JSON-ready report)."""
from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

from ktconvert.errors import UsageError


class Options:
    """Mixin of a frozen dataclass of options: ``kind`` names it in errors, ``lowercase`` lists its fields whose
    string values are compared case-insensitively; subclasses implement ``check``."""

    kind: ClassVar[str] = ""
    lowercase: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def make(cls, **kw):
        """Options from keywords; UsageError for an unknown keyword or a value that cannot work."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kw) - set(names))
        if unknown:
            raise UsageError(f"unknown {cls.kind} option {unknown[0]!r}", expected="one of " + ", ".join(names))
        for key in cls.lowercase:
            if isinstance(kw.get(key), str):
                kw[key] = kw[key].strip().lower()
        if kw.get("calibration") is not None:
            kw["calibration"] = str(kw["calibration"])
        options = cls(**kw)
        options.check()
        return options

    def check(self) -> None:
        raise NotImplementedError


class Plan:
    """A validated output plan: input (inputs.Input), options, layers, and ``report`` (JSON-ready figures;
    ``plan[key]`` reads them)."""

    report: dict

    def __getitem__(self, key: str):
        return self.report[key]

    def to_dict(self) -> dict:
        return dict(self.report)

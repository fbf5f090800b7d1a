"""The bases of CpuOptions / GpuOptions (one frozen set of options per output, built from keywords named as on
the command line, values case-insensitive, validated before anything is opened) and of CpuPlan / GpuPlan (what
the plan found: the opened input, the layers, and a JSON-ready report); ``option``: a field of such options with
the metadata an output kind's schemas are generated from (``kinds``)."""
from __future__ import annotations

from dataclasses import MISSING, Field, asdict, field, fields
from typing import ClassVar

from ktconvert.errors import UsageError

# Calibration sampling of the GPTQ paths (gptq.calibration.load_samples), as expert-stats has them: at most
# `max_length` tokens per sample, the first `num_samples` samples (None: all). Journalled only when not the
# default, so the journals of runs that leave them out stay as they were.
SAMPLING_DEFAULTS = {"max_length": 2048, "num_samples": None}


def option(default=MISSING, *, help: str = "", choices: str | tuple = (), minimum: int | None = None,
           target: bool = True, command_help: str = "", metavar: str | None = None, **kw) -> Field:
    """A field of a kind's options with what the schemas are generated from: help (the command line's text for a
    `convert` target's option; command_help: for the kind's own command, `ktconvert cpu` / `gpu`, when it says
    more), choices (a ``vocabulary`` kind such as "method", asked when a value is converted, or a tuple of fixed
    values), minimum (for ints), target (False: not an option of a `convert` target, e.g. GPTQ's, which runs
    alone; nor of the generated options of the kind's command), metavar (the value's name in --help: FILE, SIZE)."""
    metadata = {"help": help, "choices": choices, "minimum": minimum, "target": target, "command_help": command_help,
                "metavar": metavar}
    return field(default=default, metadata=metadata, **kw)


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

    def check_sampling(self) -> None:
        """UsageError for --max-length / --num-samples below 1, or given without --quant gptq."""
        for name, value in (("--max-length", self.max_length), ("--num-samples", self.num_samples)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be a whole number of at least 1", expected=">= 1", found=repr(value))
        given = [f"--{k.replace('_', '-')}" for k, v in SAMPLING_DEFAULTS.items() if getattr(self, k) != v]
        if given and self.quant != "gptq" and self.calibration is None:
            raise UsageError(f"{given[0]} is only used with --quant gptq (calibration)", found=f"--quant {self.quant}")

    def journalled(self) -> dict:
        """The options as the journal records them (the sampling options only when not the default)."""
        return {k: v for k, v in asdict(self).items() if not (k in SAMPLING_DEFAULTS and v == SAMPLING_DEFAULTS[k])}


class Plan:
    """A validated output plan: input (inputs.Input), options, layers, and ``report`` (JSON-ready figures;
    ``plan[key]`` reads them)."""

    report: dict

    def __getitem__(self, key: str):
        return self.report[key]

    def to_dict(self) -> dict:
        return dict(self.report)

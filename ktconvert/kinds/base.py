"""OutputKind and KINDS: what one kind of output (kt-kernel CPU experts, the SGLang-KT GPU checkpoint, ...) brings,
and the registry `convert`, `plan`, `verify` and the results ask instead of naming a kind.

A kind declares, as class data and classmethods: ``options`` (a frozen ``run.options.Options`` dataclass whose
fields, through ``run.options.option(...)`` metadata, give the command line's options, the ``--targets`` TOML
fields and the batch job schema: ``target_fields``, ``required``), ``plan(input, options, out=, threads=)`` (a
``run.options.Plan`` with a JSON-ready ``report`` holding ``total_bytes``), ``output_class()`` (its
``run.output.Output``, made from a plan by ``run.local.target_output``), ``render(report)``, and what verify and
the results say of it (``verify_structure``, ``numerics``, ``launch_flags``, ``describe``, ``launch_lines``).
Light: importing it loads no numpy; a kind imports its heavy modules when one of its classmethods runs.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import ClassVar

from ktconvert.registry import Registry
from ktconvert.util.toml_schema import Field


class OutputKind:
    """One kind of output. Subclasses registered in KINDS set ``name`` (the target key holding OUT: ``{cpu =
    OUT}``), ``label`` (how messages and help call it: "CPU"), ``options``, ``help`` (the text of `convert`'s
    ``--NAME OUT``), ``extra`` (the optional dependency group its outputs need, or None) and implement ``plan`` and
    ``output_class``."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    options: ClassVar[type]
    help: ClassVar[str] = ""
    extra: ClassVar[str | None] = None

    @classmethod
    def plan(cls, input, options, *, out=None, threads: int | None = None):
        """The validated plan of one output of this kind on the opened source `input` (run.inputs.Input)."""
        raise NotImplementedError

    @classmethod
    def output_class(cls) -> type:
        """The run.output.Output subclass that writes a plan of this kind."""
        raise NotImplementedError

    @classmethod
    def check_writable(cls, plan) -> None:
        """Refuse (KtConvertError) what the plan allows but the writer would lose (a CPU output: non-zero expert
        biases); run.local.target_output calls it before the Output is made."""

    @classmethod
    def render(cls, report: dict) -> str:
        """The plan report as text."""
        return "\n".join(f"{key}: {value}" for key, value in report.items())

    @classmethod
    def ram_numa(cls, report: dict) -> int:
        """The NUMA count each decoded matrix is split into for this output (the peak RAM estimate of a pass)."""
        return 1

    @classmethod
    def launch_lines(cls, sglang_args: str, out: str) -> list[str]:
        """What a ConvertResult's summary says about running the output."""
        return [f"run with {sglang_args}"]

    @classmethod
    def verify_structure(cls, out, manifest: dict, folder, *, source=None, experts="4") -> tuple[dict | None, list]:
        """verify's structure checks of an output of this kind: (a report verify stores under the kind's name,
        a VerifyResult field: the GPU checkpoint's "gpu"; or None), rows [(check name, problems, detail)] (none: the
        structure check is shown as skipped)."""
        return None, []

    @classmethod
    def numerics(cls, out, manifest: dict, folder, **checks) -> dict | None:
        """verify's numerics report of an output of this kind (checks: source, tokens, layers, experts, threshold,
        calibration, compare, max_length, num_samples, as verification.run.verify takes them); None: none."""
        return None

    @classmethod
    def launch_flags(cls, manifest: dict) -> dict:
        """The kt-kernel / SGLang flags the output `manifest` describes needs (verify re-derives them)."""
        raise KeyError(f"kind {cls.name!r}")

    @classmethod
    def describe(cls, manifest: dict) -> str:
        """How verify's flag problems name the output ("AMXINT4 NUMA 2", "a GPU checkpoint")."""
        return f"a {cls.label} output"

    # ---------------------------------------------------------------- the schemas, from the options' fields

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        """The options' fields that a `convert` target takes, in declaration order."""
        return [f for f in dataclasses.fields(cls.options) if f.metadata.get("target")]

    @classmethod
    def target_fields(cls, choices: bool = False) -> dict[str, Field]:
        """{key: util.toml_schema.Field} of a target table (the keys beside the kind's own); choices: also the
        fixed choices (a batch job file checks them as written; a target is lower-cased by Options.make)."""
        hints = typing.get_type_hints(cls.options)
        return {f.name: Field(toml_type(hints[f.name]), f.metadata.get("minimum"),
                              tuple(f.metadata["choices"]) if choices and isinstance(f.metadata["choices"], tuple)
                              else ()) for f in cls.fields()}

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The target keys without a default."""
        return tuple(f.name for f in cls.fields()
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def toml_type(hint) -> type:
    """The TOML type of a field's annotation: `int | None` -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


KINDS: Registry[type[OutputKind]] = Registry("output kind", base=OutputKind)


def register(kind: type[OutputKind]) -> type[OutputKind]:
    """Class decorator: `kind` into KINDS under its ``name`` (a test registers its own kind the same way)."""
    return KINDS.register(kind.name)(kind)


def kinds() -> list[type[OutputKind]]:
    """Every registered kind, by name."""
    return [kind for _, kind in KINDS.items()]


def kind_of(options) -> type[OutputKind] | None:
    """The kind whose options class `options` is an instance of (None: none)."""
    return next((kind for kind in kinds() if isinstance(options, kind.options)), None)

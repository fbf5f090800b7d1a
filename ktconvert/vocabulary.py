"""The words of the command line: the values each kind of option accepts, read from the registries (the CPU
methods, the row quantizers, the GPU quant algorithms and expert schemes). Shared by the API, the CLI's choices
and the batch job files."""
from __future__ import annotations

from ktconvert.errors import UnknownNameError, UsageError
from ktconvert.gpu.experts import EXPERT_SCHEMES
from ktconvert.gpu.plan import QUANTS as GPU_QUANTS
from ktconvert.methods import METHODS, writable_names
from ktconvert.methods.base import method_option_values
from ktconvert.quant.row_quant import ROW_QUANT

_CHOICES = {"method": writable_names, "cpu-quant": lambda: ROW_QUANT.names() + ["gptq"],
            "gpu-quant": lambda: list(GPU_QUANTS), "experts": lambda: sorted(EXPERT_SCHEMES),
            "ggml-type": lambda: method_option_values("ggml_type")}


def choices(kind: str) -> list[str]:
    """The values an option of `kind` accepts ("method", "cpu-quant", "gpu-quant", "experts", "ggml-type": a
    method option's), from the registries."""
    return _CHOICES[kind]()


def choose(kind: str, value: str) -> str:
    """`value` as the canonical choice of `kind` (case-insensitive; method aliases accepted); UsageError listing
    the choices otherwise."""
    if kind == "method":
        try:
            method = METHODS.get(value)
        except UnknownNameError:       # list what can be written, not every registered name (llamafile)
            raise UsageError(f"unknown CPU method {value!r}", expected=" or ".join(writable_names()),
                             found=str(value)) from None
        return method.configured().name
    matches = [c for c in choices(kind) if c.lower() == str(value).strip().lower()]
    if not matches:
        raise UsageError(f"unknown {kind} {value!r}", expected=" or ".join(choices(kind)))
    return matches[0]

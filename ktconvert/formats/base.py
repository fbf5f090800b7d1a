"""Shared types of the pipeline: where a tensor lives on disk, and one expert's weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol

from ktconvert.registry import Registry
from ktconvert.safe_read import check_regular

if TYPE_CHECKING:
    import numpy as np

    from ktconvert.architecture import ModelInfo


@dataclass(frozen=True)
class TensorRef:
    """One tensor inside a file: dtype is the safetensors name ("BF16", "F8_E4M3", ...), offset absolute in bytes."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class ExpertWeights:
    """One routed expert in HF orientation, as BF16 bit patterns (numpy uint16).

    gate, up: uint16 [I, H]; down: uint16 [H, I]. Biases, where the family has them, are float32 [I] / [I] / [H].
    """

    gate: "np.ndarray"
    up: "np.ndarray"
    down: "np.ndarray"
    gate_bias: "np.ndarray | None" = None
    up_bias: "np.ndarray | None" = None
    down_bias: "np.ndarray | None" = None

    def projections(self) -> Iterator[tuple[str, "np.ndarray"]]:
        yield "gate", self.gate
        yield "up", self.up
        yield "down", self.down


class ExpertSource(Protocol):
    """A lazily read checkpoint: nothing is loaded until read_expert is called."""

    info: "ModelInfo"
    input_format: str  # "bf16", "fp16", "fp32", "fp8-block", "ct-int4", "mxfp4", "gguf"

    def read_expert(self, layer: int, expert: int) -> ExpertWeights: ...

    def files(self) -> list[Path]: ...


# name -> class with classmethods sniff(path) -> bool and open(path) -> ExpertSource
SOURCES: Registry = Registry("input format")

# modules whose import registers a source in SOURCES (imported on first open_source, never at package import)
SOURCE_MODULES = ("ktconvert.formats.hf_source", "ktconvert.formats.gguf_source")


def open_source(path) -> ExpertSource:
    """Open checkpoint `path` with the first registered source whose sniff(path) accepts it."""
    import importlib

    import os

    from ktconvert.errors import InputError

    if os.path.exists(path) and not os.path.isdir(path):
        check_regular(path, "input")      # a FIFO or device named *.safetensors / *.gguf would block or never end
    for module in SOURCE_MODULES:
        importlib.import_module(module)
    for _name, cls in SOURCES.items():
        if cls.sniff(path):
            return cls.open(path)
    raise InputError("no reader recognises this input", file=str(path),
                     expected="a directory with *.safetensors (+ config.json) or a .safetensors file",
                     hint="known input formats: " + ", ".join(SOURCES.names()))

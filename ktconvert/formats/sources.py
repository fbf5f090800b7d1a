"""Every registered source format, and opening a checkpoint path with the one that reads it.

Importing this module imports the source modules (each registers its class in ``formats.base.SOURCES``); a new
container format is one Source subclass in a new module, imported here.
"""
from __future__ import annotations

import os

from ktconvert.errors import InputError
from ktconvert.formats import gguf_source, hf_source  # noqa: F401  (register the sources)
from ktconvert.formats.base import SOURCES, Source
from ktconvert.util.safe_read import check_regular


def source_class(path) -> type[Source]:
    """The first registered source class whose sniff(path) accepts `path`; InputError listing the formats."""
    if os.path.exists(path) and not os.path.isdir(path):
        check_regular(path, "input")      # a FIFO or device named *.safetensors / *.gguf would block or never end
    for _name, cls in SOURCES.items():
        if cls.sniff(path):
            return cls
    raise InputError("no reader recognises this input", file=str(path),
                     expected="a directory with *.safetensors (+ config.json), a .safetensors file or a GGUF model",
                     hint="known input formats: " + ", ".join(SOURCES.names()))


def open_source(path, expert_orientation: str | None = None, remote=None) -> Source:
    """Open checkpoint `path` with the source format that recognises it (headers and config only).
    expert_orientation: ``--expert-orientation`` ("out" / "in") for square fused expert tensors, or None.
    remote: shards of a hub source not downloaded yet (safetensors_reader.Checkpoint.open), or None."""
    cls = source_class(path)
    if remote is not None:
        return cls.open(path, expert_orientation, remote=remote)
    return cls.open(path) if expert_orientation is None else cls.open(path, expert_orientation)


def open_recorded_source(path, manifest: dict) -> Source | None:
    """The source `path` of an output described by `manifest` (ktconvert.json), opened as the conversion opened
    it (the ``--expert-orientation`` it recorded); None when `path` is None."""
    if path is None:
        return None
    return open_source(path, (manifest.get("source") or {}).get("expert_orientation"))

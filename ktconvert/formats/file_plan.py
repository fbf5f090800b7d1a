"""The declared file plan of one output: ``PlannedFile`` (a path, its exact bytes and, for a safetensors shard, the
tensors it holds) and the two ways a planned size is computed, ``shard`` (the writer's own header construction)
and ``index_bytes`` (the index JSON exactly as the sinks write it).

A sink builds its plan from the method's ``tensor_specs`` (``planned_files()``); the plan report, the writers'
headers and preallocation, the index and verify's structure check and reader read that plan instead of
recomputing sizes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ktconvert.formats.st_writer import build_header, tensor_nbytes
from ktconvert.layouts.naming import INDEX_NAME

TensorSpec = tuple[str, str, tuple[int, ...]]   # (key, safetensors dtype, shape)


@dataclass(frozen=True)
class PlannedFile:
    """One file of an output: `path` relative to the output folder, its exact size `nbytes`, the `tensors` of a
    safetensors shard (empty for other files) and the MoE `layer` it holds (None: not a layer's file)."""

    path: str
    nbytes: int
    tensors: tuple[TensorSpec, ...] = ()
    layer: int | None = None

    def data_bytes(self) -> int:
        """The bytes of its tensors (a shard's size less its header)."""
        return sum(tensor_nbytes(dtype, shape) for _, dtype, shape in self.tensors)


def shard(path: str, tensors, layer: int | None = None) -> PlannedFile:
    """A safetensors shard of `tensors` [(key, dtype, shape)], no ``__metadata__``: sized by the header the
    streaming writer builds (formats.st_writer) plus the data."""
    tensors = tuple((str(key), str(dtype), tuple(int(x) for x in shape)) for key, dtype, shape in tensors)
    header, spans = build_header(list(tensors), None)
    return PlannedFile(path, len(header) + sum(end - begin for begin, end in spans.values()), tensors, layer)


def index_bytes(weight_map: dict[str, str], total_size: int) -> bytes:
    """``model.safetensors.index.json``: {"metadata": {"total_size"}, "weight_map" sorted}, indent 2, newline."""
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def index_of(shards) -> bytes:
    """The index of planned `shards` (PlannedFile with their tensors)."""
    weight_map = {key: s.path for s in shards for key, _, _ in s.tensors}
    return index_bytes(weight_map, sum(s.data_bytes() for s in shards))


def planned_index(shards) -> PlannedFile:
    """The index file of planned `shards`, with its exact size."""
    return PlannedFile(INDEX_NAME, len(index_of(shards)))

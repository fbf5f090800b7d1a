"""How a tiny checkpoint's tensors are split into shard files (which tensors a family's checkpoint holds is
``ktconvert.architectures.family_tensors``)."""
from __future__ import annotations

from ktconvert.architectures.family_tensors import TensorSpec

SHARD_BYTES = 256 << 20          # a layer bigger than this is split over several shards


def plan_shards(groups: list[list[TensorSpec]], bytes_per_value: int) -> list[list[TensorSpec]]:
    """One shard per group (layer), split further where a group exceeds SHARD_BYTES."""
    shards = []
    for group in groups:
        current, size = [], 0
        for spec in group:
            nbytes = spec.numel * bytes_per_value
            if current and size + nbytes > SHARD_BYTES:
                shards.append(current)
                current, size = [], 0
            current.append(spec)
            size += nbytes
        shards.append(current)
    return shards

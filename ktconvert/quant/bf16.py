"""BF16 as uint16 bit patterns (numpy has no bfloat16)."""
from __future__ import annotations

import numpy as np


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 [...] BF16 bits, round-to-nearest-even. NaN stays NaN (quiet); Inf stays Inf."""
    x = np.asarray(x, dtype=np.float32)
    u = np.ascontiguousarray(x).reshape(x.shape).view(np.uint32)   # reshape keeps 0-d inputs 0-d
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """uint16 [...] BF16 bits -> float32 [...] (exact widening)."""
    b = np.asarray(b, dtype=np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)

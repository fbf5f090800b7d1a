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


def float_to_bf16_bits(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A float tensor as read (safetensors dtype "BF16": uint16 bits, "F16": float16, "F32": float32) -> uint16
    BF16 bits, same shape. F16 widens exactly to F32; F32 rounds to BF16 nearest-even."""
    if dtype == "BF16":
        return arr
    return f32_to_bf16_bits(arr.astype(np.float32, copy=False))

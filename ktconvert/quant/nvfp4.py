"""FP4 (E2M1) weights with one float scale per group of 16 (NVFP4) and FP8 weights with E8M0 scales per 32 (MXFP8).

NVFP4, per Linear [n, k]: packed uint8 [n, k/2], element 2j in the low nibble of byte j and 2j+1 in the high
nibble (E2M1: ``mxfp4.E2M1_TO_F32``); block scales F8_E4M3 [n, k/16]; one per-tensor float32 scale. ModelOpt
stores the per-tensor factor as ``weight_scale_2`` (multiplier), compressed-tensors as ``weight_global_scale``
(divisor, 1 / weight_scale_2): the effective block scale is e4m3(s) * ws2, or e4m3(s) / gs, in float32.
W = e2m1 * block scale, float32 product, then round-to-nearest-even to BF16 (compressed-tensors'
NVFP4PackedCompressor computes exactly this for its divisor form).

MXFP8: F8_E4M3 codes [n, k] with E8M0 exponents [n, ceil(k/32)]: W = e4m3 * 2^(e - 127) (``fp8.dequant_block``).
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import ShapeError
from ktconvert.quant.bf16 import f32_to_bf16_bits
from ktconvert.quant.mxfp4 import E2M1_TO_F32

GROUP = 16


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """uint8 [n, k/2] -> float32 [n, k] E2M1 values (low nibble first)."""
    n, half = packed.shape
    out = np.empty((n, half * 2), dtype=np.float32)
    out[:, 0::2] = E2M1_TO_F32[packed & 0x0F]
    out[:, 1::2] = E2M1_TO_F32[packed >> 4]
    return out


def dequant(packed: np.ndarray, block_scale: np.ndarray, group: int = GROUP, where: str = "") -> np.ndarray:
    """packed uint8 [n, k/2] + float32 block scales [n, ceil(k/group)] -> uint16 [n, k] BF16 bits."""
    values = unpack_e2m1(np.asarray(packed, dtype=np.uint8))
    n, k = values.shape
    scale = np.asarray(block_scale, dtype=np.float32)
    if scale.shape != (n, -(-k // group)):
        raise ShapeError("FP4 block scales do not match the packed weight", tensor=where or None,
                         expected=f"[{n}, {-(-k // group)}]", found=str(list(scale.shape)))
    with np.errstate(over="ignore", invalid="ignore"):
        prod = values * np.repeat(scale, group, axis=1)[:, :k]
    return f32_to_bf16_bits(prod)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """uint8 [n, k] E2M1 codes (0..15) -> uint8 [n, k/2] (inverse of the nibble order above)."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 E2M1 codes, nearest value (ties to the even code), saturating at +-6."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.minimum(np.abs(x), np.float32(6.0))
    pos = E2M1_TO_F32[:8]
    dist = np.abs(mag[..., None] - pos)
    code = np.argmin(dist + (np.arange(8) % 2) * np.float32(1e-6), axis=-1).astype(np.uint8)
    return code | ((np.signbit(x) & (code > 0)).astype(np.uint8) << 3)

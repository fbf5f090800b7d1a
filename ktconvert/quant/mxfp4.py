"""MXFP4 (OCP microscaling FP4): E2M1 values in nibbles, one E8M0 power-of-two scale per 32 values.

gpt-oss hub layout, per expert (the checkpoint adds a leading [E] axis):
``*_blocks`` uint8 [n, k/32, 16] — byte j of a block holds values 2j (low nibble) and 2j+1 (high nibble);
``*_scales`` uint8 [n, k/32] E8M0 — scale 2^(e - 127), e = 255 is NaN. W = e2m1(nibble) * 2^(e - 127).
Every product is exact in float32 and in BF16 (same exponent range, 2 significant bits), so the BF16 result
has no rounding choice. gpt-oss ``gate_up_proj`` rows are interleaved: even rows gate, odd rows up.
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import ShapeError
from ktconvert.native.decode import route
from ktconvert.quant.bf16 import f32_to_bf16_bits

BLOCK = 32                      # values per scale
E8M0_BIAS = 127
E8M0_NAN = 255

# E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; codes 0..7 positive, 8..15 negative.
E2M1_TO_F32: np.ndarray = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def e8m0_to_f32(e: np.ndarray) -> np.ndarray:
    """uint8 [...] E8M0 exponents -> float32 [...] 2^(e - 127) (e = 0 gives the subnormal 2^-127; 255 NaN)."""
    e = np.asarray(e, dtype=np.uint8)
    out = np.ldexp(np.float32(1.0), e.astype(np.int32) - E8M0_BIAS).astype(np.float32)
    out[e == E8M0_NAN] = np.nan
    return out


def check_shapes(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...], where: str = "") -> tuple[int, int]:
    """(n, k) of one expert matrix; ShapeError unless blocks [n, G, 16] and scales [n, G] agree."""
    if len(blocks_shape) != 3 or blocks_shape[2] != BLOCK // 2 or tuple(scales_shape) != tuple(blocks_shape[:2]):
        raise ShapeError("MXFP4 blocks/scales shapes disagree", tensor=where or None,
                         expected="blocks [n, k/32, 16] with scales [n, k/32]",
                         found=f"blocks {list(blocks_shape)}, scales {list(scales_shape)}")
    return blocks_shape[0], blocks_shape[1] * BLOCK


def dequant(blocks: np.ndarray, scales: np.ndarray, where: str = "", *, threads: int = 1,
            impl: str | None = None) -> np.ndarray:
    """blocks uint8 [n, G, 16] + scales uint8 [n, G] -> uint16 [n, G*32] BF16 bits (exact).
    impl: None (native C when built, else this numpy code), "numpy", or "scalar" | "avx2" | "avx512"."""
    n, k = check_shapes(blocks.shape, scales.shape, where)
    native = route(impl)
    if native is not None and blocks.dtype == np.uint8 and scales.dtype == np.uint8 and n and k:
        return native.mxfp4_dequant(blocks, scales, threads=threads, impl=impl, name=where or None)
    nibbles = np.empty((n, blocks.shape[1], BLOCK), dtype=np.uint8)
    nibbles[:, :, 0::2] = blocks & 0x0F
    nibbles[:, :, 1::2] = blocks >> 4
    with np.errstate(over="ignore"):     # 6 * 2^127 is +-inf in float32 and in BF16 alike
        values = E2M1_TO_F32[nibbles] * e8m0_to_f32(scales)[:, :, None]
    return f32_to_bf16_bits(values.reshape(n, k))


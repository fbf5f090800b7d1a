"""FP8 E4M3 (e4m3fn) bits <-> float32, and block-scaled FP8 matrices <-> BF16 bits (kt-format.md §3.2).

e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F / 0xFF are NaN; max finite 448.
Codes are numpy uint8 bit patterns (safetensors ``F8_E4M3``). A block-scaled matrix W [n, k] stores codes
[n, k] and one scale per (bn x bk) block, [ceil(n/bn), ceil(k/bk)]; edge blocks may be partial. W = q * s.

Rounding (bit-exact with compressed-tensors' decompressors):
* product in float32, then round-to-nearest-even to BF16 (DeepSeek ``weight_scale_inv``, any scale dtype, as
  compressed-tensors ``FP8BlockDequantizer``; and compressed-tensors ``float-quantized`` with F32 or BF16 scales);
* ``product_dtype=float16``: compressed-tensors multiplies in the scale's dtype, so F16 scales round the product
  to float16 first, then to BF16.
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import NumericError, ShapeError
from ktconvert.native.decode import route
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

E4M3_MAX = 448.0
_E4M3_EXP_BIAS = 7
_MIN_NORMAL = 2.0 ** -6       # smallest normal e4m3 value (code 0x08)
_SUBNORMAL_STEP = 2.0 ** -9   # e4m3 subnormals are m * 2^-9, m in 0..7


def _e4m3_table() -> np.ndarray:
    """float32 [256]: the value of every e4m3fn code, from the format definition."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    mant = codes & 0x7
    normal = (1.0 + mant / 8.0) * np.exp2(exp - _E4M3_EXP_BIAS)
    subnormal = mant * _SUBNORMAL_STEP
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_TO_F32: np.ndarray = _e4m3_table()


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 [...] e4m3fn codes: round-to-nearest-even, saturating at +-448, NaN -> 0x7F.

    Normals round the float32 bit pattern to 3 mantissa bits; below 2^-6 the value is rint(|x| * 2^9) subnormal
    steps (both exact operations in float32), so every finite input has one well-defined code.
    """
    x = np.asarray(x, dtype=np.float32)
    sign = (np.signbit(x).astype(np.uint8) << np.uint8(7))
    mag = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    u = mag.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1)))) >> np.uint32(20)
    normal_code = rounded.astype(np.int64) - ((127 - _E4M3_EXP_BIAS) << 3)
    sub_code = np.rint(mag * np.float32(1.0 / _SUBNORMAL_STEP)).astype(np.int64)
    code = np.where(mag < np.float32(_MIN_NORMAL), sub_code, normal_code).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0x7F), code | sign)
    return code.astype(np.uint8)


def block_scale_shape(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid [ceil(n/bn), ceil(k/bk)] for an [n, k] matrix in (bn, bk) blocks (partial edges included)."""
    bn, bk = block
    return -(-n // bn), -(-k // bk)


def check_block_scale(n: int, k: int, block: tuple[int, int], scale_shape: tuple[int, ...],
                      where: str = "") -> None:
    """ShapeError unless scale_shape is the block grid of [n, k] (a 1-row grid may also be 1-D)."""
    if len(block) != 2 or min(block) <= 0:
        raise ShapeError("bad FP8 block size", tensor=where or None, expected="[bn, bk] positive ints",
                         found=str(list(block)))
    want = block_scale_shape(n, k, block)
    if tuple(scale_shape) != want:
        raise ShapeError(f"FP8 block scale does not match weight [{n}, {k}] in {list(block)} blocks",
                         tensor=where or None, expected=f"scale shape {list(want)}", found=str(list(scale_shape)))


def _round_product(prod_f32: np.ndarray, product_dtype) -> np.ndarray:
    """float32 products -> BF16 bits, rounding through float16 first when the reference multiplies in fp16."""
    if np.dtype(product_dtype) == np.float16:
        prod_f32 = prod_f32.astype(np.float16).astype(np.float32)
    return f32_to_bf16_bits(prod_f32)


def dequant_block(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int], *,
                  product_dtype=np.float32, where: str = "", threads: int = 1, impl: str | None = None) -> np.ndarray:
    """Block-scaled FP8 -> BF16 bits.

    codes: uint8 [n, k] e4m3fn; scale: float32 [ceil(n/bn), ceil(k/bk)] (values already widened from the
    stored dtype); block: (bn, bk). returns uint16 [n, k]: RNE_bf16(e4m3(q) * s) with the product in float32
    (or rounded to float16 first when product_dtype is float16).
    impl: None (native C when built, else this numpy code), "numpy", or "scalar" | "avx2" | "avx512" (native);
    threads: native row split. Every choice gives the same bits.
    """
    n, k = codes.shape
    bn, bk = block
    check_block_scale(n, k, block, np.shape(scale), where)
    scale = np.asarray(scale, dtype=np.float32)
    native = route(impl)
    if native is not None and codes.dtype == np.uint8 and codes.size:
        return native.fp8_block_dequant(codes, scale, block, np.dtype(product_dtype) == np.float16,
                                        threads=threads, impl=impl, name=where or None)
    col_scale = np.repeat(scale, bk, axis=1)[:, :k]          # [nb, k]
    out = np.empty((n, k), dtype=np.uint16)
    for i in range(scale.shape[0]):
        rows = slice(i * bn, min(n, (i + 1) * bn))
        prod = E4M3_TO_F32[codes[rows]] * col_scale[i]
        out[rows] = _round_product(prod, product_dtype)
    return out


def quantize_block(w_bf16: np.ndarray, block: tuple[int, int] = (128, 128),
                   where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """BF16 bits -> DeepSeek-convention block FP8 (what ``quant_method: fp8`` checkpoints hold).

    w_bf16: uint16 [n, k]. Per (bn x bk) block (partial edges included): s = fp32(amax / 448), q = e4m3(w / s);
    an all-zero block gets s = 1. returns (codes uint8 [n, k], scale_inv float32 [ceil(n/bn), ceil(k/bk)]),
    with W ~= e4m3(q) * scale_inv. NumericError on NaN/Inf.
    """
    n, k = w_bf16.shape
    bn, bk = block
    nb, kb = block_scale_shape(n, k, block)
    codes = np.empty((n, k), dtype=np.uint8)
    scale = np.empty((nb, kb), dtype=np.float32)
    for i in range(nb):
        w = bf16_bits_to_f32(w_bf16[i * bn:(i + 1) * bn])
        if not np.isfinite(w).all():
            raise NumericError("NaN or Inf in weights", tensor=where or None)
        pad = kb * bk - k
        amax = np.abs(np.pad(w, ((0, 0), (0, pad)))).reshape(w.shape[0], kb, bk).max(axis=(0, 2))
        s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
        s[amax == 0] = 1.0
        scale[i] = s
        codes[i * bn:(i + 1) * bn] = f32_to_e4m3(w / np.repeat(s, bk)[:k])
    return codes, scale

"""compressed-tensors ``pack-quantized`` integer weights (Kimi-K2 INT4 style), both directions.

On disk (per Linear): ``weight_packed`` int32 [n, k*b/32] (b = num_bits; 32/b values per word, element j of a
word in bits [j*b, j*b+b), stored offset-binary q + 2^(b-1)), ``weight_scale`` [n, k/group] (group strategy),
[n, 1] (channel) or [1] (tensor), optional ``weight_zero_point`` (asymmetric: int32 packed along rows,
[ceil(n*b/32), groups]) and ``weight_shape`` int64 [2] = [n, k]. W = (q - zp) * scale.

Rounding (bit-exact with compressed-tensors ``PackedQuantizationCompressor``): the product is computed in the
scale's dtype as torch does (float32 product, rounded to float16 first for F16 scales), then RNE to BF16.
The quantize direction re-derives compressed-tensors' symmetric RTN in BF16 arithmetic (tests check it
bit for bit against compressed-tensors and llmcompressor).
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import NumericError, ShapeError
from ktconvert.native.decode import route
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

SUPPORTED_BITS = (2, 4, 8)       # widths that divide 32: no value straddles two words
BF16_EPS = 2.0 ** -7             # torch.finfo(bfloat16).eps: compressed-tensors' stand-in for a zero scale


def _check_bits(num_bits: int, where: str = "") -> int:
    if num_bits not in SUPPORTED_BITS:
        raise ShapeError("unsupported pack-quantized width", tensor=where or None,
                         expected=f"num_bits in {list(SUPPORTED_BITS)}", found=str(num_bits))
    return num_bits


def packed_cols(k: int, num_bits: int = 4) -> int:
    """int32 words per row for k values of num_bits: ceil(k * b / 32)."""
    return -(-k * num_bits // 32)


def unpack_int32(packed: np.ndarray, k: int, num_bits: int = 4, where: str = "", *,
                 impl: str | None = None) -> np.ndarray:
    """int32 [r, ceil(k*b/32)] -> int8 [r, k] signed values (offset 2^(b-1) removed), along the last axis.
    impl: None (native C when built, else this numpy code), "numpy", or "scalar" | "avx2" | "avx512"."""
    per_word = 32 // _check_bits(num_bits, where)
    r, words = packed.shape
    if words != packed_cols(k, num_bits):
        raise ShapeError("weight_packed width does not match weight_shape", tensor=where or None,
                         expected=f"{packed_cols(k, num_bits)} int32 per row for {k} values", found=str(words))
    native = _native(impl)
    if native is not None and packed.dtype == np.int32 and k > 0:
        return native.ct_unpack(packed, k, num_bits, name=where or None)
    u = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(num_bits))
    fields = (u[:, :, None] >> shifts) & np.uint32((1 << num_bits) - 1)     # [r, words, per_word]
    values = fields.reshape(r, words * per_word)[:, :k].astype(np.int16)
    return (values - (1 << (num_bits - 1))).astype(np.int8)


def pack_int32(q: np.ndarray, num_bits: int = 4, where: str = "") -> np.ndarray:
    """int8 [r, k] signed values in [-2^(b-1), 2^(b-1)) -> int32 [r, ceil(k*b/32)] (inverse of unpack_int32)."""
    per_word = 32 // _check_bits(num_bits, where)
    r, k = q.shape
    half = 1 << (num_bits - 1)
    if q.size and (q.min() < -half or q.max() >= half):
        raise ShapeError("value out of range for packing", tensor=where or None,
                         expected=f"[{-half}, {half - 1}]", found=f"[{q.min()}, {q.max()}]")
    words = packed_cols(k, num_bits)
    u = np.zeros((r, words * per_word), dtype=np.uint32)
    u[:, :k] = (q.astype(np.int32) + half).astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(num_bits))
    packed = np.bitwise_or.reduce(u.reshape(r, words, per_word) << shifts, axis=2)
    return packed.astype(np.uint32).view(np.int32)


def _scale_per_column(scale: np.ndarray, n: int, k: int, group_size: int | None, where: str) -> np.ndarray:
    """Broadcast a group/channel/tensor scale (or zero point) to [n, k]-compatible [n or 1, k] by column."""
    s = np.asarray(scale)
    if s.ndim <= 1 and s.size == 1:
        return s.reshape(1, 1)
    if s.ndim == 2 and s.shape == (n, 1):
        return s
    groups = k // group_size if group_size else 0
    if not group_size or k % group_size or s.shape != (n, groups):
        raise ShapeError("weight_scale does not match the weight and group size", tensor=where or None,
                         expected=f"[{n}, {groups if group_size else 'k/group'}] (group {group_size}), "
                                  f"[{n}, 1] or [1]", found=str(list(s.shape)))
    return np.repeat(s, group_size, axis=1)


def _native(impl: str | None):
    """ktconvert.native.decode when `impl` selects native decoding (see its route()), else None."""
    return route(impl)


def dequant(q: np.ndarray, scale: np.ndarray, group_size: int | None, zero_point: np.ndarray | None = None, *,
            product_dtype=np.float32, where: str = "", threads: int = 1, impl: str | None = None) -> np.ndarray:
    """Grouped integer weights -> BF16 bits.

    q: int8 [n, k]; scale: float32 values [n, k/group] | [n, 1] | [1]; zero_point: int8 of the scale's shape or
    None. returns uint16 [n, k] = RNE_bf16((q - zp) * scale), product in float32 (float16 when product_dtype is
    float16, as torch computes with F16 scales).
    impl: None (native C when built, else this numpy code), "numpy", or "scalar" | "avx2" | "avx512";
    threads: native row split. Every choice gives the same bits.
    """
    n, k = q.shape
    s = _scale_per_column(np.asarray(scale, dtype=np.float32), n, k, group_size, where)
    native = _native(impl)
    if native is not None and _native_operands(q, zero_point, n, k, group_size, where):
        return native.ct_dequant(q, np.asarray(scale, dtype=np.float32), group_size, zero_point,
                                 np.dtype(product_dtype) == np.float16, threads=threads, impl=impl,
                                 name=where or None)
    x = q.astype(np.float32)
    if zero_point is not None:
        x -= _scale_per_column(np.asarray(zero_point, dtype=np.float32), n, k, group_size, where)
    prod = x * s
    if np.dtype(product_dtype) == np.float16:
        prod = prod.astype(np.float16).astype(np.float32)
    return f32_to_bf16_bits(prod)


def _native_operands(q: np.ndarray | None, zero_point, n: int, k: int, group_size: int | None, where: str) -> bool:
    """True when the native decoder takes these operands as they are: int8 values (or packed), an int8 zero point
    whose shape passes the same check as the scale's, and a non-empty matrix."""
    if (q is not None and q.dtype != np.int8) or n == 0 or k == 0:
        return False
    if zero_point is None:
        return True
    _scale_per_column(np.asarray(zero_point), n, k, group_size, where)
    return np.asarray(zero_point).dtype == np.int8


def dequant_packed(packed: np.ndarray, k: int, num_bits: int, scale: np.ndarray, group_size: int | None,
                   zero_point: np.ndarray | None = None, *, product_dtype=np.float32, where: str = "",
                   threads: int = 1, impl: str | None = None) -> np.ndarray:
    """dequant(unpack_int32(packed, k, num_bits), ...), in one native pass when available (no int8 [n, k] copy).

    packed: int32 [n, ceil(k*b/32)]; other arguments and the result as dequant: uint16 [n, k] BF16 bits."""
    n = packed.shape[0]
    native = _native(impl)
    if native is None or packed.dtype != np.int32 or not _native_operands(None, zero_point, n, k, group_size, where):
        return dequant(unpack_int32(packed, k, num_bits, where, impl=impl), scale, group_size, zero_point,
                       product_dtype=product_dtype, where=where, threads=threads, impl=impl)
    if packed.shape[1] != packed_cols(k, _check_bits(num_bits, where)):
        raise ShapeError("weight_packed width does not match weight_shape", tensor=where or None,
                         expected=f"{packed_cols(k, num_bits)} int32 per row for {k} values",
                         found=str(packed.shape[1]))
    _scale_per_column(np.asarray(scale), n, k, group_size, where)
    return native.ct_dequant(None, np.asarray(scale, dtype=np.float32), group_size, zero_point,
                             np.dtype(product_dtype) == np.float16, threads=threads, impl=impl, name=where or None,
                             packed=packed, k=k, num_bits=num_bits)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding the BF16 RNE rounding of x (one torch bfloat16 op result)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def quantize_sym_groups(w_bf16: np.ndarray, group_size: int, num_bits: int = 4,
                        where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric grouped RTN as compressed-tensors/llmcompressor do it on BF16 weights (W4A16 preset).

    w_bf16: uint16 [n, k], k % group_size == 0. Per group: s = bf16(amax / bf16((qmax - qmin) / 2)) (7.5 for
    int4), 0 -> 2^-7; q = clamp(round_half_even(bf16(w / s)), qmin, qmax).
    returns (q int8 [n, k], scale uint16 BF16 bits [n, k / group_size]).
    """
    _check_bits(num_bits, where)
    n, k = w_bf16.shape
    if group_size <= 0 or k % group_size:
        raise ShapeError("in_features not a multiple of the group size", tensor=where or None,
                         expected=f"k % {group_size} == 0", found=f"k = {k}")
    qmin, qmax = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    w = bf16_bits_to_f32(w_bf16).reshape(n, k // group_size, group_size)
    if not np.isfinite(w).all():
        raise NumericError("NaN or Inf in weights", tensor=where or None)
    amax = np.abs(w).max(axis=2)
    scale = _bf16_round(amax / np.float32((qmax - qmin) / 2))
    scale[scale == 0] = np.float32(BF16_EPS)
    q = np.rint(np.clip(_bf16_round(w / scale[:, :, None]), qmin, qmax)).astype(np.int8)
    return q.reshape(n, k), f32_to_bf16_bits(scale)


def pack_quantized_config(group_size: int, targets: list[str], ignore: list[str] | None = None) -> dict:
    """quantization_config of a symmetric INT4 pack-quantized checkpoint (as llmcompressor 0.14 writes it)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": None,
               "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": targets, "format": "pack-quantized", "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": list(ignore or ["lm_head"]), "kv_cache_scheme": None, "global_compression_ratio": None}

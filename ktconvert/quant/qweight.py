"""GPTQ and AWQ integer weights (``qweight`` / ``qzeros`` / ``scales``), both directions. numpy only.

Both formats store unsigned b-bit fields in int32 words, field j of a word in bits [j*b, j*b+b) (b = 2, 4, 8),
and keep the matrix input-major: W[k, n] for in-feature k and out-feature n (nn.Linear's transpose).

* GPTQ (AutoGPTQ / GPTQModel): ``qweight`` [K*b/32, N] packed along K (row r holds k = r*32/b + j), ``qzeros``
  [G, N*b/32] packed along N, ``scales`` [G, N], optional ``g_idx`` [K] (group of each in-feature; act-order
  checkpoints permute it). W[k, n] = scales[g, n] * (q[k, n] - z[g, n]) with g = g_idx[k] (else k // group).
  ``checkpoint_format`` "gptq" (v1) stores z - 1 in qzeros (the decoders add 1 to each field, so a stored field
  of 2^b - 1 means z = 2^b), "gptq_v2" stores z.
* AWQ GEMM (AutoAWQ): ``qweight`` [K, N*b/32] and ``qzeros`` [G, N*b/32] both packed along N in AWQ's order:
  field i of word w holds column w*32/b + AWQ_ORDER[i]; ``scales`` [G, N]; g = k // group.

Rounding, as the libraries' torch dequantization computes it: the product of the integer difference and the
scale in the scale's dtype (float32 product, rounded to float16 first for F16 scales), then round-to-nearest-even
to BF16. Results are uint16 BF16 bits [N, K] (nn.Linear orientation).
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import ShapeError
from ktconvert.quant.bf16 import f32_to_bf16_bits

SUPPORTED_BITS = (2, 4, 8)             # widths that divide 32: no field straddles two words
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # field i of an AWQ 4-bit word holds column AWQ_ORDER[i] of its eight


def per_word(bits: int, where: str = "") -> int:
    """Fields per int32 word (32 / bits); ShapeError for a width the formats here do not pack."""
    if bits not in SUPPORTED_BITS:
        raise ShapeError("unsupported integer width", tensor=where or None,
                         expected=f"bits in {list(SUPPORTED_BITS)}", found=str(bits))
    return 32 // bits


def _fields(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 [..., w] -> uint8 [..., w, 32/b]: every field of every word, low bits first."""
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(32 // bits, dtype=np.uint32) * np.uint32(bits)
    return ((u[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8)


def _order(bits: int, order) -> np.ndarray | None:
    if order is None:
        return None
    order = np.asarray(order, dtype=np.int64)
    if sorted(order.tolist()) != list(range(32 // bits)):
        raise ShapeError("packing order is not a permutation of a word's fields", expected=f"{32 // bits} fields",
                         found=str(order.tolist()))
    return order


def unpack_rows(words: np.ndarray, bits: int, where: str = "") -> np.ndarray:
    """GPTQ qweight int32 [R, N] -> uint8 [R*32/b, N]: row r*32/b + j is field j of row r."""
    per = per_word(bits, where)
    r, n = words.shape
    if bits == 4:           # byte-wise: field 2i is the low nibble of byte i of the (little-endian) word
        b = np.swapaxes(np.ascontiguousarray(words).astype("<i4", copy=False).view(np.uint8).reshape(r, n, 4), 1, 2)
        out = np.empty((r, per, n), dtype=np.uint8)
        np.bitwise_and(b, 0x0F, out=out[:, 0::2])
        np.right_shift(b, 4, out=out[:, 1::2])
        return out.reshape(r * per, n)
    return np.ascontiguousarray(np.swapaxes(_fields(words, bits), 1, 2)).reshape(r * per, n)


def pack_rows(values: np.ndarray, bits: int, where: str = "") -> np.ndarray:
    """uint8 [K, N] fields in [0, 2^b) -> int32 [K*b/32, N] (inverse of unpack_rows; K a multiple of 32/b)."""
    per = per_word(bits, where)
    k, n = values.shape
    _check_fields(values, bits, where)
    if k % per:
        raise ShapeError("rows do not fill whole words", tensor=where or None, expected=f"a multiple of {per}",
                         found=str(k))
    v = values.astype(np.uint32).reshape(k // per, per, n)
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))[None, :, None]
    return np.bitwise_or.reduce(v << shifts, axis=1).astype(np.uint32).view(np.int32)


def unpack_cols(words: np.ndarray, bits: int, order=None, where: str = "") -> np.ndarray:
    """int32 [R, W] packed along columns -> uint8 [R, W*32/b]; `order` (AWQ_ORDER for AWQ): field i of word w is
    column w*32/b + order[i] (None: column w*32/b + i)."""
    per = per_word(bits, where)
    fields = _fields(words, bits)                      # [R, W, per]
    perm = _order(bits, order)
    if perm is not None:
        out = np.empty_like(fields)
        out[:, :, perm] = fields
        fields = out
    r, w = words.shape
    return fields.reshape(r, w * per)


def pack_cols(values: np.ndarray, bits: int, order=None, where: str = "") -> np.ndarray:
    """uint8 [R, C] fields -> int32 [R, C*b/32] (inverse of unpack_cols; C a multiple of 32/b)."""
    per = per_word(bits, where)
    r, c = values.shape
    _check_fields(values, bits, where)
    if c % per:
        raise ShapeError("columns do not fill whole words", tensor=where or None, expected=f"a multiple of {per}",
                         found=str(c))
    v = values.astype(np.uint32).reshape(r, c // per, per)
    perm = _order(bits, order)
    if perm is not None:
        v = v[:, :, perm]
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    return np.bitwise_or.reduce(v << shifts, axis=2).astype(np.uint32).view(np.int32)


def _check_fields(values: np.ndarray, bits: int, where: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= (1 << bits)):
        raise ShapeError("value out of range for packing", tensor=where or None,
                         expected=f"[0, {(1 << bits) - 1}]", found=f"[{values.min()}, {values.max()}]")


def dequant(q: np.ndarray, zeros: np.ndarray, scale: np.ndarray, group_size: int | None,
            g_idx: np.ndarray | None = None, *, product_dtype=np.float32) -> np.ndarray:
    """Input-major integers -> BF16 bits in nn.Linear orientation.

    q: uint8 [K, N] fields; zeros: integer [G, N] zero points (already the z of the formula); scale: float32 values
    [G, N]; g_idx: int [K] group of each row in [0, G) (checked by the caller), else row k is in group
    k // group_size (group_size None: one group). returns uint16 [N, K] = RNE_bf16((q - z) * s), product in float32
    (float16 when product_dtype is float16: torch's product with F16 scales)."""
    k, n = q.shape
    g = scale.shape[0]
    z = np.asarray(zeros, dtype=np.float32)
    s = np.asarray(scale, dtype=np.float32)
    levels = int(q.max()) + 1 if q.size else 1
    if levels * g < k:      # fewer distinct (group, column, value) triples than weights: decode a table, gather
        return _dequant_table(q, z, s, group_size, g_idx, levels, product_dtype)
    if g_idx is None and group_size and k == g * group_size:
        x = (q.astype(np.float32).reshape(g, group_size, n) - z[:, None, :]) * s[:, None, :]
        x = x.reshape(k, n)
    else:
        idx = np.asarray(g_idx, dtype=np.int64) if g_idx is not None else \
            (np.arange(k) // group_size if group_size else np.zeros(k, dtype=np.int64))
        x = (q.astype(np.float32) - z[idx]) * s[idx]
    if np.dtype(product_dtype) == np.float16:
        with np.errstate(over="ignore"):                 # torch's float16 product overflows to inf as well
            x = x.astype(np.float16).astype(np.float32)
    return np.ascontiguousarray(f32_to_bf16_bits(x).T)


def _dequant_table(q, z, s, group_size, g_idx, levels: int, product_dtype) -> np.ndarray:
    """dequant() through a table of every (group, column, value): the same float operations on each triple, then
    one gather per weight (exactly the bits of the direct computation)."""
    k, n = q.shape
    table = (np.arange(levels, dtype=np.float32)[None, None, :] - z[:, :, None]) * s[:, :, None]
    if np.dtype(product_dtype) == np.float16:
        with np.errstate(over="ignore"):
            table = table.astype(np.float16).astype(np.float32)
    table = f32_to_bf16_bits(table).reshape(-1)
    rows = np.asarray(g_idx, dtype=np.int64) if g_idx is not None else \
        (np.arange(k) // group_size if group_size else np.zeros(k, dtype=np.int64))
    base = (rows[:, None] * n + np.arange(n)[None, :]) * levels       # [K, N] start of each weight's table row
    base += q
    return np.ascontiguousarray(table[base].T)

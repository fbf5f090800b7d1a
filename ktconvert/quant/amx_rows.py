"""AMXINT4 / AMXINT8 per-row quantization, numpy reference (kt-format.md §2.1, §2.2).

Both methods are symmetric, one fp32 scale ``d`` per output row over all of k, no zero point, and mirror kt-kernel
0.7.2 bit for bit, including its observed details: denormals are flushed (a subnormal input reads as 0, a scale
that would be subnormal is stored as 0 with all codes 0), ``inv = 1/d`` is an fp32 reciprocal, ``x * inv`` is an
fp32 product rounded to nearest-even and saturated to int8. INT4 then rounds a second time from int8 to 4 bits.

Inputs are BF16 bit patterns (numpy uint16 [n, k]); ``where`` names the tensor in error messages.
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import NumericError

INT4_DIVISOR = 112.0        # d = amax / 112 (d is 1/16 of the real step amax/7)
INT8_DIVISOR = 127.0        # d = fp32(amax * fp32(1/127))
_F32_MIN_NORMAL = np.float32(np.finfo(np.float32).tiny)  # 2**-126
_BF16_EXP_MASK = np.uint16(0x7F80)


def _check_bf16(w_bf16: np.ndarray, where: str) -> None:
    """Shape/dtype precondition and the NaN/Inf check (all-ones exponent)."""
    if not isinstance(w_bf16, np.ndarray) or w_bf16.dtype != np.uint16 or w_bf16.ndim != 2:
        found = f"{getattr(w_bf16, 'dtype', type(w_bf16).__name__)} {list(getattr(w_bf16, 'shape', ()))}"
        raise NumericError("weights must be BF16 bits", tensor=where or None,
                           expected="uint16 [n, k]", found=found)
    special = (w_bf16 & _BF16_EXP_MASK) == _BF16_EXP_MASK
    if special.any():
        r, c = (int(i) for i in np.argwhere(special)[0])
        kind = "NaN" if w_bf16[r, c] & np.uint16(0x007F) else "Inf"
        raise NumericError(f"{int(special.sum())} non-finite value(s), first {kind} at row {r}, column {c}",
                           tensor=where or None, hint="the source checkpoint is corrupt at this tensor")


def bf16_rows_ftz(w_bf16: np.ndarray, where: str = "") -> np.ndarray:
    """uint16 [n, k] BF16 bits -> float32 [n, k], subnormals flushed to (signed) zero as kt-kernel's DAZ does.

    Raises NumericError on NaN/Inf or a non-uint16/non-2-D input.
    """
    _check_bf16(w_bf16, where)
    bits = np.ascontiguousarray(w_bf16).astype(np.uint32)
    subnormal = (bits & np.uint32(0x7F80)) == 0
    bits[subnormal] &= np.uint32(0x8000)
    return (bits << np.uint32(16)).view(np.float32)


def _flush_tiny_scales(d: np.ndarray) -> np.ndarray:
    """float32 [n]: scales below 2**-126 become 0 (FTZ); the rows then quantize to all zero codes."""
    return np.where(d < _F32_MIN_NORMAL, np.float32(0), d).astype(np.float32)


def _int8_levels(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """float32 [n, k], float32 [n] -> float32 [n, k] integral values saturate_int8(rint_even(fp32(x * fp32(1/d)))),
    0 where d == 0. Computed in place in one float32 temporary."""
    inv = np.zeros_like(d)
    nonzero = d != 0
    inv[nonzero] = np.float32(1) / d[nonzero]
    q = np.multiply(x, inv[:, None])            # fp32 product, RNE
    np.rint(q, out=q)                           # round half to even, like _mm512_cvtps_epi32
    np.clip(q, -128, 127, out=q)                # _mm512_cvtsepi32_epi8 saturation
    return q


def quantize_int4_rows(w_bf16: np.ndarray, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """AMXINT4 per-row quantization (kt-format.md §2.1).

    w_bf16: uint16 [n, k] BF16 bits.
    returns: codes int8 [n, k] in -7..7 (never -8), d float32 [n] with w ~= codes * 16 * d.
    Raises NumericError (naming ``where``) on NaN/Inf.
    """
    x = bf16_rows_ftz(w_bf16, where)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    d = _flush_tiny_scales((amax.astype(np.float64) / INT4_DIVISOR).astype(np.float32))
    q = _int8_levels(x, d)
    q += np.copysign(np.float32(8), q)          # trunc((q8 +- 8) / 16) == sign(q8) * floor((|q8| + 8) / 16)
    q *= np.float32(1 / 16)                     # exact: small integers / 16
    np.trunc(q, out=q)                          # i.e. half away from zero on q8 / 16
    return q.astype(np.int8), d


def quantize_int8_rows(w_bf16: np.ndarray, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """AMXINT8 per-row quantization (kt-format.md §2.2).

    w_bf16: uint16 [n, k] BF16 bits.
    returns: codes int8 [n, k] in -127..127, d float32 [n] with w ~= codes * d.
    Raises NumericError (naming ``where``) on NaN/Inf.
    """
    x = bf16_rows_ftz(w_bf16, where)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    d = _flush_tiny_scales(amax * np.float32(1.0 / INT8_DIVISOR))
    return _int8_levels(x, d).astype(np.int8), d


def dequantize_int4_rows(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """int8 [n, k] codes in -7..7, float32 [n] -> float32 [n, k] = codes * 16 * d (kt-kernel's to_mat)."""
    return codes.astype(np.float32) * (np.float32(16) * np.asarray(d, np.float32))[:, None]


def dequantize_int8_rows(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """int8 [n, k] codes, float32 [n] -> float32 [n, k] = codes * d."""
    return codes.astype(np.float32) * np.asarray(d, np.float32)[:, None]

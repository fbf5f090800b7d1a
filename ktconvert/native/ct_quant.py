"""ctypes binding of native/ct_quant.c: compressed-tensors pack-quantized RTN (W4A16 / W8A16) of BF16 weights.

Bytes equal compressed-tensors 0.19's ``calculate_qparams`` + ``PackedQuantizationCompressor.compress`` (what
llmcompressor's ``model_free_ptq`` writes) and the numpy reference ``ktconvert.quant.ct_int4.quantize_sym_groups``
+ ``pack_int32``; ``ktconvert.gpu.experts.quantize_expert_rtn`` picks between them. The formulas are in
native/kt_ct_quant.h.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ktconvert import native
from ktconvert.errors import ShapeError

_I64, _INT = ctypes.c_int64, ctypes.c_int


def _signatures() -> dict:
    return {"kt_ct_rtn_quantize": (_INT, [native.array(np.uint16), _I64, _I64, _INT, _I64, _INT,
                                          native.out_array(np.int32), native.out_array(np.uint16), _I64, _I64,
                                          native.out_array(np.int64, nullable=True)])}


def usable() -> bool:
    """True when the automatic choice is native: the library is available (not KTCONVERT_FORCE_IMPL=numpy) and has
    the function."""
    return native.available() and native.bind(_signatures) is not None


def rtn_quantize(w_bf16: np.ndarray, bits: int, group_size: int | None, threads: int = 1, impl: str | None = None,
                 name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric RTN with BF16 group scales, packed as compressed-tensors stores it.

    w_bf16: uint16 [n, k] BF16 bits; bits 4 or 8; group_size: columns per scale (k % group_size == 0), None for
    channel-wise (one scale per row); k * bits % 32 == 0.
    returns (weight_packed int32 [n, k * bits / 32], weight_scale uint16 BF16 bits [n, k / group_size] or [n, 1]).
    threads: rows split over the shared native pool (bytes never depend on it); impl: None (automatic,
    KTCONVERT_FORCE_IMPL honoured) or "scalar" | "avx2" | "avx512". NumericError names the first NaN/Inf.
    """
    if not isinstance(w_bf16, np.ndarray) or w_bf16.dtype != np.uint16 or w_bf16.ndim != 2:
        raise ShapeError("weights must be BF16 bits", tensor=name, expected="uint16 [n, k]",
                         found=f"{getattr(w_bf16, 'dtype', type(w_bf16).__name__)} {list(np.shape(w_bf16))}")
    n, k = w_bf16.shape
    group = k if group_size is None else int(group_size)
    if bits not in (4, 8) or n == 0 or k == 0 or group <= 0 or k % group or (k * bits) % 32 or (group * bits) % 8:
        raise ShapeError("cannot pack this matrix with compressed-tensors' int packing", tensor=name,
                         expected="bits 4 or 8, k % group == 0, k * bits % 32 == 0", found=f"[{n}, {k}], "
                         f"bits {bits}, group {group_size}")
    handle = native.bound_or_raise(_signatures, "kt_ct_rtn_quantize", name)
    impl_id = native.resolve_impl(impl)
    w = np.ascontiguousarray(w_bf16)
    packed = np.empty((n, k * bits // 32), np.int32)
    scale = np.empty((n, k // group), np.uint16)
    native.run_ranges(lambda b, e, err: handle.kt_ct_rtn_quantize(w, n, k, bits, group, impl_id, packed, scale, b, e,
                                                                  err),
                      n, threads, what="kt_ct_rtn_quantize", name=name, found=f"[n, k] = [{n}, {k}]", w_bf16=w)
    return packed, scale

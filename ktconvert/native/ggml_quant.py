"""ctypes bindings of the native ggml quantizers (native/ggml_quant.c): Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, without and
with an importance matrix (``quantize_imatrix``).

Bytes equal ``ktconvert.quant.ggml_quant``'s numpy / gguf-py paths and llama.cpp's reference quantizer. ``impl``: None
(automatic, KTCONVERT_FORCE_IMPL honoured) or "scalar" | "avx2" | "avx512". ``threads``: super-block ranges run on
the shared native pool; bytes never depend on it.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ktconvert import native
from ktconvert.errors import NativeError

_I64, _INT = ctypes.c_int64, ctypes.c_int
TYPE_IDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_0": 8, "Q4_0": 2}   # ggml type ids (ggml.h)
BLOCK_ELEMS = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q8_0": 32, "Q4_0": 32}
MIN_BLOCKS_PER_THREAD = 64   # a K-quant super-block takes ~2-3 us (AVX2): below this, threads cost more


def _signatures() -> dict:
    return {
        "kt_ggml_quant_block_bytes": (_I64, [_INT]),
        "kt_ggml_quantize": (_INT, [_INT, _INT, native.array(np.float32), _I64, native.out_array(np.uint8)]),
    }


def supports(ggml_type: str) -> bool:
    """True when the native library is usable and quantizes `ggml_type` (a build from before it: False)."""
    if ggml_type not in TYPE_IDS or not native.available():
        return False
    handle = native.bind(_signatures)
    return handle is not None and handle.kt_ggml_quant_block_bytes(TYPE_IDS[ggml_type]) > 0


def quantize(x: np.ndarray, ggml_type: str, block_bytes: int, threads: int = 1, impl: str | None = None,
             name: str | None = None) -> np.ndarray:
    """float32 values (a whole number of blocks; finite: the caller checks) -> uint8 [n_blocks, block_bytes]."""
    handle = native.bound_or_raise(_signatures, "the native ggml quantizer", name)
    if ggml_type not in TYPE_IDS or handle.kt_ggml_quant_block_bytes(TYPE_IDS[ggml_type]) != block_bytes:
        raise NativeError(f"ggml type {ggml_type} has no native quantizer", tensor=name)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK_ELEMS[ggml_type])
    out = np.empty((x.shape[0], block_bytes), dtype=np.uint8)
    impl_id = native.resolve_impl(impl)
    nblocks = x.shape[0]
    per_thread = MIN_BLOCKS_PER_THREAD * (8 if BLOCK_ELEMS[ggml_type] == 32 else 1)
    native.run_ranges(lambda b, e, _err: handle.kt_ggml_quantize(TYPE_IDS[ggml_type], impl_id, x[b:e], e - b,
                                                                  out[b:e]),
                      nblocks, max(1, min(int(threads), nblocks // per_thread)),
                      what="kt_ggml_quantize", name=name, found=ggml_type)
    return out


def _imatrix_signatures() -> dict:
    return {"kt_ggml_quantize_imatrix": (_INT, [_INT, _INT, native.array(np.float32), _I64, _I64,
                                                native.array(np.float32), native.out_array(np.uint8)])}


def quantize_imatrix(x: np.ndarray, ggml_type: str, qw: np.ndarray, block_bytes: int, threads: int = 1,
                     impl: str | None = None, name: str | None = None) -> np.ndarray:
    """float32 rows [n, k] (finite; k whole blocks: the caller checks) and importances qw float32 [k] ->
    uint8 [n, k / block * block_bytes]: llama.cpp's quantize_row_<type>_impl row by row."""
    handle = native.bound_or_raise(_imatrix_signatures, "the native ggml quantizer with an importance matrix", name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    qw = np.ascontiguousarray(qw, dtype=np.float32)
    n, k = x.shape
    out = np.empty((n, k // BLOCK_ELEMS[ggml_type] * block_bytes), dtype=np.uint8)
    impl_id = native.resolve_impl(impl)
    per_thread = max(1, MIN_BLOCKS_PER_THREAD * 256 // k)
    native.run_ranges(lambda b, e, _err: handle.kt_ggml_quantize_imatrix(TYPE_IDS[ggml_type], impl_id, x[b:e], e - b,
                                                                          k, qw, out[b:e]),
                      n, max(1, min(int(threads), n // per_thread)), what="kt_ggml_quantize_imatrix", name=name,
                      found=ggml_type)
    return out

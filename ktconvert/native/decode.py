"""ctypes bindings of the native decoders of quantized HF inputs (native/kt_decode.h, native/quant_decode.c).

Results are bit-identical to the numpy references in ktconvert.quant (``fp8.dequant_block``,
``ct_int4.unpack_int32`` / ``ct_int4.dequant``, ``mxfp4.dequant``), which route here when ``usable()``.
``impl``: None (automatic, KTCONVERT_FORCE_IMPL honoured) or "scalar" | "avx2" | "avx512". ``threads``: row ranges
run on the shared native pool; the bytes never depend on it. Inputs are checked by the numpy-side callers; these
functions check only what the C code needs (dtypes, contiguity, sizes).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ktconvert import native
from ktconvert.errors import ShapeError

_I64, _INT = ctypes.c_int64, ctypes.c_int
MIN_ELEMENTS_PER_THREAD = 1 << 18  # below this, threads cost more than they save


def _signatures() -> dict:
    a, out = native.array, native.out_array
    u8, u16, i8, i32, f32 = np.uint8, np.uint16, np.int8, np.int32, np.float32
    return {
        "kt_fp8_block_dequant_bf16": (_INT, [a(u8), _I64, _I64, a(f32), _I64, _I64, _INT, _INT, out(u16), _I64,
                                             _I64]),
        "kt_ct_unpack": (_INT, [a(i32), _I64, _I64, _I64, _INT, out(i8)]),
        "kt_ct_dequant_bf16": (_INT, [a(i8), _I64, _I64, a(f32), _I64, a(i8, nullable=True), _I64, _I64, _INT, _INT,
                                      out(u16), _I64, _I64]),
        "kt_ct_packed_dequant_bf16": (_INT, [a(i32), _I64, _I64, _INT, a(f32), _I64, a(i8, nullable=True), _I64,
                                             _I64, _INT, _INT, out(u16), _I64, _I64]),
        "kt_mxfp4_dequant_bf16": (_INT, [a(u8), a(u8), _I64, _I64, _INT, out(u16), _I64, _I64]),
    }


def decode_lib() -> ctypes.CDLL | None:
    """The native library with the decoder signatures set; None when missing, disabled (KTCONVERT_FORCE_IMPL=numpy,
    KTCONVERT_NO_NATIVE) or built before the decoders existed."""
    return native.bind(_signatures) if native.available() else None


def usable() -> bool:
    """True when the automatic choice of the ktconvert.quant decoders is native."""
    return decode_lib() is not None


def usable_impls() -> list[str]:
    """The implementations ("scalar", "avx2", "avx512") that can run here; [] without the library."""
    return native.usable_impls() if usable() else []


def route(impl: str | None):
    """What a ktconvert.quant decoder called with ``impl`` runs: this module (native) or None (numpy).
    impl None: native when usable(), else numpy; "numpy": numpy; "scalar" | "avx2" | "avx512": native (the call
    raises NativeError when that cannot run here)."""
    if impl == "numpy":
        return None
    if impl is None and not usable():
        return None
    import sys

    return sys.modules[__name__]


def _handle(name: str | None) -> ctypes.CDLL:
    return native.bound_or_raise(_signatures, "the native decoders", name)


def _array(a, dtype, what: str, name: str | None) -> np.ndarray:
    """`a` as a C-contiguous array of `dtype` (a copy only when needed)."""
    arr = np.ascontiguousarray(a)
    if arr.dtype != dtype:
        raise ShapeError(f"{what} has the wrong dtype", tensor=name, expected=np.dtype(dtype).name,
                         found=str(arr.dtype))
    return arr


def _rows(fn, n: int, k: int, threads: int, fn_name: str, name: str | None) -> None:
    """fn(row_begin, row_end) -> status over [0, n), split across threads (native.run_ranges)."""
    parts = max(1, min(int(threads), n * k // MIN_ELEMENTS_PER_THREAD, n))
    native.run_ranges(lambda b, e, _err: fn(b, e), n, parts, what=fn_name, name=name, found=f"[n, k] = [{n}, {k}]")


def fp8_block_dequant(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int], product_f16: bool = False,
                      threads: int = 1, impl: str | None = None, name: str | None = None) -> np.ndarray:
    """uint8 [n, k] e4m3fn codes + float32 [ceil(n/bn), ceil(k/bk)] scales -> uint16 [n, k] BF16 bits
    (fp8.dequant_block; the scale grid must already match, as fp8.check_block_scale checks)."""
    handle = _handle(name)
    codes = _array(codes, np.uint8, "FP8 codes", name)
    scale = _array(scale, np.float32, "FP8 scale", name)
    n, k = codes.shape
    bn, bk = int(block[0]), int(block[1])
    if scale.size != -(-n // bn) * -(-k // bk):
        raise ShapeError("FP8 scale grid size", tensor=name, expected=f"{-(-n // bn)} x {-(-k // bk)}",
                         found=str(list(scale.shape)))
    impl_id = native.resolve_impl(impl)
    out = np.empty((n, k), dtype=np.uint16)
    _rows(lambda b, e: handle.kt_fp8_block_dequant_bf16(codes, n, k, scale, bn, bk, int(product_f16),
                                                        impl_id, out, b, e),
          n, k, threads, "kt_fp8_block_dequant_bf16", name)
    return out


def ct_unpack(packed: np.ndarray, k: int, num_bits: int, name: str | None = None) -> np.ndarray:
    """int32 [r, ceil(k*b/32)] -> int8 [r, k] signed values (ct_int4.unpack_int32; widths checked there)."""
    handle = _handle(name)
    packed = _array(packed, np.int32, "weight_packed", name)
    rows, words = packed.shape
    out = np.empty((rows, k), dtype=np.int8)
    native.check_status(handle.kt_ct_unpack(packed, rows, words, k, int(num_bits), out), "kt_ct_unpack", name,
                        found=f"[{rows}, {words}] -> k {k}")
    return out


def _scale_layout(scale: np.ndarray, n: int, k: int, group_size: int | None) -> tuple[int, int]:
    """(row stride, group) of a [n, k/group] | [n, 1] | [1] scale (or zero point), shapes checked by the caller."""
    if scale.size == 1:
        return 0, k
    if scale.shape == (n, 1):
        return 1, k
    return scale.shape[1], int(group_size)


def ct_dequant(q: np.ndarray | None, scale: np.ndarray, group_size: int | None, zero_point: np.ndarray | None = None,
               product_f16: bool = False, threads: int = 1, impl: str | None = None, name: str | None = None, *,
               packed: np.ndarray | None = None, k: int | None = None, num_bits: int = 4) -> np.ndarray:
    """Grouped integer weights -> uint16 [n, k] BF16 bits (ct_int4.dequant): from int8 values `q` [n, k], or in
    one pass from `packed` int32 [n, ceil(k*b/32)] with `k` and `num_bits`. scale: float32 [n, k/group] | [n, 1] |
    [1]; zero_point: int8 of the scale's shape or None (shapes already checked by the caller)."""
    handle = _handle(name)
    scale = _array(scale, np.float32, "weight_scale", name)
    zp = None if zero_point is None else _array(zero_point, np.int8, "weight_zero_point", name)
    if packed is None:
        q = _array(q, np.int8, "quantized values", name)
        n, k = q.shape
    else:
        packed = _array(packed, np.int32, "weight_packed", name)
        n = packed.shape[0]
    s_stride, group = _scale_layout(scale, n, k, group_size)
    z_stride = _scale_layout(zp, n, k, group_size)[0] if zp is not None else 0
    impl_id = native.resolve_impl(impl)
    out = np.empty((n, k), dtype=np.uint16)
    if packed is None:
        def run(b: int, e: int) -> int:
            return handle.kt_ct_dequant_bf16(q, n, k, scale, s_stride, zp, z_stride, group, int(product_f16), impl_id,
                                             out, b, e)
    else:
        def run(b: int, e: int) -> int:
            return handle.kt_ct_packed_dequant_bf16(packed, n, k, int(num_bits), scale, s_stride, zp, z_stride, group,
                                                    int(product_f16), impl_id, out, b, e)
    _rows(run, n, k, threads, "kt_ct_dequant_bf16", name)
    return out


def mxfp4_dequant(blocks: np.ndarray, scales: np.ndarray, threads: int = 1, impl: str | None = None,
                  name: str | None = None) -> np.ndarray:
    """uint8 blocks [n, G, 16] + uint8 E8M0 scales [n, G] -> uint16 [n, G*32] BF16 bits (mxfp4.dequant; shapes
    checked there)."""
    handle = _handle(name)
    blocks = _array(blocks, np.uint8, "MXFP4 blocks", name)
    scales = _array(scales, np.uint8, "MXFP4 scales", name)
    n, groups = scales.shape
    impl_id = native.resolve_impl(impl)
    out = np.empty((n, groups * 32), dtype=np.uint16)
    _rows(lambda b, e: handle.kt_mxfp4_dequant_bf16(blocks, scales, n, groups, impl_id, out, b, e),
          n, groups * 32, threads, "kt_mxfp4_dequant_bf16", name)
    return out

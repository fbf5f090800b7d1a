"""ctypes bindings of native/amx_mse.c: the ``--quant mse`` scale search (ktconvert/quant/mse.py) in C.

``mse_rows`` returns codes and scales (bit-identical to ktconvert.quant.mse.search_rows); ``amx_mse_quantize``
returns kt-kernel's tiled blob directly (identical to packing those codes with ktconvert.layouts.tiles).
Both raise NativeError when the library is missing or lacks these functions (a stale build).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from ktconvert import native
from ktconvert.errors import NativeError, ShapeError

if TYPE_CHECKING:
    import numpy as np

_P, _I64, _C_INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "kt_mse_rows": (_C_INT, [_P, _I64, _I64, _C_INT, _C_INT, _P, _P, _I64, _I64, _P]),
    "kt_amx_mse_quantize": (_C_INT, [_P, _I64, _I64, _C_INT, _C_INT, _P, _P, _I64, _I64, _P]),
}


def _lib() -> ctypes.CDLL:
    """The native library with this module's signatures set; NativeError when missing or stale."""
    if native.lib() is None:
        raise NativeError(native.load_error() or "native library not available")
    handle = native.bind(_SIGNATURES)
    if handle is None:
        raise NativeError("native library lacks the mse search",
                          hint="rebuild: pip install -e . --no-deps --no-build-isolation")
    return handle


def mse_available() -> bool:
    """True when native.available() and the loaded library has the mse functions."""
    if not native.available():
        return False
    try:
        _lib()
    except NativeError:
        return False
    return True


def _check(status_list: list[int], err_rows, w: np.ndarray, name: str | None, what: str) -> None:
    if any(s == native.KT_E_NONFINITE for s in status_list):
        rows = [int(r) for r, s in zip(err_rows, status_list) if s == native.KT_E_NONFINITE]
        native._raise_nonfinite(w, min(rows), name)
    bad = next((s for s in status_list if s != native.KT_OK), native.KT_OK)
    if bad != native.KT_OK:
        raise NativeError(f"{what} failed: {native._STATUS_TEXT.get(bad, 'status')} ({bad})", tensor=name,
                          found=f"[n, k] = {list(w.shape)}")


def _run_ranges(fn, ranges: list[tuple[int, int]], threads: int) -> tuple[list[int], np.ndarray]:
    """fn(i, begin, end, err_ptr) over the ranges, on the shared native pool; (statuses, err_rows)."""
    import numpy as np

    err_rows = np.full(len(ranges), -1, dtype=np.int64)

    def run(i: int) -> int:
        return fn(ranges[i][0], ranges[i][1], err_rows.ctypes.data + 8 * i)

    if len(ranges) == 1 or threads <= 1:
        return [run(i) for i in range(len(ranges))], err_rows
    futures = native._submit(run, range(1, len(ranges)), len(ranges) - 1)
    return [run(0)] + [f.result() for f in futures], err_rows


def mse_rows(w_bf16: np.ndarray, bits: int, threads: int = 1, impl: str | None = None,
             name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """uint16 [n, k] BF16 bits -> (codes int8 [n, k], d float32 [n]) of the mse search, in C.

    bits 4 (codes -7..7, w ~= codes * 16 * d) or 8 (codes -127..127); any n, k >= 1 with k <= 2**22.
    impl: None (automatic, KTCONVERT_FORCE_IMPL honoured) or "scalar" | "avx2" | "avx512". Threads split rows.
    """
    import numpy as np

    if bits not in (4, 8):
        raise ShapeError("unsupported AMX bit width", tensor=name, expected="4 or 8", found=bits)
    if not isinstance(w_bf16, np.ndarray) or w_bf16.dtype != np.uint16 or w_bf16.ndim != 2 or 0 in w_bf16.shape:
        raise ShapeError("weights must be BF16 bits", tensor=name, expected="uint16 [n, k], n, k >= 1",
                         found=f"{getattr(w_bf16, 'dtype', type(w_bf16).__name__)} "
                               f"{list(getattr(w_bf16, 'shape', ()))}")
    if w_bf16.shape[1] > 1 << 22:
        raise ShapeError("row too long for the mse scale search", tensor=name, expected="k <= 4194304",
                         found=w_bf16.shape[1])
    handle, impl_id = _lib(), native.resolve_impl(impl)
    w = np.ascontiguousarray(w_bf16)
    n, k = w.shape
    codes, scale = np.empty((n, k), np.int8), np.empty(n, np.float32)
    ranges = native._split(n, max(1, int(threads)))
    statuses, err_rows = _run_ranges(
        lambda b, e, err: handle.kt_mse_rows(w.ctypes.data, n, k, bits, impl_id, codes.ctypes.data,
                                             scale.ctypes.data, b, e, err), ranges, threads)
    _check(statuses, err_rows, w, name, "kt_mse_rows")
    return codes, scale


def amx_mse_quantize(w_bf16: np.ndarray, bits: int, threads: int = 1, impl: str | None = None,
                     name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """uint16 [n, k] BF16 bits -> (blob uint8 [n*k/2] or [n*k] in kt-kernel's tile order, scale float32 [n]):
    the mse search plus AMXINT4/AMXINT8 tile packing in C (same shape rules as native.amx_quantize)."""
    import numpy as np

    native._check_amx_input(w_bf16, bits, name)
    handle, impl_id = _lib(), native.resolve_impl(impl)
    w = np.ascontiguousarray(w_bf16)
    n, k = w.shape
    blob = np.empty(n * k // (2 if bits == 4 else 1), dtype=np.uint8)
    scale = np.empty(n, dtype=np.float32)
    ranges = native._split(int(handle.kt_amx_nblocks(n, bits)), max(1, int(threads)))
    statuses, err_rows = _run_ranges(
        lambda b, e, err: handle.kt_amx_mse_quantize(w.ctypes.data, n, k, bits, impl_id, blob.ctypes.data,
                                                     scale.ctypes.data, b, e, err), ranges, threads)
    _check(statuses, err_rows, w, name, "kt_amx_mse_quantize")
    return blob, scale

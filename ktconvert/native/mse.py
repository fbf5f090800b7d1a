"""ctypes bindings of native/amx_mse.c: the ``--quant mse`` scale search (ktconvert/quant/mse.py) in C.

``mse_rows`` returns codes and scales (bit-identical to ktconvert.quant.mse.search_rows); ``amx_mse_quantize``
returns kt-kernel's tiled blob directly (identical to packing those codes with ktconvert.layouts.tiles).
Both raise NativeError when the library is missing or lacks these functions (a stale build).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from ktconvert import native
from ktconvert.errors import ShapeError

if TYPE_CHECKING:
    import numpy as np

_I64, _INT = ctypes.c_int64, ctypes.c_int


def _signatures() -> dict:
    import numpy as np

    args = [native.array(np.uint16), _I64, _I64, _INT, _INT, None, native.out_array(np.float32), _I64, _I64,
            native.out_array(np.int64, nullable=True)]
    return {"kt_mse_rows": (_INT, args[:5] + [native.out_array(np.int8)] + args[6:]),
            "kt_amx_mse_quantize": (_INT, args[:5] + [native.out_array(np.uint8)] + args[6:])}


def _lib() -> ctypes.CDLL:
    """The native library with this module's signatures set; NativeError when missing or stale."""
    return native.bound_or_raise(_signatures, "the mse search")


def mse_available() -> bool:
    """True when native.available() and the loaded library has the mse functions."""
    return native.available() and native.bind(_signatures) is not None


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
    native.run_ranges(lambda b, e, err: handle.kt_mse_rows(w, n, k, bits, impl_id, codes, scale, b, e, err),
                      n, threads, what="kt_mse_rows", name=name, found=f"[n, k] = [{n}, {k}]", w_bf16=w)
    return codes, scale


def amx_mse_quantize(w_bf16: np.ndarray, bits: int, threads: int = 1, impl: str | None = None,
                     name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """uint16 [n, k] BF16 bits -> (blob uint8 [n*k/2] or [n*k] in kt-kernel's tile order, scale float32 [n]):
    the mse search plus AMXINT4/AMXINT8 tile packing in C (same shape rules as native.amx_quantize)."""
    import numpy as np

    native.check_amx_input(w_bf16, bits, name)
    handle, impl_id = _lib(), native.resolve_impl(impl)
    w = np.ascontiguousarray(w_bf16)
    n, k = w.shape
    blob = np.empty(n * k // (2 if bits == 4 else 1), dtype=np.uint8)
    scale = np.empty(n, dtype=np.float32)
    native.run_ranges(lambda b, e, err: handle.kt_amx_mse_quantize(w, n, k, bits, impl_id, blob, scale, b, e, err),
                      int(handle.kt_amx_nblocks(n, bits)), threads, what="kt_amx_mse_quantize", name=name,
                      found=f"[n, k] = [{n}, {k}]", w_bf16=w)
    return blob, scale

"""ctypes bindings of the native ggml dequantizers (native/kt_gguf.h, native/gguf_dequant.c).

Results are bit-identical to gguf-py's ``gguf.quants.dequantize`` (float32) and, for the BF16 variant, to
``ktconvert.quant.bf16.f32_to_bf16_bits`` of it. ``impl``: None (automatic, KTCONVERT_FORCE_IMPL honoured) or
"scalar" | "avx2" | "avx512". ``threads``: block ranges run on the shared native pool; bytes never depend on it.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ktconvert import native
from ktconvert.errors import NativeError, ShapeError

_I64, _INT = ctypes.c_int64, ctypes.c_int
MIN_BLOCKS_PER_THREAD = 256  # below this, threads cost more than they save


def _signatures() -> dict:
    blocks = native.array(np.uint8)
    return {
        "kt_gguf_block_elems": (_I64, [_INT]),
        "kt_gguf_block_bytes": (_I64, [_INT]),
        "kt_gguf_dequant_f32": (_INT, [_INT, _INT, blocks, _I64, native.out_array(np.float32)]),
        "kt_gguf_dequant_bf16": (_INT, [_INT, _INT, blocks, _I64, native.out_array(np.uint16)]),
    }


def gguf_lib() -> ctypes.CDLL | None:
    """The native library with the dequant signatures set; None when it is missing, disabled, or predates them."""
    return native.bind(_signatures) if native.available() else None


def usable_impls() -> list[str]:
    """The implementations ("scalar", "avx2", "avx512") that can run here; [] without the library."""
    return native.usable_impls() if gguf_lib() is not None else []


def supports(ggml_type: int) -> bool:
    """True when ggml type id `ggml_type` is dequantized natively here."""
    handle = gguf_lib()
    return handle is not None and handle.kt_gguf_block_elems(int(ggml_type)) > 0


def geometry(ggml_type: int) -> tuple[int, int]:
    """(elements, bytes) per block of a natively supported type; (0, 0) otherwise."""
    handle = gguf_lib()
    if handle is None:
        return 0, 0
    return int(handle.kt_gguf_block_elems(int(ggml_type))), int(handle.kt_gguf_block_bytes(int(ggml_type)))


def _run(fn_name: str, raw: np.ndarray, ggml_type: int, out_dtype, threads: int, impl: str | None,
         name: str | None) -> np.ndarray:
    handle = native.bound_or_raise(_signatures, "the native gguf dequantizer", name)
    elems, nbytes = int(handle.kt_gguf_block_elems(int(ggml_type))), int(handle.kt_gguf_block_bytes(int(ggml_type)))
    if elems == 0:
        raise NativeError(f"ggml type {ggml_type} has no native dequantizer", tensor=name)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size % nbytes:
        raise ShapeError("packed data is not a whole number of blocks", tensor=name,
                         expected=f"a multiple of {nbytes} bytes", found=f"{raw.size} bytes")
    nblocks = raw.size // nbytes
    out = np.empty(nblocks * elems, dtype=out_dtype)
    impl_id = native.resolve_impl(impl)
    fn = getattr(handle, fn_name)
    native.run_ranges(lambda b, e, _err: fn(int(ggml_type), impl_id, raw[b * nbytes:e * nbytes], e - b,
                                            out[b * elems:e * elems]),
                      nblocks, max(1, min(int(threads), nblocks // MIN_BLOCKS_PER_THREAD)), what=fn_name,
                      name=name, found=f"ggml type {ggml_type}")
    return out


def dequantize_f32(raw: np.ndarray, ggml_type: int, threads: int = 1, impl: str | None = None,
                   name: str | None = None) -> np.ndarray:
    """Packed blocks (uint8, a whole number of blocks) -> float32 [n_blocks * block_elems], flat."""
    return _run("kt_gguf_dequant_f32", raw, ggml_type, np.float32, threads, impl, name)


def dequantize_bf16(raw: np.ndarray, ggml_type: int, threads: int = 1, impl: str | None = None,
                    name: str | None = None) -> np.ndarray:
    """Packed blocks -> uint16 BF16 bits [n_blocks * block_elems], flat (RNE of the float32 values)."""
    return _run("kt_gguf_dequant_bf16", raw, ggml_type, np.uint16, threads, impl, name)

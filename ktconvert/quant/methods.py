"""CPU output methods (kt-kernel ``--kt-method`` values) by name: ``METHODS.get("int4") -> AmxInt4``.

Every method is a class with classmethods only and its geometry as class data. The AMX methods quantize
BF16 rows into a tiled blob + fp32 per-row scales; methods that kt-kernel reads in place from the original
checkpoint (BF16, RAWINT4, FP8, ...) register here too with ``needs_conversion = False`` (defined elsewhere).

Implementation choice for ``quantize``: the native library when ``ktconvert.native`` offers
``amx_quantize(w_bf16, bits, threads) -> (blob, scale)``, else numpy (quant/amx.py + layouts/tiles.py).
``KTCONVERT_FORCE_IMPL=numpy`` forces numpy. Both give identical bytes.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, ClassVar

import numpy as np

from ktconvert.errors import KtConvertError, NativeError, NumericError, ShapeError
from ktconvert.layouts import tiles
from ktconvert.quant import amx_rows as amx
from ktconvert.registry import Registry

METHODS: Registry = Registry("CPU method")

# Per-row quantizers for the AMX methods, picked by ``--quant``: name -> fn(w_bf16 uint16 [n, k], bits (4 | 8),
# where: str) -> (codes int8 [n, k] in -7..7 / -127..127, d float32 [n]) with w ~= codes * (16 if bits == 4 else 1)
# * d. "rtn" is kt-kernel's own rounding. Another variant "<name>" lives in ktconvert/quant/<name>.py and
# registers itself with ``@ROW_QUANT.register("<name>")``; row_quantizer() imports that module on first use.
# An entry may carry ``fn.quantize_packed(w_bf16, bits, threads=1, where="") -> (blob, scale) | None``: a fast
# path returning kt-kernel's tiled blob directly (None: not available here, use fn + numpy tiling).
ROW_QUANT: Registry = Registry("quantization")


class CpuMethod:
    """Base of every CPU method: names and shape rules as class data."""

    name: ClassVar[str] = ""
    kt_method: ClassVar[str] = ""            # value of kt-kernel's method= / sglang --kt-method
    file_prefix: ClassVar[str] = ""          # .kt file name prefix ("INT4" -> INT4_gate_0_..Byte_quant_.kt)
    needs_conversion: ClassVar[bool] = True  # False: kt-kernel reads the original checkpoint in place
    n_multiple: ClassVar[int] = 1
    k_multiple: ClassVar[int] = 1

    @classmethod
    def check_shape(cls, n: int, k: int, where: str = "") -> None:
        """ShapeError unless n % n_multiple == 0 and k % k_multiple == 0 (and both positive)."""
        if n <= 0 or k <= 0 or n % cls.n_multiple or k % cls.k_multiple:
            raise ShapeError(f"matrix shape incompatible with {cls.kt_method or cls.name}", tensor=where or None,
                             expected=f"[n, k] with n % {cls.n_multiple} == 0 and k % {cls.k_multiple} == 0",
                             found=f"[{n}, {k}]")


class AmxMethod(CpuMethod):
    """Per-row symmetric AMX quantization into kt-kernel's tiled BufferB blob (kt-format.md §2.0-2.2)."""

    bits: ClassVar[int] = 0
    n_block: ClassVar[int] = 0
    n_multiple: ClassVar[int] = tiles.N_STEP
    _quantize_rows: ClassVar[Callable]
    _dequantize_rows: ClassVar[Callable]
    _pack: ClassVar[Callable]
    _unpack: ClassVar[Callable]

    @classmethod
    def quant_bytes(cls, n: int, k: int) -> int:
        """Bytes of the quant blob (``_quant_`` file / ``.weight`` tensor) for one [n, k] matrix."""
        return n * k * cls.bits // 8

    @classmethod
    def scale_bytes(cls, n: int) -> int:
        """Bytes of the fp32 per-row scale blob (``_scale_`` file / ``.scale`` tensor)."""
        return 4 * n

    @classmethod
    def quantize(cls, w_bf16: np.ndarray, threads: int = 1, where: str = "",
                 quant: str = "rtn") -> tuple[np.ndarray, np.ndarray]:
        """uint16 [n, k] BF16 bits -> (blob uint8 [quant_bytes(n, k)], scale float32 [n]).

        quant: "rtn" (kt-kernel's own rounding, byte-identical to its converter; native when built) or another
        name registered in ROW_QUANT. ShapeError on a bad shape, NumericError on NaN/Inf; ``where`` names the
        tensor in both.
        """
        if not isinstance(w_bf16, np.ndarray) or w_bf16.ndim != 2:
            raise ShapeError("weights must be a 2-D array", tensor=where or None, expected="uint16 [n, k]",
                             found=f"{list(getattr(w_bf16, 'shape', ()))}")
        cls.check_shape(*w_bf16.shape, where=where)
        if quant != "rtn":
            return cls._quantize_variant(w_bf16, where, quant, threads)
        native = _native_quantizer()
        if native is not None and w_bf16.dtype == np.uint16:
            return cls._quantize_native(native, w_bf16, threads, where)
        codes, scale = cls._quantize_rows(w_bf16, where=where)
        return cls._pack(codes), scale

    @classmethod
    def _quantize_variant(cls, w_bf16: np.ndarray, where: str, quant: str,
                          threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        rows = row_quantizer(quant)
        packed = getattr(rows, "quantize_packed", None)   # optional native search + tiling in one step
        result = packed(w_bf16, cls.bits, threads=max(1, int(threads)), where=where) if packed else None
        if result is not None:
            n, k = w_bf16.shape
            blob, scale = np.asarray(result[0]).reshape(-1), np.asarray(result[1])
            if blob.dtype != np.uint8 or blob.size != cls.quant_bytes(n, k) or scale.dtype != np.float32 \
                    or scale.shape != (n,):
                raise NativeError(f"quantizer {quant!r} returned arrays of the wrong size", tensor=where or None,
                                  expected=f"uint8 [{cls.quant_bytes(n, k)}], float32 [{n}]",
                                  found=f"{blob.dtype} [{blob.size}], {scale.dtype} {list(scale.shape)}")
            return blob, scale
        codes, scale = rows(w_bf16, cls.bits, where)
        limit = 7 if cls.bits == 4 else 127
        n = w_bf16.shape[0]
        if codes.shape != w_bf16.shape or codes.dtype != np.int8 or np.asarray(scale).shape != (n,) \
                or (codes.size and (codes.min() < -limit or codes.max() > limit)):
            raise NumericError(f"quantizer {quant!r} returned invalid codes or scales", tensor=where or None,
                               expected=f"int8 {list(w_bf16.shape)} in -{limit}..{limit}, float32 [{n}]",
                               found=f"{codes.dtype} {list(codes.shape)} in {codes.min()}..{codes.max()}, "
                                     f"scale {list(np.asarray(scale).shape)}")
        return cls._pack(codes), np.asarray(scale, np.float32)

    @classmethod
    def _quantize_native(cls, native: Callable, w_bf16: np.ndarray, threads: int,
                         where: str) -> tuple[np.ndarray, np.ndarray]:
        n, k = w_bf16.shape
        try:
            blob, scale = native(np.ascontiguousarray(w_bf16), cls.bits, max(1, int(threads)))
        except KtConvertError:
            amx.bf16_rows_ftz(w_bf16, where)   # a NaN/Inf raises NumericError naming the tensor
            raise
        blob, scale = np.asarray(blob), np.asarray(scale)
        if blob.dtype != np.uint8 or blob.size != cls.quant_bytes(n, k) or scale.dtype != np.float32 \
                or scale.shape != (n,):
            raise NativeError("native amx_quantize returned arrays of the wrong size", tensor=where or None,
                              expected=f"uint8 [{cls.quant_bytes(n, k)}], float32 [{n}]",
                              found=f"{blob.dtype} [{blob.size}], {scale.dtype} {list(scale.shape)}")
        return blob.reshape(-1), scale

    @classmethod
    def dequantize(cls, blob: np.ndarray, scale: np.ndarray, n: int, k: int) -> np.ndarray:
        """(blob uint8 [quant_bytes(n, k)], scale float32 [n] or its raw bytes) -> float32 [n, k] weights as
        kt-kernel sees them."""
        cls.check_shape(n, k)
        scale = np.ascontiguousarray(scale).reshape(-1)
        if scale.dtype != np.float32:
            scale = scale.view(np.uint8).view(np.float32)     # raw little-endian bytes of a _scale_ file
        if scale.shape != (n,):
            raise ShapeError(f"{cls.kt_method} scale has the wrong size", expected=f"{n} fp32 values",
                             found=f"{scale.size}")
        return cls._dequantize_rows(cls._unpack(blob, n, k), scale)


@METHODS.register("amxint4", aliases=["int4", "AMXINT4", "amx-int4"])
class AmxInt4(AmxMethod):
    """AMXINT4: codes -7..7, stored scale d = amax/112 (w ~= code * 16 * d), N_BLOCK 128."""

    name, kt_method, file_prefix = "amxint4", "AMXINT4", "INT4"
    bits, n_block, k_multiple = 4, tiles.INT4_N_BLOCK, tiles.INT4_TILE_K
    _quantize_rows = staticmethod(amx.quantize_int4_rows)
    _dequantize_rows = staticmethod(amx.dequantize_int4_rows)
    _pack = staticmethod(tiles.pack_int4)
    _unpack = staticmethod(tiles.unpack_int4)


@METHODS.register("amxint8", aliases=["int8", "AMXINT8", "amx-int8"])
class AmxInt8(AmxMethod):
    """AMXINT8: codes -127..127, scale d = fp32(amax * fp32(1/127)) (w ~= code * d), N_BLOCK 64."""

    name, kt_method, file_prefix = "amxint8", "AMXINT8", "INT8"
    bits, n_block, k_multiple = 8, tiles.INT8_N_BLOCK, tiles.INT8_TILE_K
    _quantize_rows = staticmethod(amx.quantize_int8_rows)
    _dequantize_rows = staticmethod(amx.dequantize_int8_rows)
    _pack = staticmethod(tiles.pack_int8)
    _unpack = staticmethod(tiles.unpack_int8)


@ROW_QUANT.register("rtn")
def _rtn_rows(w_bf16: np.ndarray, bits: int, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """kt-kernel's round-to-nearest per-row quantization (quant/amx.py)."""
    return (amx.quantize_int4_rows if bits == 4 else amx.quantize_int8_rows)(w_bf16, where=where)


def row_quantizer(name: str) -> Callable:
    """ROW_QUANT[name], importing ktconvert.quant.<name> first when it is not registered yet."""
    if name not in ROW_QUANT:
        _import_optional("ktconvert.quant." + name.strip().lower().replace("-", "_"))
    return ROW_QUANT.get(name)


def _import_optional(module: str) -> None:
    """Import ``module`` if it exists; errors raised inside an existing module propagate."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise


def _native_quantizer() -> Callable | None:
    """ktconvert.native.amx_quantize if built and usable, else None (also when KTCONVERT_FORCE_IMPL=numpy)."""
    if os.environ.get("KTCONVERT_FORCE_IMPL", "").strip().lower() == "numpy":
        return None
    try:
        from ktconvert import native
    except ImportError:
        return None
    fn = getattr(native, "amx_quantize", None)
    available = getattr(native, "available", None)
    if not callable(fn) or (callable(available) and not available()):
        return None
    return fn


def quantize_impl() -> str:
    """"native" or "numpy": which path AmxMethod.quantize takes right now."""
    return "numpy" if _native_quantizer() is None else "native"


def _register_other_methods() -> None:
    """Import the modules that add methods to METHODS (the in-place BF16/RAWINT4/FP8 methods)."""
    for module in ("ktconvert.quant.inplace_methods",):
        _import_optional(module)


_register_other_methods()

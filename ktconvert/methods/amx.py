"""kt-kernel's converted CPU methods AMXINT4 / AMXINT8: per-row symmetric quantization into its tiled BufferB blob
+ fp32 per-row scales (kt-format.md §2.0-2.2), split into NUMA parts, written by ``formats.kt_sink.KtSink``.

Implementation choice for ``quantize``: the native library when it is built and usable, else numpy
(quant/amx_rows.py + layouts/tiles.py); ``KTCONVERT_FORCE_IMPL=numpy`` forces numpy. Both give identical bytes.
``--quant`` picks the per-row quantizer (``quant.row_quant.ROW_QUANT``: rtn = kt-kernel's own rounding, mse).
"""
from __future__ import annotations

import math
from typing import Callable, ClassVar

import numpy as np

from ktconvert import native
from ktconvert.errors import KtConvertError, NativeError, NumericError, ShapeError
from ktconvert.formats.kt_sink import KtSink
from ktconvert.formats.st_writer import tensor_nbytes
from ktconvert.layouts import tiles
from ktconvert.layouts.numa import numa_slices
from ktconvert.methods.base import METHODS, CpuMethod, TensorSpecs
from ktconvert.quant import amx_rows, mse  # noqa: F401  (mse registers the "mse" row quantizer)
from ktconvert.quant.row_quant import ROW_QUANT
from ktconvert.verification import numeric_amx, structure


class AmxMethod(CpuMethod):
    """Per-row symmetric AMX quantization into kt-kernel's tiled blob; verified by running the tiles."""

    bits: ClassVar[int] = 0
    n_block: ClassVar[int] = 0
    n_multiple: ClassVar[int] = tiles.N_STEP
    layouts: ClassVar[tuple[str, ...]] = ("safetensors", "kt")
    quants: ClassVar[tuple[str, ...]] = ("rtn", "mse", "gptq")
    rtn_bound: ClassVar[float] = 0.0   # |w_deq - w| <= rtn_bound * d for round-to-nearest (kt-format §2.1/2.2)
    _quantize_rows: ClassVar[Callable]
    _dequantize_rows: ClassVar[Callable]
    _pack: ClassVar[Callable]
    _unpack: ClassVar[Callable]

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        """The tiled blob (``.weight`` tensor / ``_quant_`` file, ``bits`` per weight) and the fp32 per-row scales
        (``.scale`` / ``_scale_``) of one [n, k] NUMA part."""
        return {"weight": ("I8", (n * k * cls.bits // 8,)), "scale": ("F32", (n,))}

    @classmethod
    def pack(cls, codes: np.ndarray) -> np.ndarray:
        """int8 codes [n, k] -> kt-kernel's tiled blob uint8 (layouts/tiles.py)."""
        return cls._pack(codes)

    @classmethod
    def quantize(cls, w_bf16: np.ndarray, threads: int = 1, where: str = "",
                 quant: str = "rtn") -> tuple[np.ndarray, np.ndarray]:
        """uint16 [n, k] BF16 bits -> (blob uint8, scale float32) of tensor_specs(n, k)'s sizes and shapes.

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
        if quantize_impl() == "native" and w_bf16.dtype == np.uint16:
            return cls._quantize_native(w_bf16, threads, where)
        codes, scale = cls._quantize_rows(w_bf16, where=where)
        return cls._pack(codes), scale

    @classmethod
    def _quantize_variant(cls, w_bf16: np.ndarray, where: str, quant: str,
                          threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        rows = ROW_QUANT.get(quant)
        packed = getattr(rows, "quantize_packed", None)   # optional native search + tiling in one step
        result = packed(w_bf16, cls.bits, threads=max(1, int(threads)), where=where) if packed else None
        specs = cls.tensor_specs(*w_bf16.shape)
        if result is not None:
            blob, scale = np.asarray(result[0]).reshape(-1), np.asarray(result[1])
            _check_native_result(blob, scale, specs, f"quantizer {quant!r}", where)
            return blob, scale
        codes, scale = rows(w_bf16, cls.bits, where)
        limit = 7 if cls.bits == 4 else 127
        if codes.shape != w_bf16.shape or codes.dtype != np.int8 or np.asarray(scale).shape != specs["scale"][1] \
                or (codes.size and (codes.min() < -limit or codes.max() > limit)):
            raise NumericError(f"quantizer {quant!r} returned invalid codes or scales", tensor=where or None,
                               expected=f"int8 {list(w_bf16.shape)} in -{limit}..{limit}, "
                                        f"float32 {list(specs['scale'][1])}",
                               found=f"{codes.dtype} {list(codes.shape)} in {codes.min()}..{codes.max()}, "
                                     f"scale {list(np.asarray(scale).shape)}")
        return cls._pack(codes), np.asarray(scale, np.float32)

    @classmethod
    def _quantize_native(cls, w_bf16: np.ndarray, threads: int, where: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            blob, scale = native.amx_quantize(w_bf16, cls.bits, max(1, int(threads)))   # a column slice in place
        except KtConvertError:
            amx_rows.bf16_rows_ftz(w_bf16, where)   # a NaN/Inf raises NumericError naming the tensor
            raise
        blob, scale = np.asarray(blob), np.asarray(scale)
        _check_native_result(blob, scale, cls.tensor_specs(*w_bf16.shape), "native amx_quantize", where)
        return blob.reshape(-1), scale

    @classmethod
    def dequantize(cls, blob: np.ndarray, scale: np.ndarray, n: int, k: int) -> np.ndarray:
        """(blob uint8, scale float32 or its raw bytes, as tensor_specs(n, k) declares them) -> float32 [n, k]
        weights as kt-kernel sees them."""
        cls.check_shape(n, k)
        shape = cls.tensor_specs(n, k)["scale"][1]
        scale = np.ascontiguousarray(scale).reshape(-1)
        if scale.dtype != np.float32:
            scale = scale.view(np.uint8).view(np.float32)     # raw little-endian bytes of a _scale_ file
        if scale.size != math.prod(shape):
            raise ShapeError(f"{cls.kt_method} scale has the wrong size", expected=f"{math.prod(shape)} fp32 values",
                             found=f"{scale.size}")
        return cls._dequantize_rows(cls._unpack(blob, n, k), scale.reshape(shape))

    # ---------------------------------------------------------------- writing and checking

    @classmethod
    def open_sink(cls, out_dir, layers, info, numa: int, layout: str, include_dense: bool) -> KtSink:
        return KtSink(out_dir, layout, cls, numa, layers, info.n_experts, info.hidden, info.intermediate,
                      include_dense=include_dense)

    @classmethod
    def write_matrix(cls, writer, proj: str, expert: int, w_bf16, *, numa: int, quant: str, where: str) -> None:
        """Split into NUMA parts (gate/up [I, H] by rows, down [H, I] by input columns), quantize and tile each."""
        rows = proj in ("gate", "up")
        for t, sl in enumerate(numa_slices(w_bf16.shape[0] if rows else w_bf16.shape[1], numa)):
            part = w_bf16[sl] if rows else w_bf16[:, sl]
            blob, scale = cls.quantize(part, threads=1, where=where, quant=quant)
            writer.put(proj, expert, t, blob, scale)

    @classmethod
    def check_structure(cls, folder, manifest: dict) -> tuple[list[str], str]:
        return structure.check_tiles(folder, manifest, cls)

    @classmethod
    def check_numerics(cls, out, manifest: dict, source, tokens: int, layers, experts, threshold,
                       folder=None) -> dict:
        return numeric_amx.check_numerics(out, manifest, source, tokens, layers, experts, threshold,
                                          folder=folder, methods=METHODS)

    @classmethod
    def expert_reader(cls, out, manifest: dict, folder=None):
        return numeric_amx.expert_reader(out, manifest, folder, methods=METHODS)


def _check_native_result(blob, scale, specs: TensorSpecs, what: str, where: str) -> None:
    """NativeError unless (blob, scale) are uint8 of the planned weight bytes and float32 of the planned scale shape."""
    nbytes, shape = tensor_nbytes(*specs["weight"]), specs["scale"][1]
    if blob.dtype != np.uint8 or blob.size != nbytes or scale.dtype != np.float32 or scale.shape != shape:
        raise NativeError(f"{what} returned arrays of the wrong size", tensor=where or None,
                          expected=f"uint8 [{nbytes}], float32 {list(shape)}",
                          found=f"{blob.dtype} [{blob.size}], {scale.dtype} {list(scale.shape)}")


class AmxInt4(AmxMethod):
    """AMXINT4: codes -7..7, stored scale d = amax/112 (w ~= code * 16 * d), N_BLOCK 128."""

    name, aliases, kt_method, file_prefix = "amxint4", ("int4", "amx-int4"), "AMXINT4", "INT4"
    default = True
    bits, n_block, k_multiple = 4, tiles.INT4_N_BLOCK, tiles.INT4_TILE_K
    rtn_bound = 8.5
    # MoE output against the source: honest RTN 0.44-0.63 rel L2 / cosine >= 0.83 on heavy-tailed weights,
    # garbage (tiles misread, experts swapped) 1.3-2.1 / cosine <= 0.15 (numeric_amx).
    thresholds = {"moe_rel_l2": 1.0, "moe_cosine": 0.5}
    _quantize_rows = staticmethod(amx_rows.quantize_int4_rows)
    _dequantize_rows = staticmethod(amx_rows.dequantize_int4_rows)
    _pack = staticmethod(tiles.pack_int4)
    _unpack = staticmethod(tiles.unpack_int4)


class AmxInt8(AmxMethod):
    """AMXINT8: codes -127..127, scale d = fp32(amax * fp32(1/127)) (w ~= code * d), N_BLOCK 64."""

    name, aliases, kt_method, file_prefix = "amxint8", ("int8", "amx-int8"), "AMXINT8", "INT8"
    bits, n_block, k_multiple = 8, tiles.INT8_N_BLOCK, tiles.INT8_TILE_K
    rtn_bound = 0.5
    thresholds = {"moe_rel_l2": 0.2, "moe_cosine": 0.97}   # honest AMXINT8: 0.03 / 0.9996
    _quantize_rows = staticmethod(amx_rows.quantize_int8_rows)
    _dequantize_rows = staticmethod(amx_rows.dequantize_int8_rows)
    _pack = staticmethod(tiles.pack_int8)
    _unpack = staticmethod(tiles.unpack_int8)


def quantize_impl() -> str:
    """"native" or "numpy": which path AmxMethod.quantize takes right now (KTCONVERT_FORCE_IMPL=numpy forces
    numpy, see ktconvert.native.available)."""
    return "native" if native.available() else "numpy"

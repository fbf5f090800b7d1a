"""kt-kernel methods that read an HF-layout checkpoint in place (kt-format.md §2.6-2.7): BF16, RAWINT4, FP8.

Registered in ``ktconvert.quant.methods.METHODS`` with ``needs_conversion = False``: ktconvert writes the experts
in the layout kt-kernel's loader reads (``formats/hf_sink.py``), one tensor set per expert matrix:

* ``bf16``    -> ``weight`` BF16 [n, k]                                           (BF16SafeTensorLoader)
* ``rawint4`` -> ``weight_packed`` I32 [n, k/8], ``weight_scale`` BF16 [n, k/gs], ``weight_shape`` I64 [2]:
                 compressed-tensors pack-quantized symmetric INT4, RTN exactly as llmcompressor W4A16
                 (CompressedSafeTensorLoader; group size from ``--group-size``, default 128)
* ``fp8``     -> ``weight`` F8_E4M3 [n, k], ``weight_scale_inv`` F32 [n/128, k/128]: DeepSeek block FP8,
                 s = amax/448 (FP8SafeTensorLoader; kt-kernel hard-codes 128x128 blocks)

The NUMA count does not change the files (kt-kernel slices in memory) but its alignment rules apply:
``check_layer(hidden, intermediate, numa)`` raises ShapeError before anything is written.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ktconvert.errors import ShapeError
from ktconvert.quant import ct_int4, fp8
from ktconvert.quant.methods import METHODS, CpuMethod

_DTYPE_BYTES = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "I32": 4, "I64": 8}
TensorSpecs = list[tuple[str, str, tuple[int, ...]]]   # (suffix, safetensors dtype, shape)


class InplaceMethod(CpuMethod):
    """A method whose output is HF tensors named ``<module>.<suffix>`` per expert matrix."""

    needs_conversion: ClassVar[bool] = False
    group_size: ClassVar[int | None] = None

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        """(suffix, dtype, shape) of every tensor one [n, k] matrix becomes."""
        raise NotImplementedError

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        """uint16 [n, k] BF16 bits -> {suffix: array} matching tensor_specs(n, k)."""
        raise NotImplementedError

    @classmethod
    def matrix_bytes(cls, n: int, k: int) -> int:
        """Data bytes of one [n, k] matrix's tensors (headers not counted)."""
        return sum(_DTYPE_BYTES[d] * int(np.prod(s)) for _, d, s in cls.tensor_specs(n, k))

    @classmethod
    def check_layer(cls, hidden: int, intermediate: int, numa: int = 1, where: str = "") -> None:
        """ShapeError unless kt-kernel can run [I, H] / [H, I] experts with `numa` parts (I split evenly)."""
        if hidden <= 0 or intermediate <= 0 or numa <= 0 or intermediate % numa:
            raise ShapeError(f"expert shape incompatible with {cls.kt_method}", tensor=where or None,
                             expected="positive H, I with I % numa == 0",
                             found=f"H={hidden}, I={intermediate}, numa={numa}")
        m = cls.k_multiple
        if m > 1 and (hidden % m or (intermediate // numa) % m):
            raise ShapeError(f"expert shape incompatible with {cls.kt_method}", tensor=where or None,
                             expected=f"H % {m} == 0 and (I / numa) % {m} == 0",
                             found=f"H={hidden}, I={intermediate}, numa={numa} (I/numa={intermediate // numa})")

    @classmethod
    def quantize(cls, w_bf16: np.ndarray, threads: int = 1, where: str = "", **_) -> tuple[np.ndarray, np.ndarray]:
        """Pipeline-compatible form of encode: (primary tensor, scale tensor or an empty array)."""
        out = cls.encode(w_bf16, where)
        specs = cls.tensor_specs(*w_bf16.shape)
        primary = out[specs[0][0]]
        scale = out[specs[1][0]] if len(specs) > 1 else np.zeros(0, np.float32)
        return primary, scale


@METHODS.register("bf16", aliases=["BF16"])
class Bf16Inplace(InplaceMethod):
    """BF16 experts as the hub stores them (per-expert ``weight``)."""

    name, kt_method, file_prefix = "bf16", "BF16", "BF16"

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return [("weight", "BF16", (n, k))]

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        return {"weight": np.ascontiguousarray(w_bf16, dtype=np.uint16)}


@METHODS.register("rawint4", aliases=["RAWINT4", "raw-int4"])
class RawInt4(InplaceMethod):
    """compressed-tensors pack-quantized symmetric INT4 with BF16 group scales (Kimi-K2 layout)."""

    name, kt_method, file_prefix = "rawint4", "RAWINT4", "RAWINT4"
    group_size: ClassVar[int] = 128
    GROUP_SIZES: ClassVar[tuple[int, ...]] = (32, 64, 128)

    @classmethod
    def with_group_size(cls, group_size: int) -> type["RawInt4"]:
        """This method with another group size (a subclass; the registered class keeps 128)."""
        if group_size not in cls.GROUP_SIZES:
            raise ShapeError("unsupported RAWINT4 group size", expected=" | ".join(map(str, cls.GROUP_SIZES)),
                             found=str(group_size))
        return type(f"RawInt4G{group_size}", (cls,), {"group_size": group_size, "k_multiple": group_size})

    k_multiple: ClassVar[int] = 128

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return [("weight_packed", "I32", (n, ct_int4.packed_cols(k, 4))),
                ("weight_scale", "BF16", (n, k // cls.group_size)), ("weight_shape", "I64", (2,))]

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        q, scale = ct_int4.quantize_sym_groups(w_bf16, cls.group_size, 4, where)
        return {"weight_packed": ct_int4.pack_int32(q, 4, where), "weight_scale": scale,
                "weight_shape": np.array(w_bf16.shape, dtype=np.int64)}


@METHODS.register("fp8", aliases=["FP8", "fp8-block"])
class Fp8Inplace(InplaceMethod):
    """DeepSeek-convention 128x128 block FP8 with F32 ``weight_scale_inv``."""

    name, kt_method, file_prefix = "fp8", "FP8", "FP8"
    block: ClassVar[tuple[int, int]] = (128, 128)
    k_multiple: ClassVar[int] = 128

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return [("weight", "F8_E4M3", (n, k)), ("weight_scale_inv", "F32", fp8.block_scale_shape(n, k, cls.block))]

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        codes, scale_inv = fp8.quantize_block(w_bf16, cls.block, where)
        return {"weight": codes, "weight_scale_inv": scale_inv}

    @classmethod
    def quantization_config(cls) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(cls.block),
                "activation_scheme": "dynamic"}

"""kt-kernel methods that read an HF-layout checkpoint in place (kt-format.md §2.6-2.7): BF16, RAWINT4, FP8
(LLAMAFILE, GGUF experts: ``methods.llamafile``).

ktconvert writes BF16 / RAWINT4 / FP8 experts in the layout kt-kernel's loaders read (``formats/inplace_sink.py``),
one tensor set per expert matrix:

* ``bf16``    -> ``weight`` BF16 [n, k]                                           (BF16SafeTensorLoader)
* ``rawint4`` -> ``weight_packed`` I32 [n, k/8], ``weight_scale`` BF16 [n, k/gs], ``weight_shape`` I64 [2]:
                 compressed-tensors pack-quantized symmetric INT4, RTN exactly as llmcompressor W4A16
                 (CompressedSafeTensorLoader; group size 32, the only one kt-kernel 0.7.2 runs)
* ``fp8``     -> ``weight`` F8_E4M3 [n, k], ``weight_scale_inv`` F32 [n/128, k/128]: DeepSeek block FP8,
                 s = amax/448 (FP8SafeTensorLoader; kt-kernel hard-codes 128x128 blocks)

The NUMA count does not change the files (kt-kernel slices in memory) but its alignment rules apply.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ktconvert.formats.inplace_sink import InplaceSink
from ktconvert.methods.base import CpuMethod, TensorSpecs, check
from ktconvert.quant import ct_int4, fp8
from ktconvert.verification import numeric_inplace, structure

RAWINT4_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


class InplaceMethod(CpuMethod):
    """A method whose output is HF tensors named ``<module>.<suffix>`` per expert matrix; verified by decoding
    them with the input decoders."""

    needs_conversion: ClassVar[bool] = False
    stored_aliases: ClassVar[dict[str, str]] = {}   # source tensor suffix -> output suffix of the same bytes

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        """uint16 [n, k] BF16 bits -> {suffix: array} matching tensor_specs(n, k)."""
        raise NotImplementedError

    @classmethod
    def part_checks(cls, hidden: int, part: int) -> list[dict]:
        """Whole blocks / groups along k of every matrix kt-kernel slices: H (gate/up) and I/T (down)."""
        m = cls.k_multiple
        if m <= 1:
            return []
        what = "128-blocks" if cls.group_size is None else "groups"
        return [check(f"H % {m} == 0 (whole {what} along k of gate/up)", hidden % m == 0, f"H = {hidden}"),
                check(f"I/T % {m} == 0 (whole {what} per NUMA part of down)", part % m == 0, f"I/T = {part}")]

    @classmethod
    def reads_as_is(cls, source) -> str | None:
        if not source.kt_native_names():
            return None
        return cls._reads_experts(source)

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        """Whether kt-kernel's loader for this method reads the source's routed experts as stored."""
        return None

    @classmethod
    def carry_over(cls, source, layers) -> str | None:
        """The source's format (kt-kernel's loader reads it as this method) and every routed expert matrix of
        `layers` stored per expert as exactly this method's tensors (dtype and shape, headers only)."""
        what = cls._reads_experts(source)
        if not what:
            return None
        I, H = source.info.intermediate, source.info.hidden
        dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        for layer in layers:
            for e in range(source.info.n_experts):
                stored = source.stored_specs(layer, e)
                if stored is None or any(cls._renamed(stored[p], *dims[p]) is None for p in dims):
                    return None
        return what

    @classmethod
    def _renamed(cls, stored: dict, n: int, k: int) -> dict[str, str] | None:
        """{source suffix: output suffix} when `stored` ({suffix: (dtype, shape)}) are exactly tensor_specs(n, k)."""
        want = {suffix: (dtype, tuple(shape)) for suffix, (dtype, shape) in cls.tensor_specs(n, k).items()}
        names = {suffix: cls.stored_aliases.get(suffix, suffix) for suffix in stored}
        if sorted(names.values()) != sorted(want) or any(stored[s] != want[o] for s, o in names.items()):
            return None
        return names

    @classmethod
    def carried(cls, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A stored matrix's tensors ({suffix: array} as the source holds them) under this method's suffixes
        (carry_over checked their dtypes and shapes from the headers; the shard writer checks both again)."""
        return {cls.stored_aliases.get(suffix, suffix): array for suffix, array in arrays.items()}

    @classmethod
    def open_sink(cls, out_dir, layers, info, numa: int, layout: str, include_dense: bool) -> InplaceSink:
        return InplaceSink(out_dir, cls, layers, info.n_experts, info.hidden, info.intermediate, numa=numa)

    @classmethod
    def write_matrix(cls, writer, proj: str, expert: int, w_bf16, *, numa: int, quant: str, where: str) -> None:
        """Encoded whole: kt-kernel slices the NUMA parts in memory."""
        writer.put_matrix(proj, expert, w_bf16)

    @classmethod
    def check_structure(cls, folder, manifest: dict) -> tuple[list[str], str]:
        return structure.check_hf_tensors(folder, manifest, cls)

    @classmethod
    def check_numerics(cls, out, manifest: dict, source, tokens: int, layers, experts, threshold,
                       folder=None) -> dict:
        return numeric_inplace.check_inplace_numerics(out, manifest, source, tokens, layers, experts, threshold,
                                                      folder=folder, method=cls)

    @classmethod
    def expert_reader(cls, out, manifest: dict, folder=None):
        return numeric_inplace.expert_reader(out, manifest, folder, method=cls)


class Bf16Inplace(InplaceMethod):
    """BF16 experts as the hub stores them (per-expert ``weight``)."""

    name, kt_method, file_prefix = "bf16", "BF16", "BF16"
    thresholds = {"moe_rel_l2": 0.0}   # a copy of the source

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return {"weight": ("BF16", (n, k))}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        return {"weight": np.ascontiguousarray(w_bf16, dtype=np.uint16)}

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        return "BF16 experts" if source.input_format == "bf16" else None


class RawInt4(InplaceMethod):
    """compressed-tensors pack-quantized symmetric INT4 with BF16 group scales (Kimi-K2 layout)."""

    name, aliases, kt_method, file_prefix = "rawint4", ("raw-int4",), "RAWINT4", "RAWINT4"
    needs_amx = True                   # kt-kernel 0.7.2: NaN on AVX-512 without AMX (ecosystem-notes "Measured later")
    # kt-kernel 0.7.2 runs RAWINT4 (the Kimi-K2 format) at group 32 only: measured on an AMX host, its forward on
    # g64 files is off by rel L2 4.19 and on g128 files NaN / 1e17-1e29, on llmcompressor's own W4A16 files too
    group_sizes: ClassVar[tuple[int, ...]] = (32,)
    group_size: ClassVar[int] = 32
    group_size_limit: ClassVar[str] = ("kt-kernel 0.7.2's RAWINT4 backend runs group size 32 only (at 64 and 128 "
                                       "its forward returns garbage or NaN, measured)")
    k_multiple: ClassVar[int] = 32
    thresholds = {"moe_rel_l2": 0.6}   # group-wise INT4, measured 0.34 (g64) on the tiny heavy-tailed models

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return {"weight_packed": ("I32", (n, ct_int4.packed_cols(k, 4))),
                "weight_scale": ("BF16", (n, k // cls.group_size)), "weight_shape": ("I64", (2,))}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        q, scale = ct_int4.quantize_sym_groups(w_bf16, cls.group_size, 4, where)
        return {"weight_packed": ct_int4.pack_int32(q, 4, where), "weight_scale": scale,
                "weight_shape": np.array(w_bf16.shape, dtype=np.int64)}

    @classmethod
    def quantization_config(cls) -> dict:
        """Symmetric INT4 pack-quantized, as llmcompressor 0.14 writes it, targeting the routed experts."""
        return ct_int4.pack_quantized_config(cls.group_size, [RAWINT4_TARGET], ["lm_head"])

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        group = source.expert_quantization()
        if group is not None and group.fmt == "pack-quantized" and group.num_bits == 4 and group.symmetric \
                and group.strategy == "group" and not _has_group_index(source):
            return "compressed-tensors pack-quantized symmetric int4 (group) experts"
        return None


def _has_group_index(source) -> bool:
    """Whether the checkpoint stores ``weight_g_idx`` (activation order "group"): kt-kernel's RAWINT4 loader reads
    weight_packed / weight_scale in column order only, so such experts must be converted."""
    return any(name.endswith(".weight_g_idx") for name in source.tensor_names())


class Fp8Inplace(InplaceMethod):
    """DeepSeek-convention 128x128 block FP8 with F32 ``weight_scale_inv``."""

    name, aliases, kt_method, file_prefix = "fp8", ("fp8-block",), "FP8", "FP8"
    block: ClassVar[tuple[int, int]] = (128, 128)
    k_multiple: ClassVar[int] = 128
    stored_aliases = {"weight_scale": "weight_scale_inv"}   # compressed-tensors' block scale: the same multiplier
    thresholds = {"moe_rel_l2": 0.1}   # block FP8, measured 0.045 on the tiny heavy-tailed models

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale_inv": ("F32", fp8.block_scale_shape(n, k, cls.block))}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        codes, scale_inv = fp8.quantize_block(w_bf16, cls.block, where)
        return {"weight": codes, "weight_scale_inv": scale_inv}

    @classmethod
    def quantization_config(cls) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(cls.block),
                "activation_scheme": "dynamic"}

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        group = source.expert_quantization()
        if group is not None and group.fmt in ("fp8-block", "float-quantized") and group.strategy == "block" \
                and tuple(group.block or ()) == cls.block:
            return "FP8 e4m3 experts with 128x128 block scales"
        return None


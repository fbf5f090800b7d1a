"""FP4 (E2M1) weights in 16- or 32-element groups, and ModelOpt's ``quant_method: modelopt`` configs.

* ModelOpt NVFP4 (``quant_algo: NVFP4``): ``W.weight`` U8 [n, k/2] (two E2M1 per byte, low nibble first) +
  ``W.weight_scale`` F8_E4M3 [n, k/16] + ``W.weight_scale_2`` F32 (0-d or [1]): W = e2m1 * (e4m3 * ws2).
* compressed-tensors ``nvfp4-pack-quantized``: ``W.weight_packed`` U8 [n, k/2] + ``W.weight_scale`` F8_E4M3
  [n, k/16] + ``W.weight_global_scale`` F32 [1], the reciprocal of ModelOpt's: W = e2m1 * (e4m3 / gs), as
  compressed-tensors' NVFP4PackedCompressor decompresses.
* compressed-tensors ``mxfp4-pack-quantized``: ``W.weight_packed`` U8 [n, k/2] + ``W.weight_scale`` U8 E8M0
  [n, k/32]: W = e2m1 * 2^(e - 127).
Block scales are float32; products float32, RNE to BF16 (``ktconvert.quant.nvfp4``). Fused experts add a leading
[E] axis to every tensor (a [E] / [E, 1] per-tensor scale holds one value per expert). ``input_scale`` /
``input_global_scale`` are activation scales: the matrix's tensors, not read.

``quant_method: modelopt`` picks by ``quant_algo`` (top level, or under ``quantization``): NVFP4 here, MXFP8 and
FP8 (per-tensor) in ``fp8_scaled``; ``ignore`` / ``exclude_modules`` are fnmatch patterns.
"""
from __future__ import annotations

import fnmatch

import numpy as np

from ktconvert.formats.decoders.base import (FLOAT_DTYPES, Decoder, MatrixRefs, QuantGroup, QuantScheme, bad_config,
                                             float_values, matrix_shape, per_expert_shape, read_partner, shape_error,
                                             tensor_ref)
from ktconvert.formats.decoders.fp8_scaled import mx_group
from ktconvert.quant import nvfp4
from ktconvert.quant.fp8 import E4M3_TO_F32
from ktconvert.quant.mxfp4 import e8m0_to_f32

NV_GROUP, MX_GROUP = 16, 32


class NvFp4Decoder(Decoder):
    """ModelOpt NVFP4: ``weight`` + ``weight_scale`` (E4M3) + ``weight_scale_2`` (multiplier)."""

    scheme = "nvfp4"
    names = {"packed": "weight", "scale": "weight_scale", "global": "weight_scale_2"}
    activation = "input_scale"
    global_divides = False

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return "nvfp4"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        p = tensor_ref(checkpoint, f"{base}.{cls.names['packed']}")
        s = tensor_ref(checkpoint, f"{base}.{cls.names['scale']}")
        gs = group.group_size or NV_GROUP
        if p.dtype != "U8":
            raise shape_error(p, "FP4 weight has the wrong dtype", "U8 (two E2M1 values per byte)", p.dtype)
        e8m0 = gs == MX_GROUP
        if s.dtype not in (("U8", "F8_E8M0") if e8m0 else ("F8_E4M3",)):
            raise shape_error(s, "FP4 block scale has the wrong dtype", "U8 (E8M0)" if e8m0 else "F8_E4M3", s.dtype)
        n, half = matrix_shape(p, expert)
        k = 2 * half
        want = (n, -(-k // gs))
        if tuple(per_expert_shape(s, expert)) != want:
            raise shape_error(s, f"block scales do not match FP4 weight [{n}, {half}] (k = {k}) in groups of {gs}",
                              str(list(want)), str(list(s.shape)))
        partners = {"scale": s.name}
        if not e8m0:
            g = tensor_ref(checkpoint, f"{base}.{cls.names['global']}")
            count = int(np.prod(g.shape))
            if g.dtype not in FLOAT_DTYPES or count not in (1, p.shape[0] if expert is not None else 1):
                raise shape_error(g, f"{cls.names['global']} is not one float per tensor",
                                  "F32 [] or [1] ([E] when fused)", f"{g.dtype} {list(g.shape)}")
            partners["global"] = g.name
        if f"{base}.{cls.activation}" in checkpoint.tensors:
            partners["unused"] = f"{base}.{cls.activation}"
        return MatrixRefs(group.fmt, p.name, partners, expert, (n, k), group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out"      # groups along in-features

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        gs = refs.group.group_size or NV_GROUP
        raw = np.asarray(read_partner(checkpoint, refs.partners["scale"], refs.index0)).view(np.uint8)
        if gs == MX_GROUP:
            scale = e8m0_to_f32(raw)
        else:
            g_ref = checkpoint.tensors[refs.partners["global"]]
            g = float_values(np.asarray(checkpoint.read(g_ref.name)), g_ref.dtype).reshape(-1)
            g = np.float32(g[refs.index0] if g.size > 1 else g[0])
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                scale = E4M3_TO_F32[raw] / g if cls.global_divides else E4M3_TO_F32[raw] * g
        return nvfp4.dequant(np.asarray(data).view(np.uint8), scale, gs, where)


class CtNvFp4Decoder(NvFp4Decoder):
    """compressed-tensors nvfp4-pack-quantized: ``weight_packed`` + ``weight_scale`` + ``weight_global_scale``
    (divisor)."""

    scheme, ct_format = "nvfp4-pack-quantized", "nvfp4-pack-quantized"
    ct_description = "nvfp4-pack-quantized 4-bit float (group 16)"
    primary_suffixes = (".weight_packed",)
    names = {"packed": "weight_packed", "scale": "weight_scale", "global": "weight_global_scale"}
    activation = "input_global_scale"
    global_divides = True
    group_size = NV_GROUP

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return "ct-nvfp4" if cls.group_size == NV_GROUP else "ct-mxfp4"

    @classmethod
    def parse_ct_group(cls, name: str, group: dict, weights: dict) -> QuantGroup | None:
        if str(weights.get("type", "int")).lower() != "float" or int(weights.get("num_bits", 8)) != 4 \
                or weights.get("group_size") != cls.group_size:
            return None
        return QuantGroup(cls.scheme, tuple(group.get("targets") or ("Linear",)), 4, "group",
                          group_size=cls.group_size)


class CtMxFp4Decoder(CtNvFp4Decoder):
    """compressed-tensors mxfp4-pack-quantized: ``weight_packed`` + ``weight_scale`` (E8M0 per 32)."""

    scheme, ct_format = "mxfp4-pack-quantized", "mxfp4-pack-quantized"
    ct_description = "mxfp4-pack-quantized 4-bit float (group 32)"
    group_size = MX_GROUP


class ModelOptDecoder(Decoder):
    """``quant_method: modelopt``: the groups of its ``quant_algo`` (NVFP4 / MXFP8 / FP8), read by their decoders."""

    scheme, quant_method = "modelopt", "modelopt"

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
        algo = str(qc.get("quant_algo") or inner.get("quant_algo") or "").upper()
        patterns = qc.get("ignore") or qc.get("exclude_modules") or inner.get("exclude_modules") or ()
        ignore = tuple("re:" + fnmatch.translate(str(p)) for p in patterns)
        if algo == "NVFP4":
            gs = qc.get("group_size", inner.get("group_size", NV_GROUP))
            if gs != NV_GROUP:
                raise bad_config("unsupported NVFP4 group_size", expected=str(NV_GROUP), found=repr(gs))
            return QuantScheme("modelopt", "nvfp4", (QuantGroup("nvfp4", num_bits=4, strategy="group",
                                                                group_size=NV_GROUP),), ignore)
        if algo == "MXFP8":
            return QuantScheme("modelopt", "mxfp8", (mx_group(),), ignore)
        if algo == "FP8":
            return QuantScheme("modelopt", "fp8-tensor", (QuantGroup("fp8-scaled", strategy="tensor"),), ignore)
        raise bad_config("unsupported ModelOpt quant_algo", expected="NVFP4, MXFP8 or FP8",
                         found=repr(qc.get("quant_algo") or inner.get("quant_algo")))

"""FP8 (e4m3) weights without DeepSeek blocks:

* per-channel / per-tensor: ``W.weight`` F8_E4M3 [n, k] + ``W.weight_scale`` [n], [n, 1] (one scale per output
  row) or [] / [1] (one per tensor), F32 / BF16 / F16: ``quant_method: fp8`` without ``weight_block_size`` (vLLM's
  serialized FP8), ``quant_method: fbgemm_fp8`` (transformers, per-channel) and ModelOpt ``quant_algo: FP8``. The
  strategy is read from each scale's shape. W = e4m3 * s[row], float32 product, RNE to BF16; ``input_scale`` /
  ``input_scale_ub`` are activation scales, carried along as the matrix's tensors but not read.
* MXFP8 (MiniMax ``quant_method: mxfp8``, ModelOpt ``quant_algo: MXFP8``, compressed-tensors
  ``mxfp8-quantized``, or ``quant_method: fp8`` whose scales are bytes): ``W.weight`` F8_E4M3 [n, k] +
  ``W.weight_scale_inv`` (or ``weight_scale``) U8 / F8_E8M0 [n, ceil(k/32)] E8M0 exponents: despite the
  ``_inv`` name the scale multiplies, W = e4m3 * 2^(e - 127) (e = 255 is NaN, OCP MX)."""
from __future__ import annotations

import dataclasses

import numpy as np

from ktconvert.formats.decoders.base import (FLOAT_DTYPES, Decoder, MatrixRefs, QuantGroup, QuantScheme, bad_config,
                                             matrix_shape, per_expert_shape, read_partner, shape_error)
from ktconvert.formats.decoders.fp8 import Fp8BlockDecoder, fp8_refs
from ktconvert.formats.decoders.gptq import hf_ignore
from ktconvert.quant import fp8
from ktconvert.quant.mxfp4 import e8m0_to_f32

MX_BLOCK = 32
BYTE_SCALES = ("U8", "F8_E8M0")
ACTIVATION_SCALES = ("input_scale", "input_scale_ub")


def _unused(checkpoint, weight_name: str) -> dict:
    """{"unused_<x>": name} of the activation scales stored next to a weight (not read, still its tensors)."""
    module = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return {f"unused_{s}": f"{module}.{s}" for s in ACTIVATION_SCALES if f"{module}.{s}" in checkpoint.tensors}


class Fp8ScaledDecoder(Fp8BlockDecoder):
    """Per-channel or per-tensor FP8, the strategy read from each scale tensor's shape."""

    scheme, quant_method, ct_format = "fp8-scaled", None, None
    scale_suffixes = ("_scale", "_scale_inv")

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        raise NotImplementedError      # reached through quant_method fp8 / fbgemm_fp8 / modelopt

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        w, s = fp8_refs(checkpoint, base, expert, cls.scale_suffixes)
        if s.dtype in BYTE_SCALES:
            return Mxfp8Decoder.locate(checkpoint, base, dataclasses.replace(group, fmt="mxfp8"), expert)
        if s.dtype not in FLOAT_DTYPES:
            raise shape_error(s, "FP8 scale has the wrong dtype", "F32, BF16 or F16", s.dtype)
        n, k = matrix_shape(w, expert)
        s_shape = tuple(per_expert_shape(s, expert)) if expert is not None and len(s.shape) >= 2 else tuple(s.shape)
        if int(np.prod(s_shape)) == 1 and len(s_shape) <= 2:
            strategy = "tensor"
        elif s_shape in ((n,), (n, 1)):
            strategy = "channel"
        else:
            raise shape_error(s, f"scale of FP8 weight [{n}, {k}] is neither per-channel nor per-tensor",
                              f"[{n}], [{n}, 1] or [1]", str(list(s.shape)))
        partners = {"scale": s.name, **_unused(checkpoint, w.name)}
        return MatrixRefs(cls.scheme, w.name, partners, expert, (n, k),
                          dataclasses.replace(group, strategy=strategy, block=None))

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return f"fp8-{group.strategy}" if group is not None and group.strategy in ("channel", "tensor") \
            else "fp8-scaled"

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        s_ref = checkpoint.tensors[refs.partners["scale"]]
        if refs.group.strategy == "tensor" and refs.index0 is not None and len(s_ref.shape) < 2:
            refs = dataclasses.replace(refs, index0=None)       # one scale shared by every expert
        return super().decode(checkpoint, refs, data, where)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out" if refs.group is not None and refs.group.strategy == "channel" else None


class FbgemmFp8Decoder(Fp8ScaledDecoder):
    """transformers' ``quant_method: fbgemm_fp8``: per-channel ``weight_scale`` [n, 1] F32."""

    scheme, quant_method = "fbgemm-fp8", "fbgemm_fp8"

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        ignore = tuple(hf_ignore(qc.get("modules_to_not_convert")))
        return QuantScheme("fbgemm_fp8", "fp8-channel", (QuantGroup("fp8-scaled", strategy="channel"),), ignore)


class Mxfp8Decoder(Decoder):
    """FP8 codes with one E8M0 exponent per 32 in-features."""

    scheme, quant_method, ct_format = "mxfp8", "mxfp8", "mxfp8-quantized"
    ct_description = "mxfp8-quantized 8-bit float (group 32)"

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        block = qc.get("weight_block_size", [1, MX_BLOCK])
        if list(block) != [1, MX_BLOCK] or int(qc.get("group_size", MX_BLOCK)) != MX_BLOCK:
            raise bad_config("unsupported MXFP8 block", expected=f"[1, {MX_BLOCK}]", found=repr(block))
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or qc.get("ignore") or ())
        return QuantScheme(str(qc.get("quant_method")), "mxfp8", (mx_group(),), ignore)

    @classmethod
    def parse_ct_group(cls, name: str, group: dict, weights: dict) -> QuantGroup | None:
        if str(weights.get("type", "int")).lower() != "float" or int(weights.get("num_bits", 8)) != 8 \
                or weights.get("group_size") != MX_BLOCK:
            return None
        return mx_group(tuple(group.get("targets") or ("Linear",)))

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return "mxfp8"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        w, s = fp8_refs(checkpoint, base, expert, ("_scale_inv", "_scale"))
        if s.dtype not in BYTE_SCALES:
            raise shape_error(s, "MXFP8 scale has the wrong dtype", "U8 or F8_E8M0 (E8M0 exponents)", s.dtype)
        n, k = matrix_shape(w, expert)
        want = fp8.block_scale_shape(n, k, (1, MX_BLOCK))
        if tuple(per_expert_shape(s, expert)) != want:
            raise shape_error(s, f"MXFP8 scale does not match weight [{n}, {k}] in groups of {MX_BLOCK}",
                              str(list(want)), str(list(s.shape)))
        partners = {"scale": s.name, **_unused(checkpoint, w.name)}
        return MatrixRefs(cls.scheme, w.name, partners, expert, (n, k), group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out"      # 32-element groups along in-features

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        exps = np.asarray(read_partner(checkpoint, refs.partners["scale"], refs.index0)).view(np.uint8)
        return fp8.dequant_block(data, e8m0_to_f32(exps), (1, MX_BLOCK), where=where)


def mx_group(targets: tuple[str, ...] = ("Linear",)) -> QuantGroup:
    return QuantGroup("mxfp8", targets, 8, "group", block=(1, MX_BLOCK), group_size=MX_BLOCK)

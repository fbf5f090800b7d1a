"""DeepSeek-V4 checkpoints (DeepSeek-V4-Flash): FP4 routed experts, block-FP8 linears, names without ``model.``.

config.json says ``expert_dtype: "fp4"`` next to ``quantization_config`` ``{quant_method: fp8, fmt: e4m3,
scale_fmt: ue8m0, weight_block_size: [128, 128]}``; every quantized matrix is ``W.weight`` + ``W.scale``:

* routed experts ``layers.L.ffn.experts.E.{w1,w3,w2}`` (gate, up, down): ``weight`` I8 (or U8) [n, k/2], E2M1
  codes, element 2j in the low nibble of byte j (bit 3 of a code the sign); ``scale`` F8_E8M0 (or U8) [n, k/32]:
  W = e2m1 * 2^(e - 127) (exact in BF16: ``quant.mxfp4``);
* the other linears: ``weight`` F8_E4M3 [n, k] with ``scale`` F8_E8M0 (ue8m0) or float [ceil(n/128),
  ceil(k/128)]: W = e4m3 * scale per 128x128 block, float32 product, RNE to BF16 (``quant.fp8``).

Picked by ``claims`` before any quant_method: ``quant_method: fp8`` with a top-level ``expert_dtype`` or
``model_type: deepseek_v4``, or ``expert_dtype: fp4`` inside quantization_config (ktconvert's ``mxfp4`` output, whose
tensors kt-kernel's MXFP4 method reads as DeepSeek-V4's, methods/mxfp4.py). An FP8 matrix stored without ``.scale``
is DeepSeek-V3's block FP8 (``weight_scale_inv``, the ``fp8`` method's output of such a source), read by ``fp8``.
"""
from __future__ import annotations

import numpy as np

from ktconvert.formats.decoders.base import (DECODERS, FLOAT_DTYPES, Decoder, MatrixRefs, QuantGroup, QuantScheme,
                                             bad_config, float_values, matrix_shape, per_expert_shape,
                                             quantization_config_of, read_partner, shape_error, tensor_ref)
from ktconvert.quant import fp8, mxfp4

FP4_GROUP = 32
FP8_BLOCK = (128, 128)
FP4_DTYPES, E8M0_DTYPES = ("I8", "U8"), ("F8_E8M0", "U8")


class DeepseekV4Decoder(Decoder):
    """``W.weight`` + ``W.scale``: E2M1 pairs with E8M0 exponents per 32 (experts), or block FP8 (linears)."""

    scheme = "deepseek-v4"

    @classmethod
    def claims(cls, config: dict) -> bool:
        """ktconvert's mxfp4 output (``expert_dtype: "fp4"`` in its quantization_config), or DeepSeek-V4's own
        ``quant_method: fp8`` (config.json's top-level ``expert_dtype``, or ``model_type: deepseek_v4``). An output
        of another method written from a DeepSeek-V4 source keeps the top-level keys but has its own quant_method."""
        qc = quantization_config_of(config)
        if not isinstance(qc, dict):
            return False
        if str(qc.get("expert_dtype", "")).lower() == "fp4":
            return True
        v4 = config.get("expert_dtype") is not None or config.get("model_type") == "deepseek_v4"
        return v4 and str(qc.get("quant_method", "")).lower() == "fp8"

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        block = qc.get("weight_block_size") or list(FP8_BLOCK)
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(type(v) is int and v > 0
                                                                             for v in block)):
            raise bad_config("bad weight_block_size", expected="[block_n, block_k] positive ints", found=repr(block))
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        group = QuantGroup(cls.scheme, num_bits=4, strategy="group", block=tuple(block), group_size=FP4_GROUP)
        return QuantScheme(str(qc.get("quant_method", "fp8")), "mxfp4", (group,), ignore)

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return "fp8-block" if dtype == "F8_E4M3" else "mxfp4"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        w = tensor_ref(checkpoint, f"{base}.weight")
        if f"{base}.scale" not in checkpoint.tensors and w.dtype == "F8_E4M3":     # DeepSeek-V3's names
            fp8_group = QuantGroup("fp8-block", group.targets, block=group.block or FP8_BLOCK)
            return DECODERS.get("fp8-block").locate(checkpoint, base, fp8_group, expert)
        s = tensor_ref(checkpoint, f"{base}.scale")
        if w.dtype in FP4_DTYPES:
            if s.dtype not in E8M0_DTYPES:
                raise shape_error(s, "FP4 scale has the wrong dtype", "F8_E8M0 or U8 (E8M0 exponents)", s.dtype)
            n, half = matrix_shape(w, expert)
            shape, want = (n, 2 * half), (n, 2 * half // FP4_GROUP)
            if half % (FP4_GROUP // 2) or tuple(per_expert_shape(s, expert)) != want:
                raise shape_error(s, f"scale does not match FP4 weight [{n}, {half}] (k = {2 * half}) in groups of "
                                     f"{FP4_GROUP}", str(list(want)), str(list(s.shape)))
        elif w.dtype == "F8_E4M3":
            if s.dtype not in E8M0_DTYPES + FLOAT_DTYPES:
                raise shape_error(s, "FP8 scale has the wrong dtype", "F8_E8M0, U8, F32 or BF16", s.dtype)
            shape, block = matrix_shape(w, expert), group.block or FP8_BLOCK
            want = fp8.block_scale_shape(*shape, block)
            if tuple(per_expert_shape(s, expert)) != want:
                raise shape_error(s, f"scale does not match FP8 weight {list(shape)} in {list(block)} blocks",
                                  str(list(want)), str(list(s.shape)))
        else:
            raise shape_error(w, "DeepSeek-V4 weight has the wrong dtype", "I8 / U8 (FP4 pairs) or F8_E4M3", w.dtype)
        return MatrixRefs(cls.scheme, w.name, {"scale": s.name}, expert, tuple(shape), group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out"      # groups and blocks along in-features of [out, in] weights

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        s_name = refs.partners["scale"]
        s_dtype = checkpoint.tensors[s_name].dtype
        raw = np.asarray(read_partner(checkpoint, s_name, refs.index0))
        n, k = refs.shape
        if checkpoint.tensors[refs.primary].dtype in FP4_DTYPES:
            blocks = np.ascontiguousarray(data).view(np.uint8).reshape(n, k // FP4_GROUP, FP4_GROUP // 2)
            return mxfp4.dequant(blocks, raw.view(np.uint8), where)
        scale = mxfp4.e8m0_to_f32(raw.view(np.uint8)) if s_dtype in E8M0_DTYPES else float_values(raw, s_dtype)
        block = refs.group.block or FP8_BLOCK
        return fp8.dequant_block(data, scale.reshape(fp8.block_scale_shape(n, k, block)), block, where=where)

"""Quantized dtypes for tiny checkpoints (``make_tiny_model(..., dtype="fp8" | "ct-int4" | "mxfp4")``).

Importing this module registers the writers in ``ktconvert.examples.tiny.DTYPE_WRITERS``:

* ``fp8``: DeepSeek convention — every linear and expert weight F8_E4M3 + ``weight_scale_inv`` F32 in 128x128
  blocks (partial edge blocks when a dim is not a multiple of 128), ``quant_method: fp8``. Routers, norms,
  embeddings stay BF16.
* ``ct-int4``: Kimi-K2 style compressed-tensors pack-quantized symmetric INT4, group 32, BF16 scales, routed
  experts only (``weight_packed`` / ``weight_scale`` / ``weight_shape``).
* ``mxfp4``: gpt-oss hub layout for fused experts (``*_blocks`` [E, rows, k/32, 16] + ``*_scales`` E8M0).
* ``gptq-int4``, ``gptq-int8``, ``gptq-int4-asym``, ``gptq-int4-actorder``, ``gptq-v2-int4-asym``, ``awq-int4``:
  GPTQ / AWQ experts and linears, from ``ktconvert.examples.tiny_qweight``; ``fp8-channel`` (fbgemm_fp8), ``mxfp8``,
  ``nvfp4`` (ModelOpt) from ``ktconvert.examples.tiny_float_formats`` (both imported at the end).

The quantizers here only have to produce valid files; readers are tested against independent references.
"""
from __future__ import annotations

import numpy as np

from ktconvert.quant.ct_int4 import pack_quantized_config as ct_int4_config
from ktconvert.quant import ct_int4, fp8, mxfp4
from ktconvert.quant.bf16 import f32_to_bf16_bits
from ktconvert.examples.tiny import DTYPE_WRITERS
from ktconvert.architectures.family_tensors import TensorSpec

FP8_BLOCK = (128, 128)
CT_GROUP = 32
EXPERT_TARGET = r"re:.*\.experts\.(\d+\.)?[^.]+$"   # per-expert and fused routed-expert modules


def _bf16(values: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(np.asarray(values, dtype=np.float32))


def _plain(spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    if spec.keep_fp32:
        return [(spec.name, values.astype(np.float32, copy=False), "F32")]
    return [(spec.name, _bf16(values), "BF16")]


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


class Fp8BlockWriter:
    """DeepSeek-V3 style block FP8 (see module docstring)."""

    torch_dtype = "bfloat16"

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        if spec.role not in ("linear", "expert") or len(spec.shape) != 2 or not spec.name.endswith(".weight"):
            return _plain(spec, values)
        codes, scale_inv = fp8.quantize_block(_bf16(values), FP8_BLOCK, where=spec.name)
        return [(spec.name, codes, "F8_E4M3"), (spec.name + "_scale_inv", scale_inv, "F32")]

    def update_config(self, config: dict, info) -> None:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(FP8_BLOCK)}


class CtInt4Writer:
    """compressed-tensors pack-quantized INT4 (W4A16, symmetric, BF16 scales) on per-expert weights."""

    torch_dtype = "bfloat16"

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        if spec.role != "expert":
            return _plain(spec, values)
        q, scale = ct_int4.quantize_sym_groups(_bf16(values), CT_GROUP, where=spec.name)
        base = _module(spec.name)
        return [(base + ".weight_packed", ct_int4.pack_int32(q), "I32"), (base + ".weight_scale", scale, "BF16"),
                (base + ".weight_shape", np.array(spec.shape, dtype=np.int64), "I64")]

    def update_config(self, config: dict, info) -> None:
        config["quantization_config"] = ct_int4_config(CT_GROUP, [EXPERT_TARGET])


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, k] (k % 32 == 0) -> (blocks uint8 [n, k/32, 16], scales uint8 [n, k/32]).

    OCP rule: shared exponent floor(log2(amax)) - 2, values rounded to the nearest E2M1 (ties to even code),
    saturating at 6."""
    n, k = w.shape
    g = w.reshape(n, k // mxfp4.BLOCK, mxfp4.BLOCK).astype(np.float32)
    amax = np.abs(g).max(axis=2)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = np.clip(np.abs(g) / np.ldexp(np.float32(1), exp)[:, :, None], 0, 6)
    pos = mxfp4.E2M1_TO_F32[:8]
    dist = np.abs(scaled[..., None] - pos)                      # [n, G, 32, 8]
    code = np.argmin(dist + (np.arange(8) % 2) * 1e-6, axis=-1).astype(np.uint8)
    code |= (np.signbit(g) & (code > 0)).astype(np.uint8) << 3
    blocks = code[:, :, 0::2] | (code[:, :, 1::2] << 4)
    return blocks.astype(np.uint8), (exp + mxfp4.E8M0_BIAS).astype(np.uint8)


class Mxfp4Writer:
    """gpt-oss hub MXFP4 for fused experts; expert matrices stored [E, out, in/32, 16]."""

    torch_dtype = "bfloat16"

    def __init__(self):
        self.hidden = None

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        if spec.role not in ("fused_gate_up", "fused_down"):
            return _plain(spec, values)
        stored_in = spec.shape[2]
        linear_in = self.hidden if spec.role == "fused_gate_up" else spec.shape[1] + spec.shape[2] - self.hidden
        mats = values if stored_in == linear_in else np.swapaxes(values, 1, 2)   # -> [E, out, in]
        pairs = [quantize_mxfp4(np.asarray(m, np.float32)) for m in mats]
        blocks = np.stack([b for b, _ in pairs])
        scales = np.stack([s for _, s in pairs])
        return [(spec.name + "_blocks", blocks, "U8"), (spec.name + "_scales", scales, "U8")]

    def update_config(self, config: dict, info) -> None:
        self.hidden = info.hidden
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


DTYPE_WRITERS.register("fp8", aliases=["fp8-block"])(Fp8BlockWriter())
DTYPE_WRITERS.register("ct-int4", aliases=["int4-ct", "w4a16"])(CtInt4Writer())
DTYPE_WRITERS.register("mxfp4")(Mxfp4Writer())

from ktconvert.examples import tiny_float_formats  # noqa: E402,F401  (gptq-*, awq-int4, fp8-channel, ...

from ktconvert.examples import tiny_qweight
"""GPTQ and AWQ dtypes for tiny checkpoints (registered in ``DTYPE_WRITERS`` when tiny_quantized is imported).

Routed experts (per-expert 2-D tensors, or fused [E, ...] ones in the families that fuse them) and, as in real
GPTQ / AWQ checkpoints, the other linears whose shapes allow it (attention, dense and shared-expert MLPs); routers,
embeddings, heads and norms stay BF16. Group 32, F16 scales, round-to-nearest from min / max (no calibration):

* ``gptq-int4`` / ``gptq-int8``: AutoGPTQ v1 (``checkpoint_format: gptq``, qzeros hold z - 1), symmetric,
  ``g_idx`` = k // 32; ``gptq-int4-asym``: the same, asymmetric; ``gptq-int4-actorder``: symmetric with
  ``desc_act: true`` and a seeded permuted g_idx; ``gptq-v2-int4-asym``: GPTQModel's ``gptq_v2`` (qzeros hold z),
  asymmetric, act-order.
* ``awq-int4``: AutoAWQ GEMM (``version: gemm``, ``zero_point: true``), fields in AWQ's order.

The quantizers here only have to produce valid files; readers are tested against independent references.
"""
from __future__ import annotations

import zlib

import numpy as np

from ktconvert.quant import qweight
from ktconvert.examples.tiny import DTYPE_WRITERS
from ktconvert.architectures.family_tensors import TensorSpec

GROUP = 32


def _plain(spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    from ktconvert.quant.bf16 import f32_to_bf16_bits

    if spec.keep_fp32:
        return [(spec.name, values.astype(np.float32, copy=False), "F32")]
    return [(spec.name, f32_to_bf16_bits(values), "BF16")]


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def quantize_kn(w_kn: np.ndarray, g_idx: np.ndarray, groups: int, bits: int, sym: bool, zmin: int = 0):
    """float32 [K, N] -> (q uint8 [K, N], z int [G, N], scale float16 [G, N]); column k in group g_idx[k].
    sym: scale = 2 amax / (2^b - 1), z = 2^(b-1); else scale = (max - min) / (2^b - 1) over [min(w, 0),
    max(w, 0)], z = round(-min / scale) clipped to [zmin, 2^b - 1]."""
    maxq = (1 << bits) - 1
    k, n = w_kn.shape
    lo = np.zeros((groups, n), np.float32)
    hi = np.zeros((groups, n), np.float32)
    np.minimum.at(lo, g_idx, w_kn)
    np.maximum.at(hi, g_idx, w_kn)
    if sym:
        amax = np.maximum(-lo, hi)
        scale = (2 * amax / maxq).astype(np.float16)
        scale[scale == 0] = 1
        z = np.full((groups, n), 1 << (bits - 1), dtype=np.int32)
    else:
        scale = ((hi - lo) / maxq).astype(np.float16)
        scale[scale == 0] = 1
        z = np.clip(np.rint(-lo / scale.astype(np.float32)), zmin, maxq).astype(np.int32)
    q = np.rint(w_kn / scale.astype(np.float32)[g_idx]) + z[g_idx]
    return np.clip(q, 0, maxq).astype(np.uint8), z, scale


def _quantizable(spec: TensorSpec) -> bool:
    """A 2-D linear weight GPTQModel / AutoAWQ would quantize: in-features in whole groups, out-features in whole
    zero-point words (attention, dense and shared-expert MLPs; routers and heads have other roles)."""
    return len(spec.shape) == 2 and spec.name.endswith(".weight") and spec.shape[1] % GROUP == 0 \
        and spec.shape[0] % 8 == 0


class ExpertWriter:
    """Shared: quantize every routed expert matrix (per-expert or each slice of a fused tensor) and linear."""

    torch_dtype = "bfloat16"

    def __init__(self):
        self.hidden = None

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        if spec.role == "expert" or (spec.role == "linear" and _quantizable(spec)):
            return [(f"{_module(spec.name)}.{s}", a, d) for s, (a, d) in self.matrix(values, spec.name).items()]
        if spec.role not in ("fused_gate_up", "fused_down"):
            return _plain(spec, values)
        linear_in = self.hidden if spec.role == "fused_gate_up" else spec.shape[1] + spec.shape[2] - self.hidden
        mats = values if spec.shape[2] == linear_in else np.swapaxes(values, 1, 2)     # -> [E, out, in]
        parts = [self.matrix(np.asarray(m, np.float32), f"{spec.name}[{e}]") for e, m in enumerate(mats)]
        return [(f"{spec.name}.{s}", np.stack([p[s][0] for p in parts]), d) for s, (_, d) in parts[0].items()]

    def matrix(self, w: np.ndarray, name: str) -> dict[str, tuple[np.ndarray, str]]:
        raise NotImplementedError


class GptqWriter(ExpertWriter):
    def __init__(self, bits: int, sym: bool, act_order: bool, v2: bool):
        super().__init__()
        self.bits, self.sym, self.act_order, self.v2 = bits, sym, act_order, v2

    def matrix(self, w: np.ndarray, name: str) -> dict[str, tuple[np.ndarray, str]]:
        n, k = w.shape
        groups = k // GROUP
        g_idx = (np.arange(k) // GROUP).astype(np.int32)
        if self.act_order:
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            g_idx = g_idx[rng.permutation(k)]
        # v1 stores z - 1: z = 0 is not representable there
        q, z, scale = quantize_kn(np.ascontiguousarray(w.T), g_idx, groups, self.bits, self.sym, 0 if self.v2 else 1)
        stored_z = z if self.v2 else z - 1
        return {"qweight": (qweight.pack_rows(q, self.bits), "I32"),
                "qzeros": (qweight.pack_cols(stored_z.astype(np.uint8), self.bits), "I32"),
                "scales": (scale, "F16"), "g_idx": (g_idx, "I32")}

    def update_config(self, config: dict, info) -> None:
        self.hidden = info.hidden
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": self.bits, "group_size": GROUP, "desc_act": self.act_order,
            "sym": self.sym, "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
            "checkpoint_format": "gptq_v2" if self.v2 else "gptq"}


class AwqWriter(ExpertWriter):
    def matrix(self, w: np.ndarray, name: str) -> dict[str, tuple[np.ndarray, str]]:
        n, k = w.shape
        g_idx = np.arange(k) // GROUP
        lo = w.reshape(n, k // GROUP, GROUP).min(axis=2).T          # AWQ: min / max of the group itself
        hi = w.reshape(n, k // GROUP, GROUP).max(axis=2).T
        scale = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
        z = np.clip(np.rint(-lo / scale.astype(np.float32)), 0, 15).astype(np.uint8)
        q = np.clip(np.rint(w.T / scale.astype(np.float32)[g_idx]) + z[g_idx], 0, 15).astype(np.uint8)
        return {"qweight": (qweight.pack_cols(q, 4, qweight.AWQ_ORDER), "I32"),
                "qzeros": (qweight.pack_cols(z, 4, qweight.AWQ_ORDER), "I32"), "scales": (scale, "F16")}

    def update_config(self, config: dict, info) -> None:
        self.hidden = info.hidden
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": None}


DTYPE_WRITERS.register("gptq-int4", aliases=["gptq"])(GptqWriter(4, sym=True, act_order=False, v2=False))
DTYPE_WRITERS.register("gptq-int8")(GptqWriter(8, sym=True, act_order=False, v2=False))
DTYPE_WRITERS.register("gptq-int4-asym")(GptqWriter(4, sym=False, act_order=False, v2=False))
DTYPE_WRITERS.register("gptq-int4-actorder", aliases=["gptq-int4-desc-act"])(
    GptqWriter(4, sym=True, act_order=True, v2=False))
DTYPE_WRITERS.register("gptq-v2-int4-asym")(GptqWriter(4, sym=False, act_order=True, v2=True))
DTYPE_WRITERS.register("awq-int4", aliases=["awq"])(AwqWriter())

"""Scaled-float dtypes for tiny checkpoints (registered in ``DTYPE_WRITERS`` when tiny_quantized is imported).

Routed experts and the linears whose shapes allow it (like ``tiny_qweight``); routers, embeddings, heads, norms
stay BF16:

* ``fp8-channel``: transformers' ``quant_method: fbgemm_fp8``: ``weight`` F8_E4M3 + ``weight_scale`` F32 [n, 1],
  s = row amax / 448.
* ``mxfp8``: MiniMax-style ``quant_method: mxfp8``: ``weight`` F8_E4M3 + ``weight_scale_inv`` U8 E8M0 [n, k/32],
  exponent floor(log2(group amax)) - 8 (OCP MX), codes e4m3(w / 2^e).
* ``nvfp4``: ModelOpt ``quant_method: modelopt``, ``quant_algo: NVFP4``: ``weight`` U8 [n, k/2] + ``weight_scale``
  F8_E4M3 [n, k/16] + ``weight_scale_2`` F32 0-d, ModelOpt's encoder: ws2 = amax / (6 * 448), ws =
  e4m3(block amax / 6 / ws2), elements e2m1(w / (e4m3(ws) * ws2)).

The quantizers here only have to produce valid files; readers are tested against independent references.
"""
from __future__ import annotations

import numpy as np

from ktconvert.quant import fp8, nvfp4
from ktconvert.quant.fp8 import E4M3_TO_F32
from ktconvert.examples.tiny import DTYPE_WRITERS
from ktconvert.examples.tiny_qweight import ExpertWriter

MX, NV = 32, 16


def fp8_channel(w: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    amax = np.abs(w).max(axis=1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(fp8.E4M3_MAX), 1).astype(np.float32)
    return {"weight": (fp8.f32_to_e4m3(w / s), "F8_E4M3"), "weight_scale": (s, "F32")}


def mxfp8(w: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    n, k = w.shape
    g = w.reshape(n, k // MX, MX)
    amax = np.abs(g).max(axis=2)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 8, -127).clip(-127, 127)
    codes = fp8.f32_to_e4m3(g / np.ldexp(np.float32(1), e.astype(np.int32))[:, :, None]).reshape(n, k)
    return {"weight": (codes, "F8_E4M3"), "weight_scale_inv": ((e + 127).astype(np.uint8), "U8")}


def nvfp4_modelopt(w: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    n, k = w.shape
    g = w.reshape(n, k // NV, NV)
    amax = np.float32(np.abs(w).max())
    ws2 = np.float32(amax / (6 * 448)) if amax > 0 else np.float32(1)
    ws = fp8.f32_to_e4m3(np.abs(g).max(axis=2) / np.float32(6) / ws2)
    block = E4M3_TO_F32[ws] * ws2
    codes = nvfp4.e2m1_codes(g / np.where(block > 0, block, 1)[:, :, None]).reshape(n, k)
    return {"weight": (nvfp4.pack_e2m1(codes), "U8"), "weight_scale": (ws, "F8_E4M3"),
            "weight_scale_2": (np.array(ws2, dtype=np.float32), "F32")}


class ScaledFloatWriter(ExpertWriter):
    def __init__(self, encode, config: dict):
        super().__init__()
        self.encode_matrix, self.config = encode, config

    def matrix(self, w: np.ndarray, name: str) -> dict[str, tuple[np.ndarray, str]]:
        return self.encode_matrix(np.asarray(w, dtype=np.float32))

    def update_config(self, config: dict, info) -> None:
        self.hidden = info.hidden
        config["quantization_config"] = dict(self.config)


DTYPE_WRITERS.register("fp8-channel", aliases=["fbgemm-fp8"])(ScaledFloatWriter(fp8_channel, {
    "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}))
DTYPE_WRITERS.register("mxfp8")(ScaledFloatWriter(mxfp8, {
    "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, MX], "activation_scheme": "dynamic"}))
DTYPE_WRITERS.register("nvfp4", aliases=["modelopt-nvfp4"])(ScaledFloatWriter(nvfp4_modelopt, {
    "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NV, "ignore": ["lm_head", "*.mlp.gate"],
    "producer": {"name": "modelopt"}}))

"""A tiny seeded DeepSeek-V4-style checkpoint (``make_tiny_deepseek_v4``): the hub's names and storage formats on
small dims, for tests and examples.

Files: config.json (``model_type: deepseek_v4``, ``expert_dtype: fp4``, ``quantization_config`` fp8 / e4m3 /
ue8m0 / [128, 128] as the hub's) and one ``model.safetensors`` holding, without a ``model.`` prefix:

* ``embed.weight``, ``head.weight``, ``norm.weight`` and per layer ``attn_norm`` / ``ffn_norm`` (BF16),
  ``ffn.gate.weight`` (BF16 router) and ``ffn.gate.bias`` (F32);
* ``attn.wq_a`` / ``attn.wo`` and ``ffn.shared_experts.{w1,w3,w2}``: ``weight`` F8_E4M3 + ``scale`` F8_E8M0 per
  128x128 block (scale 2^ceil(log2(block amax / 448)), codes e4m3(w / scale));
* routed experts ``layers.L.ffn.experts.E.{w1,w3,w2}`` (gate [I, H], up [I, H], down [H, I]): ``weight`` I8
  [n, k/2] (E2M1 pairs, element 2j in the low nibble) + ``scale`` F8_E8M0 [n, k/32], OCP MX rounding;
* with ``mtp`` MTP layers (config.json ``num_nextn_predict_layers``), MTP layer k as the hub keeps it: a decoder
  block under ``mtp.{k}.`` (the tensors of a layer above, FP4 routed experts included) plus its own ``e_proj`` /
  ``h_proj`` (block FP8) and ``enorm`` / ``hnorm`` / ``norm`` (BF16).

Values: Student-t (3 degrees of freedom) * 0.02 from a generator seeded by (seed, tensor name), rounded to BF16
before quantization. ``bf16_experts`` gives those BF16 expert weights (what the FP4 files were made from). The
quantizers only have to produce valid files; readers are tested against independent references.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from ktconvert.formats.st_writer import StreamingSafetensorsWriter
from ktconvert.quant import fp8
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from ktconvert.examples.tiny_quantized import quantize_mxfp4

FP8_BLOCK = 128
PROJS = {"gate": "w1", "up": "w3", "down": "w2"}


def config(layers: int = 2, experts: int = 4, hidden: int = 256, intermediate: int = 128, mtp: int = 0) -> dict:
    """config.json of the tiny model (the hub config's keys that ktconvert and kt-kernel read; the MTP layer count
    only where there are MTP layers)."""
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 512,
           "hidden_size": hidden, "num_hidden_layers": layers, "n_routed_experts": experts, "n_shared_experts": 1,
           "num_experts_per_tok": 2, "moe_intermediate_size": intermediate, "num_attention_heads": 4,
           "num_key_value_heads": 1, "q_lora_rank": 128, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
           "expert_dtype": "fp4", "tie_word_embeddings": False,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                   "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic"}}
    return cfg | ({"num_nextn_predict_layers": mtp} if mtp else {})


def bf16_values(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """uint16 BF16 bits of one tensor, deterministic in (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return f32_to_bf16_bits((rng.standard_t(3, shape) * 0.02).astype(np.float32))


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    return {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}


def layer_prefix(layer: int, n_layers: int | None = None) -> str:
    """``layers.L.``, or ``mtp.{L - n_layers}.`` for an MTP layer (L >= n_layers, the model's num_hidden_layers)."""
    return f"mtp.{layer - n_layers}." if n_layers is not None and layer >= n_layers else f"layers.{layer}."


def bf16_experts(layer: int, expert: int, hidden: int = 256, intermediate: int = 128, seed: int = 0,
                 n_layers: int | None = None) -> dict:
    """{"gate", "up", "down": uint16 BF16 bits} an expert's FP4 tensors were quantized from (n_layers: the
    model's num_hidden_layers, where `layer` may be an MTP layer)."""
    return {p: bf16_values(f"{layer_prefix(layer, n_layers)}ffn.experts.{expert}.{PROJS[p]}", shape, seed)
            for p, shape in expert_shapes(hidden, intermediate).items()}


def fp8_ue8m0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, k] -> (e4m3 codes uint8 [n, k], E8M0 exponents uint8 [ceil(n/128), ceil(k/128)])."""
    n, k = w.shape
    gn, gk = fp8.block_scale_shape(n, k, (FP8_BLOCK, FP8_BLOCK))
    padded = np.zeros((gn * FP8_BLOCK, gk * FP8_BLOCK), np.float32)
    padded[:n, :k] = np.abs(w)
    amax = padded.reshape(gn, FP8_BLOCK, gk, FP8_BLOCK).max(axis=(1, 3))
    e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / fp8.E4M3_MAX)), 0).clip(-127, 127)
    e = e.astype(np.int32)
    scale = np.repeat(np.repeat(np.ldexp(np.float32(1), e), FP8_BLOCK, 0), FP8_BLOCK, 1)[:n, :k]
    return fp8.f32_to_e4m3(w / scale), (e + 127).astype(np.uint8)


def _tensors(cfg: dict, seed: int) -> dict[str, tuple[np.ndarray, str]]:
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    V = cfg["vocab_size"]
    out: dict[str, tuple[np.ndarray, str]] = {}

    def bf16(name, shape):
        out[name] = (bf16_values(name, shape, seed), "BF16")

    def fp8_linear(base, shape):
        codes, scale = fp8_ue8m0(bf16_bits_to_f32(bf16_values(base, shape, seed)))
        out[base + ".weight"], out[base + ".scale"] = (codes, "F8_E4M3"), (scale, "F8_E8M0")

    bf16("embed.weight", (V, H))
    bf16("head.weight", (V, H))
    out["norm.weight"] = (f32_to_bf16_bits(np.ones(H, np.float32)), "BF16")
    n_layers = cfg["num_hidden_layers"]
    for layer in range(n_layers + cfg.get("num_nextn_predict_layers", 0)):
        p = layer_prefix(layer, n_layers)
        if layer >= n_layers:                                   # the MTP block's own tensors
            for norm in ("enorm", "hnorm", "norm"):
                out[p + norm + ".weight"] = (f32_to_bf16_bits(np.ones(H, np.float32)), "BF16")
            fp8_linear(p + "e_proj", (H, H))
            fp8_linear(p + "h_proj", (H, H))
        for norm in ("attn_norm", "ffn_norm"):
            out[p + norm + ".weight"] = (f32_to_bf16_bits(np.ones(H, np.float32)), "BF16")
        fp8_linear(p + "attn.wq_a", (cfg["q_lora_rank"], H))
        fp8_linear(p + "attn.wo", (H, H))
        bf16(p + "ffn.gate.weight", (E, H))
        out[p + "ffn.gate.bias"] = (np.zeros(E, np.float32), "F32")
        for proj, (n, k) in expert_shapes(H, I).items():
            fp8_linear(p + f"ffn.shared_experts.{PROJS[proj]}", (n, k))
        for e in range(E):
            for proj, bits in bf16_experts(layer, e, H, I, seed, n_layers).items():
                blocks, scales = quantize_mxfp4(bf16_bits_to_f32(bits))
                base = p + f"ffn.experts.{e}.{PROJS[proj]}"
                out[base + ".weight"] = (blocks.reshape(bits.shape[0], -1).view(np.int8), "I8")
                out[base + ".scale"] = (scales, "F8_E8M0")
    return out


def make_tiny_deepseek_v4(out, layers: int = 2, experts: int = 4, hidden: int = 256, intermediate: int = 128,
                          seed: int = 0, mtp: int = 0) -> Path:
    """Write the tiny checkpoint into directory `out` (created; must not hold a config.json), with `mtp` MTP layers;
    returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists():
        raise FileExistsError(out / "config.json")
    cfg = config(layers, experts, hidden, intermediate, mtp)
    tensors = _tensors(cfg, seed)
    specs = [(name, dtype, array.shape) for name, (array, dtype) in tensors.items()]
    with StreamingSafetensorsWriter(out / "model.safetensors", specs, metadata={"format": "pt"},
                                    fsync_and_hash=False) as writer:
        for name, (array, _) in tensors.items():
            writer.write(name, array)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

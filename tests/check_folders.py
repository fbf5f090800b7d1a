"""Weights folders in the formats kt-kernel reads but ktconvert does not write (GPTQ_INT4, MXFP4, NVFP4, MXFP8,
FP8_PERCHANNEL), built by hand from kt-native-formats.md's key names, dtypes and shapes: a safetensors file is its
8-byte header length, the JSON header and the tensors' bytes (numpy arrays; BF16 / F8 / E8M0 as raw uint bits).

Values are small and finite (scales 2^-6 .. 2^-4, codes spread over their range) unless a test asks otherwise.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

E4M3_ONE = 0x38          # 1.0 in F8_E4M3
E8M0_2M5 = 122           # 2^-5 as an E8M0 exponent byte


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: {name: (safetensors dtype, array of that dtype's bits)}; names sorted, packed, no metadata."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, array = tensors[name]
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _config(folder: Path, experts: int, hidden: int, inter: int, layers: int, quant: dict | None = None,
            model_type: str = "qwen3_moe") -> None:
    config = {"model_type": model_type, "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden,
              "moe_intermediate_size": inter, "intermediate_size": 2 * inter, "num_experts": experts,
              "num_experts_per_tok": 2, "num_hidden_layers": layers, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "vocab_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
    if quant is not None:
        config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def build(folder, fmt: str, *, experts: int = 4, hidden: int = 256, inter: int = 256, layers: int = 2,
          group: int | None = None, quant: dict | None = None, seed: int = 0) -> Path:
    """A folder of `fmt` ("gptq", "mxfp4", "nvfp4", "mxfp8", "fp8-perchannel") with one shard per layer and a
    config.json; group: the group size (defaults: gptq 128, mxfp4 32, nvfp4 16, mxfp8 32)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = _rng(seed)
    group = group or {"gptq": 128, "mxfp4": 32, "nvfp4": 16, "mxfp8": 32}.get(fmt)
    for layer in range(layers):
        tensors = {}
        for e in range(experts):
            for proj, (n, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                tensors.update(_matrix(fmt, layer, e, proj, n, k, group, rng))
        write_safetensors(folder / f"model-{layer + 1:05d}-of-{layers:05d}.safetensors", tensors)
    if fmt == "gptq" and quant is None:
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": False}
    _config(folder, experts, hidden, inter, layers, quant)
    return folder


def _matrix(fmt: str, layer: int, e: int, proj: str, n: int, k: int, group, rng) -> dict:
    if fmt == "mxfp4":
        base = f"layers.{layer}.ffn.experts.{e}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[proj]}"
        return {f"{base}.weight": ("I8", rng.integers(-128, 128, (n, k // 2), dtype=np.int8)),
                f"{base}.scale": ("F8_E8M0", np.full((n, k // group), E8M0_2M5, np.uint8))}
    if fmt == "mxfp8":
        base = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[proj]}"
        return {f"{base}.weight": ("F8_E4M3", rng.integers(0, 0x7E, (n, k), dtype=np.uint8)),
                f"{base}.weight_scale_inv": ("U8", np.full((n, k // group), E8M0_2M5, np.uint8))}
    base = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
    if fmt == "nvfp4":
        return {f"{base}.weight": ("U8", rng.integers(0, 256, (n, k // 2), dtype=np.uint8)),
                f"{base}.weight_scale": ("F8_E4M3", np.full((n, k // group), E4M3_ONE, np.uint8)),
                f"{base}.weight_scale_2": ("F32", np.array(0.001, dtype=np.float32))}
    if fmt == "fp8-perchannel":
        return {f"{base}.weight": ("F8_E4M3", rng.integers(0, 0x7E, (n, k), dtype=np.uint8)),
                f"{base}.weight_scale": ("F32", np.full((n, 1), 0.01, np.float32))}
    if fmt == "gptq":
        return {f"{base}.qweight": ("I32", rng.integers(-2**31, 2**31, (k // 8, n), dtype=np.int64).astype(np.int32)),
                f"{base}.scales": ("F16", np.full((k // group, n), 0.01, np.float16)),
                f"{base}.qzeros": ("I32", np.full((k // group, n // 8), 0x77777777, np.uint32).view(np.int32)),
                f"{base}.g_idx": ("I32", (np.arange(k) // group).astype(np.int32))}
    raise ValueError(fmt)

"""What a checkpoint of a family holds: its tensors (names, shapes, roles) and its config.json, and from them the
family's tensor-name vocabulary.

A family's ``[tiny.<model_type>]`` manifest table names the building blocks (attention kind, router, shared expert,
dense MLP, MTP) and carries a complete config.json; expert tensor names come from the manifest's ``[experts]``.
The blocks themselves (which tensors an MLA attention has, ...) are here. No values: ``ktconvert.examples.tiny``
generates and writes tiny checkpoints from them; ``family_vocabulary`` says which names a family uses
(``formats/gguf_dense.py`` maps GGUF names back with it).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

from ktconvert.architectures.manifests import ModelInfo, families, manifest_for, resolve
from ktconvert.errors import ManifestError


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to generate. role: embed, linear, router, expert, fused_gate_up, fused_down, expert_bias, norm,
    bias, other. keep_fp32: stored F32 whatever the model dtype (e_score_correction_bias)."""

    name: str
    shape: tuple[int, ...]
    role: str
    keep_fp32: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ---------------------------------------------------------------- tensor lists (the building blocks)

def _gqa(cfg: dict, tiny: dict, p: str, hidden: int) -> Iterator[TensorSpec]:
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    q_out = heads * head_dim * (2 if tiny.get("q_gate") else 1)
    outs = {"q": q_out, "k": kv * head_dim, "v": kv * head_dim}
    for proj, n in outs.items():
        yield TensorSpec(f"{p}self_attn.{proj}_proj.weight", (n, hidden), "linear")
    yield TensorSpec(f"{p}self_attn.o_proj.weight", (hidden, heads * head_dim), "linear")
    for proj in tiny.get("attn_bias", []):
        n = hidden if proj == "o" else outs[proj]
        yield TensorSpec(f"{p}self_attn.{proj}_proj.bias", (n,), "bias")
    qk_norm = tiny.get("qk_norm", "")
    if qk_norm:
        full = qk_norm == "full"
        yield TensorSpec(f"{p}self_attn.q_norm.weight", (heads * head_dim if full else head_dim,), "norm")
        yield TensorSpec(f"{p}self_attn.k_norm.weight", (kv * head_dim if full else head_dim,), "norm")
    if tiny.get("sinks"):
        yield TensorSpec(f"{p}self_attn.sinks", (heads,), "bias")


def _mla(cfg: dict, tiny: dict, p: str, hidden: int) -> Iterator[TensorSpec]:
    heads, kv_rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_rank = cfg.get("q_lora_rank")
    a = f"{p}self_attn."
    if q_rank:
        yield TensorSpec(a + "q_a_proj.weight", (q_rank, hidden), "linear")
        yield TensorSpec(a + "q_a_layernorm.weight", (q_rank,), "norm")
        yield TensorSpec(a + "q_b_proj.weight", (heads * (nope + rope), q_rank), "linear")
    else:
        yield TensorSpec(a + "q_proj.weight", (heads * (nope + rope), hidden), "linear")
    yield TensorSpec(a + "kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden), "linear")
    yield TensorSpec(a + "kv_a_layernorm.weight", (kv_rank,), "norm")
    yield TensorSpec(a + "kv_b_proj.weight", (heads * (nope + v_dim), kv_rank), "linear")
    yield TensorSpec(a + "o_proj.weight", (hidden, heads * v_dim), "linear")


def _linear_attention(cfg: dict, tiny: dict, p: str, hidden: int) -> Iterator[TensorSpec]:
    """Gated DeltaNet: "qkvz" (Qwen3-Next: in_proj_qkvz + in_proj_ba) or "qkv_z_b_a" (Qwen3.5: four projections)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, kernel = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    a = f"{p}linear_attn."
    if tiny["linear_attention"] == "qkvz":
        yield TensorSpec(a + "in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, hidden), "linear")
        yield TensorSpec(a + "in_proj_ba.weight", (2 * nv, hidden), "linear")
    else:
        yield TensorSpec(a + "in_proj_qkv.weight", (2 * nk * dk + nv * dv, hidden), "linear")
        yield TensorSpec(a + "in_proj_z.weight", (nv * dv, hidden), "linear")
        yield TensorSpec(a + "in_proj_b.weight", (nv, hidden), "linear")
        yield TensorSpec(a + "in_proj_a.weight", (nv, hidden), "linear")
    yield TensorSpec(a + "conv1d.weight", (2 * nk * dk + nv * dv, 1, kernel), "other")
    yield TensorSpec(a + "A_log", (nv,), "bias")
    yield TensorSpec(a + "dt_bias", (nv,), "bias")
    yield TensorSpec(a + "norm.weight", (dv,), "norm")
    yield TensorSpec(a + "out_proj.weight", (hidden, nv * dv), "linear")


def _attention(cfg: dict, tiny: dict, p: str, hidden: int, layer: int, mtp: bool) -> Iterator[TensorSpec]:
    kind = tiny["attention"]
    if kind == "mla":
        return _mla(cfg, tiny, p, hidden)
    if kind == "hybrid" and not mtp:         # MTP layers of hybrid models are full-attention layers
        layer_types = cfg["layer_types"]
        if layer_types[layer % len(layer_types)] == "linear_attention":
            return _linear_attention(cfg, tiny, p, hidden)
    return _gqa(cfg, tiny, p, hidden)


def _mlp(prefix: str, hidden: int, inter: int, role: str = "linear") -> Iterator[TensorSpec]:
    yield TensorSpec(f"{prefix}.gate_proj.weight", (inter, hidden), role)
    yield TensorSpec(f"{prefix}.up_proj.weight", (inter, hidden), role)
    yield TensorSpec(f"{prefix}.down_proj.weight", (hidden, inter), role)


def _routed(info: ModelInfo, tiny: dict, layer: int) -> Iterator[TensorSpec]:
    E, H, I = info.n_experts, info.hidden, info.intermediate
    if not info.fused:
        for e in range(E):
            names = info.expert_names(layer, e)
            yield TensorSpec(names["gate"], (I, H), "expert")
            yield TensorSpec(names["up"], (I, H), "expert")
            yield TensorSpec(names["down"], (H, I), "expert")
        return
    names = info.fused_names(layer)
    transposed = tiny.get("fused_transposed", False)
    yield TensorSpec(names["gate_up"], (E, H, 2 * I) if transposed else (E, 2 * I, H), "fused_gate_up")
    yield TensorSpec(names["down"], (E, I, H) if transposed else (E, H, I), "fused_down")
    if "gate_up_bias" in names:
        yield TensorSpec(names["gate_up_bias"], (E, 2 * I), "expert_bias")
    if "down_bias" in names:
        yield TensorSpec(names["down_bias"], (E, H), "expert_bias")


def _moe(info: ModelInfo, tiny: dict, p: str, layer: int) -> Iterator[TensorSpec]:
    yield TensorSpec(p + tiny["router"], (info.n_experts, info.hidden), "router")
    if tiny.get("router_bias"):
        yield TensorSpec(p + tiny["router_bias"], (info.n_experts,), "bias", tiny.get("router_bias_fp32", False))
    yield from _routed(info, tiny, layer)
    if tiny.get("shared") and info.n_shared:
        yield from _mlp(p + tiny["shared"], info.hidden, info.shared_intermediate)
    if tiny.get("shared_gate"):
        yield TensorSpec(p + tiny["shared_gate"], (1, info.hidden), "linear")


def _mtp_extras(info: ModelInfo, tiny: dict, p: str, layer: int) -> Iterator[TensorSpec]:
    """What an MTP layer has besides a decoder layer: DeepSeek/GLM next-n (inside the layer) or, once for the
    first MTP layer, Qwen3-Next / Qwen3.5's ``mtp.`` module (fc over [embedding, hidden], two pre-fc norms, norm)."""
    H, V = info.hidden, info.config["vocab_size"]
    kind = tiny.get("mtp")
    if kind == "qwen3_next" and layer == info.mtp_layers[0]:
        m = info.manifest.mtp_prefix
        yield TensorSpec(m + "fc.weight", (H, 2 * H), "linear")
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            yield TensorSpec(f"{m}{name}.weight", (H,), "norm")
    if kind != "deepseek":
        return
    yield TensorSpec(p + "enorm.weight", (H,), "norm")
    yield TensorSpec(p + "hnorm.weight", (H,), "norm")
    yield TensorSpec(p + "eh_proj.weight", (H, 2 * H), "linear")
    yield TensorSpec(p + "shared_head.norm.weight", (H,), "norm")
    yield TensorSpec(p + "shared_head.head.weight", (V, H), "embed")
    yield TensorSpec(p + "embed_tokens.weight", (V, H), "embed")


def layer_specs(info: ModelInfo, tiny: dict, layer: int) -> list[TensorSpec]:
    """Every tensor of decoder layer `layer` (an MTP layer when layer >= n_layers)."""
    cfg, H = info.config, info.hidden
    p = info.layer_name("layers.{L}.", layer)
    mtp = layer in info.mtp_layers
    specs = [TensorSpec(p + "input_layernorm.weight", (H,), "norm"),
             TensorSpec(p + "post_attention_layernorm.weight", (H,), "norm")]
    specs += _attention(cfg, tiny, p, H, layer, mtp)
    if layer in info.moe_layers or mtp:
        specs += _moe(info, tiny, p, layer)
    elif tiny.get("dense_mlp"):
        specs += _mlp(p + tiny["dense_mlp"], H, cfg["intermediate_size"])
    if mtp:
        specs += _mtp_extras(info, tiny, p, layer)
    return specs


def model_specs(info: ModelInfo, tiny: dict) -> list[list[TensorSpec]]:
    """Tensor groups in file order: [embeddings + extras], one group per layer (MTP last), [final norm + lm_head]."""
    H, V = info.hidden, info.config["vocab_size"]
    head = [TensorSpec(info.name_prefix + "embed_tokens.weight", (V, H), "embed")]
    head += [TensorSpec(name, tuple(shape), "norm" if name.endswith("norm.weight") else "other")
             for name, shape in tiny.get("extra_tensors", [])]
    tail = [TensorSpec(info.name_prefix + "norm.weight", (H,), "norm")]
    if not info.config.get("tie_word_embeddings", False):
        tail.append(TensorSpec("lm_head.weight", (V, H), "embed"))
    layers = [layer_specs(info, tiny, L) for L in range(info.n_layers)]
    layers += [layer_specs(info, tiny, L) for L in info.mtp_layers]
    layers[0] = head + layers[0]
    layers[info.n_layers - 1] = layers[info.n_layers - 1] + tail
    return layers


# ---------------------------------------------------------------- config

def _tiny_table(arch: str) -> tuple[str, dict]:
    manifest = manifest_for(arch)
    model_type = arch if arch in manifest.tiny else next(iter(manifest.tiny), None)
    if model_type is None:
        raise ManifestError(f"family {manifest.family} has no [tiny.<model_type>] table", file=manifest.source)
    return model_type, manifest.tiny[model_type]


def _set_first(node: dict, keys: tuple[str, ...], value: int) -> None:
    """Overwrite the first of keys present in node (the one the manifest resolves), else set keys[0]."""
    for key in keys:
        if key in node:
            node[key] = value
            return
    node[keys[0]] = value


def build_config(arch: str, layers=None, experts=None, hidden=None, intermediate=None,
                 mtp=None) -> tuple[dict, dict]:
    """(config.json dict, tiny table) for arch with the given dimension overrides (mtp: MTP layers; only for
    families whose tiny table has an ``mtp`` kind)."""
    model_type, tiny = _tiny_table(arch)
    manifest = manifest_for(model_type)
    config = json.loads(json.dumps(tiny["config"]))
    node = config[manifest.text_config] if manifest.text_config in config else config
    node.update({key: None for key in tiny.get("null_keys", [])})
    if mtp and not tiny.get("mtp"):
        raise ManifestError(f"family {manifest.family} has no MTP layers in its tiny table", file=manifest.source)
    for field, value in (("n_layers", layers), ("n_experts", experts), ("hidden", hidden),
                         ("intermediate", intermediate), ("mtp_layers", mtp)):
        if value is not None and manifest.config_keys.get(field):
            _set_first(node, manifest.config_keys[field], int(value))
    if layers is not None:
        if isinstance(node.get("layer_types"), list) and node["layer_types"]:
            pattern = node["layer_types"]
            node["layer_types"] = [pattern[i % len(pattern)] for i in range(int(layers))]
        if isinstance(node.get("mlp_only_layers"), list):
            node["mlp_only_layers"] = [x for x in node["mlp_only_layers"] if x < int(layers)]
    if experts is not None:
        for key in ("num_experts_per_tok", "experts_per_token"):
            if key in node:
                node[key] = min(node[key], int(experts))
    return config, tiny


# ---------------------------------------------------------------- the family's names

def family_vocabulary(family: str) -> frozenset[str]:
    """Every tensor name a checkpoint of `family` holds, over all its model types' tiny tables, with the name
    prefix as "{P}" and decoder layer numbers as "{L}" ("{P}layers.{L}.self_attn.q_norm.weight", "lm_head.weight").
    Which names a family uses, where other conventions exist (GGUF names mapped back to HF: formats/gguf_dense)."""
    return _vocabulary(family)


@lru_cache(maxsize=None)
def _vocabulary(family: str) -> frozenset[str]:
    manifest = families()[family]
    names = set()
    for model_type in manifest.tiny:
        config, tiny = build_config(model_type)
        info = resolve(config, [tiny.get("name_prefix", manifest.name_prefixes[0]) + "layers.0."])
        for spec in (s for group in model_specs(info, tiny) for s in group):
            name = spec.name
            if name.startswith(info.name_prefix):
                name = "{P}" + name[len(info.name_prefix):]
            names.add(re.sub(r"(^|[.}])layers\.\d+\.", r"\1layers.{L}.", name, count=1))
    return frozenset(names)

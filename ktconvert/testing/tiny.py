"""Seeded random checkpoints with the real hub layout of every family (tests, examples, benchmarks).

What a family's checkpoint holds is data: the manifest's ``[tiny.<model_type>]`` table names the building blocks
(attention kind, router, shared expert, dense MLP, MTP) and carries a complete config.json; expert tensor names
come from the manifest's ``[experts]``. The blocks themselves (which tensors an MLA attention has, ...) are below.

Values: Gaussian (scale 0.02) through a 65536-entry inverse-CDF table of BF16 bits indexed by raw PRNG bits, plus
heavy tails (0.75 % of entries at 6-15 sigma, a few rows x4 and columns x2), generated as BF16 bits. Deterministic per (seed,
tensor name), independent of generation order. Memory: one shard (<= SHARD_BYTES or one layer) at a time.

Output dtypes are writers in ``DTYPE_WRITERS`` (bf16, fp16, fp32 here). More (fp8 with weight_scale_inv, ct-int4,
mxfp4) register from ``ktconvert.testing.tiny_quantized`` (imported on first use if present):
``DTYPE_WRITERS.register("fp8")(writer)``. A writer gets float32 values (``encode``); one that defines
``encode_bits`` gets the BF16 bits instead (the fast path the plain bf16 writer uses).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

from ktconvert.architecture import ModelInfo, manifest_for, resolve
from ktconvert.errors import ManifestError, OutputError
from ktconvert.registry import Registry

SHARD_BYTES = 256 << 20          # a layer bigger than this is split over several shards
WEIGHT_STD = 0.02
TAIL_FRACTION = 0.0075
PLAIN_ROLES = ("norm", "bias", "expert_bias", "other")   # no heavy tails
WRITER_PLUGIN_MODULE = "ktconvert.testing.tiny_quantized"
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "U8": np.uint8,
                "I16": np.int16, "U16": np.uint16, "I32": np.int32, "I64": np.int64}
TORCH_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


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


class DtypeWriter(Protocol):
    """Turns one generated tensor into the file's tensors. Optional fast path: ``encode_bits(spec, bits)`` with
    bits = uint16 BF16 bits of spec.shape, used instead of encode when the writer defines it."""

    torch_dtype: str  # config.json torch_dtype

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        """values: float32 of spec.shape (exactly BF16-representable).
        -> [(tensor name, array, safetensors dtype)]; BF16/F8 arrays are uint16/uint8 bit patterns."""
        ...

    def update_config(self, config: dict, info: ModelInfo) -> None:
        """Add e.g. quantization_config to config.json (in place)."""
        ...


DTYPE_WRITERS: Registry = Registry("tiny-model dtype")


class PlainWriter:
    """bf16 / fp16 / fp32: every tensor in one float dtype (keep_fp32 tensors stay F32)."""

    def __init__(self, st_dtype: str, torch_dtype: str):
        self.st_dtype = st_dtype
        self.torch_dtype = torch_dtype

    def encode_bits(self, spec: TensorSpec, bits: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        from ktconvert.quant.bf16 import bf16_bits_to_f32

        if self.st_dtype == "BF16" and not spec.keep_fp32:
            return [(spec.name, bits, "BF16")]
        return self.encode(spec, bf16_bits_to_f32(bits))

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        from ktconvert.quant.bf16 import f32_to_bf16_bits

        if self.st_dtype == "BF16" and not spec.keep_fp32:
            return [(spec.name, f32_to_bf16_bits(values), "BF16")]
        if spec.keep_fp32 or self.st_dtype == "F32":
            return [(spec.name, values, "F32")]
        return [(spec.name, values.astype(np.float16), "F16")]

    def update_config(self, config: dict, info: ModelInfo) -> None:
        return None


DTYPE_WRITERS.register("bf16", aliases=["bfloat16"])(PlainWriter("BF16", "bfloat16"))
DTYPE_WRITERS.register("fp16", aliases=["float16", "f16"])(PlainWriter("F16", "float16"))
DTYPE_WRITERS.register("fp32", aliases=["float32", "f32"])(PlainWriter("F32", "float32"))


def dtype_writer(name: str) -> DtypeWriter:
    """The registered writer for name (loads the optional plugin module first); UnknownNameError lists them."""
    try:
        __import__(WRITER_PLUGIN_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != WRITER_PLUGIN_MODULE:
            raise
    return DTYPE_WRITERS.get(name)


# ---------------------------------------------------------------- values

@lru_cache(maxsize=1)
def _unit_normal_table() -> np.ndarray:
    """float64 [65536]: standard normal quantiles at (i + 0.5) / 65536."""
    from statistics import NormalDist

    inv = NormalDist().inv_cdf
    return np.array([inv((i + 0.5) / 65536.0) for i in range(65536)], dtype=np.float64)


def _bf16(x) -> np.ndarray:
    """float values -> uint16 BF16 bits (RNE). For small arrays (tables, tail values)."""
    from ktconvert.quant.bf16 import f32_to_bf16_bits

    return f32_to_bf16_bits(np.asarray(x, dtype=np.float32))


@lru_cache(maxsize=8)
def _bits_table(mean: float, std: float) -> np.ndarray:
    """uint16 [65536]: BF16 bits of mean + std * (normal quantile i)."""
    return _bf16(mean + std * _unit_normal_table())


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def _uniform_u16(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]


TIMES4, TIMES2 = np.uint16(2 << 7), np.uint16(1 << 7)   # added to BF16 bits: exponent + 2 / + 1


def _add_heavy_tails(bits: np.ndarray, rng: np.random.Generator, std: float) -> None:
    """In place on BF16 bits (no zeros, exponents far from overflow): ~1/64 of rows x4, ~1/128 of columns x2,
    then 0.75 % of entries set to +-(6..15) sigma."""
    if bits.ndim > 1:
        rows = bits.reshape(-1, bits.shape[-1])
        n_rows, n_cols = rows.shape
        rows[np.unique(rng.integers(0, n_rows, max(1, n_rows // 64)))] += TIMES4
        rows[:, np.unique(rng.integers(0, n_cols, max(1, n_cols // 128)))] += TIMES2
    flat = bits.reshape(-1)
    k = max(1, int(flat.size * TAIL_FRACTION))
    where = rng.integers(0, flat.size, k)
    sign = np.where(rng.integers(0, 2, k) == 1, 1.0, -1.0)
    flat[where] = _bf16(sign * rng.uniform(6.0, 15.0, k) * std)


def generate_bits(spec: TensorSpec, seed: int) -> np.ndarray:
    """uint16 BF16 bits of spec.shape; deterministic in (seed, spec.name), independent of call order."""
    rng = _rng(seed, spec.name)
    table = _bits_table(1.0, 0.02) if spec.role == "norm" else _bits_table(0.0, WEIGHT_STD)
    bits = table[_uniform_u16(rng, spec.numel)].reshape(spec.shape)
    if spec.role not in PLAIN_ROLES:
        _add_heavy_tails(bits, rng, WEIGHT_STD)
    return bits


# ---------------------------------------------------------------- tensor lists (the building blocks)

def _cfg_dim(cfg: dict, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    if value is None and default is None:
        raise ManifestError(f"tiny config has no {key!r}")
    return value


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


def _attention(cfg: dict, tiny: dict, p: str, hidden: int, layer: int) -> Iterator[TensorSpec]:
    kind = tiny["attention"]
    if kind == "mla":
        return _mla(cfg, tiny, p, hidden)
    if kind == "hybrid":
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


def _mtp_extras(info: ModelInfo, p: str) -> Iterator[TensorSpec]:
    """DeepSeek/GLM next-n layer: a full decoder layer plus these."""
    H, V = info.hidden, info.config["vocab_size"]
    yield TensorSpec(p + "enorm.weight", (H,), "norm")
    yield TensorSpec(p + "hnorm.weight", (H,), "norm")
    yield TensorSpec(p + "eh_proj.weight", (H, 2 * H), "linear")
    yield TensorSpec(p + "shared_head.norm.weight", (H,), "norm")
    yield TensorSpec(p + "shared_head.head.weight", (V, H), "embed")
    yield TensorSpec(p + "embed_tokens.weight", (V, H), "embed")


def layer_specs(info: ModelInfo, tiny: dict, layer: int) -> list[TensorSpec]:
    """Every tensor of decoder layer `layer` (an MTP layer when layer >= n_layers)."""
    cfg, H = info.config, info.hidden
    p = f"{info.name_prefix}layers.{layer}."
    specs = [TensorSpec(p + "input_layernorm.weight", (H,), "norm"),
             TensorSpec(p + "post_attention_layernorm.weight", (H,), "norm")]
    specs += _attention(cfg, tiny, p, H, layer)
    if layer in info.moe_layers or layer in info.mtp_layers:
        specs += _moe(info, tiny, p, layer)
    elif tiny.get("dense_mlp"):
        specs += _mlp(p + tiny["dense_mlp"], H, cfg["intermediate_size"])
    if layer in info.mtp_layers and tiny.get("mtp") == "deepseek":
        specs += _mtp_extras(info, p)
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


def plan_shards(groups: list[list[TensorSpec]], bytes_per_value: int) -> list[list[TensorSpec]]:
    """One shard per group (layer), split further where a group exceeds SHARD_BYTES."""
    shards = []
    for group in groups:
        current, size = [], 0
        for spec in group:
            nbytes = spec.numel * bytes_per_value
            if current and size + nbytes > SHARD_BYTES:
                shards.append(current)
                current, size = [], 0
            current.append(spec)
            size += nbytes
        shards.append(current)
    return shards


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


def build_config(arch: str, layers=None, experts=None, hidden=None, intermediate=None) -> tuple[dict, dict]:
    """(config.json dict, tiny table) for arch with the given dimension overrides."""
    model_type, tiny = _tiny_table(arch)
    manifest = manifest_for(model_type)
    config = json.loads(json.dumps(tiny["config"]))
    node = config[manifest.text_config] if manifest.text_config in config else config
    node.update({key: None for key in tiny.get("null_keys", [])})
    for field, value in (("n_layers", layers), ("n_experts", experts), ("hidden", hidden),
                         ("intermediate", intermediate)):
        if value is not None:
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


# ---------------------------------------------------------------- files

def _save_shard(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    metadata = {"format": "pt"}
    if all(dtype in NUMPY_DTYPES for _, dtype in tensors.values()):
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(a) for k, (a, _) in tensors.items()}, str(path), metadata=metadata)
        os.chmod(path, 0o644)
        return
    import torch
    from safetensors.torch import save_file as save_torch

    out = {}
    for name, (array, dtype) in tensors.items():
        t = torch.from_numpy(np.ascontiguousarray(array))
        out[name] = t.view(getattr(torch, TORCH_DTYPES[dtype])) if dtype in TORCH_DTYPES else t
    save_torch(out, str(path), metadata=metadata)
    os.chmod(path, 0o644)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """WordLevel tokenizer: <unk>=0, <s>=1, </s>=2, <pad>=3, then tok4 .. tok{V-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"tok{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    (out / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(out / "tokenizer_config.json", {**special, "tokenizer_class": "PreTrainedTokenizerFast",
                                                 "model_max_length": 4096, "clean_up_tokenization_spaces": False})


def _prepare_out(out: Path, force: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise OutputError("output exists and is not a directory", file=out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputError("output directory is not empty", file=out, hint="pass force=True / --force to replace it")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _finish_out(tmp: Path, out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _encode(writer: DtypeWriter, spec: TensorSpec, bits: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    if hasattr(writer, "encode_bits"):
        return writer.encode_bits(spec, bits)
    from ktconvert.quant.bf16 import bf16_bits_to_f32

    return writer.encode(spec, bf16_bits_to_f32(bits))


def _write_weights(tmp: Path, info: ModelInfo, tiny: dict, writer: DtypeWriter, seed: int) -> None:
    """Generate shard i+1 while a background thread writes shard i (at most two shards in memory)."""
    from concurrent.futures import ThreadPoolExecutor

    bytes_per_value = 4 if getattr(writer, "st_dtype", "") == "F32" else 2
    shards = plan_shards(model_specs(info, tiny), bytes_per_value)
    weight_map, total, pending = {}, 0, None
    with ThreadPoolExecutor(max_workers=1) as saver:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
            tensors = {}
            for spec in shard:
                for name, array, dtype in _encode(writer, spec, generate_bits(spec, seed)):
                    tensors[name] = (array, dtype)
                    weight_map[name] = fname
                    total += array.nbytes
            if pending is not None:
                pending.result()
            pending = saver.submit(_save_shard, tmp / fname, tensors)
            del tensors
        if pending is not None:
            pending.result()
    if len(shards) > 1:
        _write_json(tmp / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def make_tiny_model(out, arch: str, layers: int | None = None, experts: int | None = None,
                    hidden: int | None = None, intermediate: int | None = None, dtype: str = "bf16",
                    seed: int = 0, force: bool = False) -> Path:
    """Write a seeded random checkpoint of family/model_type `arch` into directory `out`; returns `out`.

    Files: config.json, generation_config.json, tokenizer.json + tokenizer_config.json + special_tokens_map.json,
    and the weights (one shard per layer, model.safetensors.index.json when there is more than one shard).
    Refuses a non-empty `out` unless force. Written to a temporary sibling directory, renamed when complete.
    """
    writer = dtype_writer(dtype)
    config, tiny = build_config(arch, layers, experts, hidden, intermediate)
    config["torch_dtype"] = writer.torch_dtype
    info = resolve(config, [tiny.get("name_prefix", manifest_for(arch).name_prefixes[0]) + "layers.0."])
    writer.update_config(config, info)
    out = Path(out)
    tmp = _prepare_out(out, force)
    try:
        _write_weights(tmp, info, tiny, writer, seed)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
        _write_tokenizer(tmp, int(info.config["vocab_size"]))
        _finish_out(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

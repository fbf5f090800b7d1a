"""Store a tiny checkpoint's routed experts in another layout: the same weights, other tensors (tests).

    relayout(src, dst, layout, orientation="out", prefix=0, fp8_names="tensor") -> dst

layout: "per_expert" | "fused" (gate_up + down) | "fused_separate" (gate, up, down 3-D); orientation: "out"
(stored [E, out, in]) or "in" ([E, in, out]); prefix: which of the family's MoE expert prefixes the fused
tensors go under (ModelInfo.experts_prefixes). Every stored tensor of an expert matrix moves along as it is:
float weights, FP8 codes + block scales (a fused FP8 tensor is named ``<name>`` + ``<name>_scale_inv`` with
fp8_names="tensor", transformers 5's convention, or ``<name>.weight`` + ``<name>.weight_scale_inv`` with
"module"), compressed-tensors ``weight_packed`` / ``weight_scale`` / ``weight_shape`` (a fused one [E, 2]),
biases. Fusing concatenates gate and up along out-features (interleaving rows where the family does, gpt-oss)
and stacks experts; "in" swaps the two per-expert axes of weights and block scales. compressed-tensors weights
exist only out-major (packed along in-features): "in" is refused for them. GPTQ / AWQ tensors (``qweight``,
``qzeros``, ``scales``, ``g_idx``) are input-major: they stack into fused_separate, joining gate and up is refused.

Everything else (non-expert tensors, config.json, tokenizer files) is copied as it is (the tiny ct-int4
config's expert targets already match fused module names). Files are written with ktconvert's own safetensors writer,
one shard per source shard. Tiny checkpoints only: each shard is held in memory.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.hf_source import HFSource, _base_of
from ktconvert.layouts.naming import INDEX_NAME, PROJS
from ktconvert.examples.tiny import _save_shard, _write_json

LAYOUTS = ("per_expert", "fused", "fused_separate")
_PER_EXPERT_MATRIX = ("weight", "weight_scale_inv", "weight_scale", "weight_packed", "weight_zero_point")


def relayout(src, dst, layout: str, orientation: str = "out", prefix: int = 0, fp8_names: str = "tensor") -> Path:
    """Write checkpoint `src` into the new directory `dst` with its routed experts stored in `layout`."""
    if layout not in LAYOUTS or orientation not in ("out", "in") or fp8_names not in ("tensor", "module"):
        raise InputError("bad relayout request", expected=f"layout in {LAYOUTS}, orientation out|in, "
                                                          "fp8_names tensor|module",
                         found=f"{layout}, {orientation}, {fp8_names}")
    source = HFSource.open(src)
    info = source.info
    dst = Path(dst)
    dst.mkdir(parents=True)
    layers = list(info.moe_layers) + list(source.present_mtp_layers())
    moved = source.routed_tensor_names(layers)
    shard_of = {name: source.tensor(name).file.name for name in source.tensor_names()}
    out: dict[str, dict[str, tuple[np.ndarray, str]]] = {}
    for name in source.tensor_names():
        if name not in moved:
            out.setdefault(shard_of[name], {})[name] = (source.read_tensor(name), source.tensor(name).dtype)
    for layer in layers:
        stored = _expert_tensors(source, layer)
        shard = shard_of[min(source.routed_tensor_names([layer]))]
        writer = _PER_LAYER_WRITERS[layout]
        out.setdefault(shard, {}).update(writer(source, layer, stored, orientation, prefix, fp8_names))
    for shard, tensors in out.items():
        _save_shard(dst / shard, dict(sorted(tensors.items())))
    if len(out) > 1:
        weight_map = {n: shard for shard, tensors in out.items() for n in tensors}
        total = sum(a.nbytes for tensors in out.values() for a, _ in tensors.values())
        _write_json(dst / INDEX_NAME, {"metadata": {"total_size": total},
                                       "weight_map": dict(sorted(weight_map.items()))})
    for name, path in source.side_files().items():
        shutil.copyfile(path, dst / name)
    return dst


# ---------------------------------------------------------------- reading: {proj: [per expert {suffix: array}]}

def _expert_tensors(source, layer: int) -> dict[str, list[dict[str, tuple[np.ndarray, str]]]]:
    """Every stored tensor of `layer`'s experts, out-major, per projection and expert: {suffix: (array, dtype)}
    with suffixes "weight", "weight_scale_inv", "weight_scale", "weight_packed", "weight_shape", "bias", ..."""
    layout = source.required_layout(layer)
    all_names = source.tensor_names()
    out: dict[str, list] = {p: [] for p in PROJS}
    for e in range(source.info.n_experts):
        if layout.kind == "per_expert":
            names = source.info.expert_names(layer, e)
            for proj in PROJS:
                base = _base_of(names[proj])
                out[proj].append({n[len(base) + 1:]: (source.read_tensor(n), source.tensor(n).dtype)
                                  for n in all_names if n.startswith(base + ".")})
            continue
        for t in layout.tensors:
            if source.input_format not in ("bf16", "fp16", "fp32"):
                raise InputError("relayout of quantized fused experts is not supported", tensor=t.name)
            weight = source.read_tensor(t.name, e)
            dtype = source.tensor(t.name).dtype
            if source.orientation[t.role].value == "in":
                weight = np.ascontiguousarray(weight.T)
            parts = {p: {"weight": (w, dtype)} for p, w in source.split_role(t, weight).items()}
            if t.bias:
                for p, b in source.split_role(t, source.read_tensor(t.bias, e)).items():
                    parts[p]["bias"] = (b, source.tensor(t.bias).dtype)
            for p, tensors in parts.items():
                out[p].append(tensors)
    return out


# ---------------------------------------------------------------- writing one layer

def _per_expert(source, layer, stored, orientation, prefix, fp8_names) -> dict:
    out = {}
    for e in range(source.info.n_experts):
        names = source.info.expert_names(layer, e)
        for proj in PROJS:
            base = _base_of(names[proj])
            for suffix, value in stored[proj][e].items():
                out[f"{base}.{suffix}"] = value
    return out


def _fused(source, layer, stored, orientation, prefix, fp8_names) -> dict:
    moe = source.info.experts_prefixes(layer)[prefix]
    interleaved = source.info.manifest.experts.gate_up_interleaved
    gate_up = [{k: (_join(g[k][0], u[k][0], k, interleaved), g[k][1]) for k in g}
               for g, u in zip(stored["gate"], stored["up"])]
    out = _stack(f"{moe}.gate_up_proj", gate_up, orientation, fp8_names)
    out.update(_stack(f"{moe}.down_proj", stored["down"], orientation, fp8_names))
    return out


def _fused_separate(source, layer, stored, orientation, prefix, fp8_names) -> dict:
    moe = source.info.experts_prefixes(layer)[prefix]
    out = {}
    for proj in PROJS:
        out.update(_stack(f"{moe}.{proj}_proj", stored[proj], orientation, fp8_names))
    return out


_PER_LAYER_WRITERS = {"per_expert": _per_expert, "fused": _fused, "fused_separate": _fused_separate}


def _join(gate: np.ndarray, up: np.ndarray, suffix: str, interleaved: bool) -> np.ndarray:
    """gate and up of one expert as one gate_up tensor: rows concatenated (or interleaved), shape [n, k] summed."""
    if suffix in ("qweight", "qzeros", "scales", "g_idx"):
        raise InputError("GPTQ / AWQ tensors are stored input-major: relayout does not join their gate and up",
                         expected="per-expert or fused_separate", found=suffix)
    if suffix == "weight_shape":
        return np.array([gate[0] + up[0], gate[1]], dtype=gate.dtype)
    if interleaved:
        if suffix not in ("weight", "bias"):
            raise InputError("interleaved gate/up rows of a quantized weight would split its scale blocks",
                             expected="a float checkpoint", found=suffix)
        out = np.empty((gate.shape[0] * 2, *gate.shape[1:]), dtype=gate.dtype)
        out[0::2], out[1::2] = gate, up
        return out
    return np.concatenate([gate, up], axis=0)


def _stack(name: str, experts: list[dict], orientation: str, fp8_names: str) -> dict:
    """One fused tensor per suffix: experts stacked along a new axis 0, per-expert axes swapped for "in"."""
    out = {}
    quantized_fp8 = experts[0]["weight"][1] == "F8_E4M3" if "weight" in experts[0] else False
    for suffix in experts[0]:
        arrays = [x[suffix][0] for x in experts]
        dtype = experts[0][suffix][1]
        value = np.stack(arrays)
        if orientation == "in" and suffix in _PER_EXPERT_MATRIX:
            if suffix in ("weight_packed", "weight_zero_point"):
                raise InputError("compressed-tensors packed weights exist only as [E, out, in/8]", tensor=name)
            value = np.ascontiguousarray(np.swapaxes(value, 1, 2))
        out[_fused_name(name, suffix, quantized_fp8, fp8_names)] = (value, dtype)
    return out


def _fused_name(name: str, suffix: str, quantized_fp8: bool, fp8_names: str) -> str:
    if suffix == "bias":
        return f"{name}_bias"
    if suffix == "weight" and not (quantized_fp8 and fp8_names == "module"):
        return name
    if quantized_fp8 and fp8_names == "tensor" and suffix.startswith("weight_scale"):
        return name + suffix[len("weight"):]
    return f"{name}.{suffix}"


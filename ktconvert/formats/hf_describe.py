"""`ktconvert inspect` of an HF safetensors checkpoint, from its headers and config.json only: files, dtypes,
quantization, bytes per component (the family manifest's [components] regexes, first match wins; tensors of
layers >= num_hidden_layers count as "mtp"), layers, experts and the routed experts' layout."""
from __future__ import annotations

import re
from pathlib import Path

from ktconvert.architecture import component_of
from ktconvert.errors import KtConvertError, ManifestError
from ktconvert.formats.decoders import config_summary
from ktconvert.formats.safetensors_reader import Checkpoint

_DIGITS = re.compile(r"\d+")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def describe_path(source_cls, path) -> tuple[dict, object]:
    """(description, opened source) of checkpoint `path`; a family no manifest covers is described from the
    headers alone (source None, ``supported`` False and the reason)."""
    checkpoint = Checkpoint.open(path)
    try:
        source = source_cls.open_checkpoint(checkpoint)
    except ManifestError as exc:
        out = _files(checkpoint, path, None)
        out.update(family=None, supported=False, reason=str(exc))
        return out, None
    return describe(source, path), source


def describe(source, path=None) -> dict:
    """The keys ktconvert.inspection.render reads, for an opened HFSource."""
    info = source.info
    out = _files(source.checkpoint, path or source.root, info)
    dense = [layer for layer in range(info.n_layers) if layer not in set(info.moe_layers)]
    out.update({
        "family": info.family, "supported": True, "input_format": source.input_format,
        "layers": {"total": info.n_layers, "dense": dense, "moe": list(info.moe_layers),
                   "mtp": list(source.present_mtp_layers()), "mtp_in_config": list(info.mtp_layers)},
        "experts": info.n_experts, "experts_per_tok": info.experts_per_tok, "shared_experts": info.n_shared,
        "hidden": info.hidden, "intermediate": info.intermediate,
        "expert_layout": _expert_layout(source),
    })
    return out


def _files(checkpoint: Checkpoint, path, info) -> dict:
    dtypes: dict[str, int] = {}
    for ref in checkpoint.tensors.values():
        dtypes[ref.dtype] = dtypes.get(ref.dtype, 0) + ref.nbytes
    return {
        "path": str(Path(path)),
        "files": len(checkpoint.shards),
        "file_bytes": checkpoint.total_bytes(),
        "tensors": len(checkpoint.tensors),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: -kv[1])),
        "quantization": config_summary(checkpoint.config),
        "model_type": checkpoint.config.get("model_type"),
        "components": _categorise(checkpoint, info),
    }


def _categorise(checkpoint: Checkpoint, info) -> dict[str, int]:
    """Bytes per component category. Names are cached with digits replaced by 0 (few distinct shapes)."""
    totals: dict[str, int] = {}
    cache: dict[str, str] = {}
    check_mtp = info is not None and bool(info.mtp_layers)
    for name, ref in checkpoint.tensors.items():
        if info is None:
            cat = "unknown family"
        else:
            key = _DIGITS.sub("0", name)
            cat = cache.get(key)
            if cat is None:
                cat = cache[key] = component_of(info.manifest, key)
            if check_mtp:
                layer = _LAYER.search(name)
                cat = "mtp" if layer and int(layer.group(1)) >= info.n_layers else cat
        totals[cat] = totals.get(cat, 0) + ref.nbytes
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _expert_layout(source) -> dict:
    """Form, orientation (fused) and bias presence of the routed experts."""
    lay = source.info.manifest.experts
    out = {"form": lay.form, "biases": False}
    if lay.form == "per_expert":
        out["pattern"] = source.info.name_prefix + lay.pattern
        out["biases"] = source.has_expert_biases()
        return out
    out["interleaved_gate_up"] = bool(lay.gate_up_interleaved)
    try:
        fl = source.fused_layer(source.all_layers()[0])
    except KtConvertError as exc:  # quantized without a decoder: report, don't fail inspect
        out["orientation"] = f"unknown ({exc})"
        return out
    out["gate_up"] = "[E, H, 2I]" if fl.gate_up_transposed else "[E, 2I, H]"
    out["down"] = "[E, I, H]" if fl.down_transposed else "[E, H, I]"
    out["biases"] = bool(fl.gate_up_bias or fl.down_bias)
    if fl.ambiguous:
        out["ambiguous"] = [f"{k}: H == {'2I' if k == 'gate_up' else 'I'}, so the shape cannot tell; assumed "
                            f"{out[k]} (the other tensor's convention)" for k in fl.ambiguous]
    return out

"""`ktconvert inspect` of an HF safetensors checkpoint, from its headers and config.json only: files, dtypes,
quantization, bytes per component (the family manifest's [components] regexes, first match wins; tensors of
MTP layers count as "mtp"), layers, experts and the routed experts' layout as detected (formats/expert_layout.py):
per fused tensor its stored shape, orientation and the evidence for it."""
from __future__ import annotations

import re
from pathlib import Path

from ktconvert.architectures.manifests import component_of
from ktconvert.errors import KtConvertError, ManifestError
from ktconvert.formats.decoders import config_summary
from ktconvert.formats.expert_layout import stored_label
from ktconvert.formats.safetensors_reader import Checkpoint

_DIGITS = re.compile(r"\d+")


def describe_path(source_cls, path, expert_orientation: str | None = None) -> tuple[dict, object]:
    """(description, opened source) of checkpoint `path`; a family no manifest covers is described from the
    headers alone (source None, ``supported`` False and the reason)."""
    checkpoint = Checkpoint.open(path)
    try:
        source = source_cls.open_checkpoint(checkpoint, expert_orientation)
    except ManifestError as exc:
        out = _files(checkpoint, path, None)
        out.update(family=None, supported=False, reason=str(exc))
        return out, None
    return describe(source, path), source


def describe(source, path=None) -> dict:
    """The keys ktconvert.run.inspection.render reads, for an opened HFSource."""
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
            if check_mtp and (info.layer_of(name) or 0) >= info.n_layers:
                cat = "mtp"
        totals[cat] = totals.get(cat, 0) + ref.nbytes
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _expert_layout(source) -> dict:
    """Layout of the routed experts as detected (main MoE layers; MTP layers under "mtp" when they differ):
    kind, the family's usual layout (hint), tensor names, and per fused role its stored shape, orientation and
    why; "problem" instead when the orientation cannot be decided."""
    info = source.info
    main = _layout_of(source, [layer for layer in info.moe_layers if source.layer_layout(layer)])
    mtp = _layout_of(source, list(source.present_mtp_layers()))
    if mtp and {k: v for k, v in mtp.items() if k != "layers"} != {k: v for k, v in main.items() if k != "layers"}:
        main["mtp"] = mtp
    return main


def _layout_of(source, layers: list[int]) -> dict:
    if not layers:
        return {}
    info, lay = source.info, source.info.manifest.experts
    layout = source.required_layout(layers[0])
    here = info.layer_name("layers.{L}.", layers[0])
    pattern = (lambda name: name.replace(here, here[:here.rstrip(".").rfind(".") + 1] + "{L}.", 1))
    out = {"form": layout.kind, "family_usual": lay.form, "prefix": pattern(layout.prefix),
           "biases": source.has_expert_biases()}
    if layout.kind == "per_expert":
        out["pattern"] = pattern(info.expert_names(layers[0], 0)["gate"]).replace(".0.", ".{E}.", 1)
        return out
    out["interleaved_gate_up"] = bool(lay.gate_up_interleaved)
    out["tensors"] = {t.role: pattern(t.name) for t in layout.tensors}
    try:
        orientation = source.orientation
    except KtConvertError as exc:    # undecidable or unreadable: report, don't fail inspect
        out["problem"] = str(exc)
        return out
    out["orientation"] = {t.role: {"stored": stored_label(t.role, orientation[t.role].value),
                                   "orientation": orientation[t.role].value, "why": orientation[t.role].why}
                          for t in layout.tensors}
    for t in layout.tensors:
        out[t.role] = stored_label(t.role, orientation[t.role].value)
    return out

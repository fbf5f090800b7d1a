"""The model's dimensions kt-kernel is started with: SGLang passes config.json's hidden size, routed experts, expert
intermediate size and MoE layers to kt-kernel, which trusts them against the files.

Where from, first found: ``check --model M`` (a folder with config.json, or the file); the launch command's
``--model-path`` when it exists here; the weights folder's own config.json (kt-kernel's converter copies it);
ktconvert.json's ``model``; a GGUF's metadata. The family's manifest (``architecture.resolve``) names the config
keys; a config no manifest covers is read with the common keys. Each value says which key it came from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.architectures.manifests import resolve
from ktconvert.errors import KtConvertError
from ktconvert.launchcheck.readers import Reads

GENERIC_KEYS = {"experts": ("n_routed_experts", "num_experts", "num_local_experts"),
                "intermediate": ("moe_intermediate_size", "intermediate_size"),
                "hidden": ("hidden_size",)}


@dataclass
class ModelDims:
    source: str | None = None
    experts: int | None = None
    intermediate: int | None = None
    hidden: int | None = None
    moe_layers: list[int] | None = None
    how: dict = field(default_factory=dict)
    quantization: dict | None = None
    config_file: str | None = None

    @property
    def known(self) -> bool:
        return self.source is not None

    def to_dict(self) -> dict:
        return {"source": self.source, "experts": self.experts, "intermediate": self.intermediate,
                "hidden": self.hidden, "moe_layers": self.moe_layers, "how": dict(self.how)}


def _config_path(path) -> Path | None:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    return p if p.is_file() else None


def from_config(path: Path, what: str, reads: Reads) -> ModelDims:
    config = reads.json(path, "config.json")
    dims = ModelDims(source=f"{what} ({path})", config_file=str(path))
    if not isinstance(config, dict):
        return dims
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    dims.quantization = text.get("quantization_config") or config.get("quantization_config")
    try:
        info = resolve(config)
        dims.experts, dims.intermediate, dims.hidden = info.n_experts, info.intermediate, info.hidden
        dims.moe_layers = list(info.moe_layers)
        keys = info.manifest.config_keys
        for name, field_name in (("experts", "n_experts"), ("intermediate", "intermediate"), ("hidden", "hidden")):
            key = next((k for k in keys.get(field_name, ()) if k in text), "/".join(keys.get(field_name, ())))
            dims.how[name] = f"config.json {key} ({info.family} family)"
        dims.how["moe_layers"] = f"config.json: {len(info.moe_layers)} MoE layers of {info.n_layers} " \
                                 f"({info.family} family's rule)"
    except (KtConvertError, KeyError, TypeError, ValueError):
        for name, keys in GENERIC_KEYS.items():
            key = next((k for k in keys if type(text.get(k)) is int), None)
            if key is not None:
                setattr(dims, name, text[key])
                dims.how[name] = f"config.json {key} (no family manifest for model_type " \
                                 f"{config.get('model_type')!r}: common keys)"
    return dims


def model_dims(model, launch, weights: Path, identity, manifest: dict | None, reads: Reads) -> tuple[ModelDims, list]:
    """(ModelDims, notes) of the model kt-kernel would be started with (module doc)."""
    notes = []
    if model is not None:
        path = _config_path(model)
        if path is None:
            notes.append(f"--model {model}: no config.json there; the model's dimensions are not checked")
            return ModelDims(), notes
        return from_config(path, "--model", reads), notes
    given = launch.value("model-path") if launch is not None else None
    if given:
        path = _config_path(given)
        if path is not None:
            return from_config(path, f"{launch.spelling('model-path')} of the command", reads), notes
        notes.append(f"{launch.spelling('model-path')} {given} is not a folder here: using what the weights folder "
                     "says of the model instead (give --model to check against the real one)")
    own = _config_path(weights if weights.is_dir() else weights.parent)
    if own is not None:
        notes.append("no --model: the dimensions of the weights folder's own config.json are taken as the model's")
        return from_config(own, "the weights folder's config.json", reads), notes
    if manifest and isinstance(manifest.get("model"), dict):
        m = manifest["model"]
        dims = ModelDims(source="ktconvert.json model", experts=m.get("experts"), intermediate=m.get("intermediate"),
                         hidden=m.get("hidden"), moe_layers=m.get("layers"))
        dims.how = {k: f"ktconvert.json model.{k}" for k in ("experts", "intermediate", "hidden")}
        notes.append("no --model and no config.json: the model's dimensions are ktconvert.json's")
        return dims, notes
    notes.append("no --model and no config.json: the model's dimensions are not checked (give --model MODEL)")
    return ModelDims(), notes


def weight_config(weights: Path, given: str | None, reads: Reads) -> tuple[dict | None, str | None, list[str]]:
    """(quantization_config, the config.json it came from, notes) as kt-kernel's GPTQ loader finds it: it reads
    dirname(weight_path)/config.json first, which for a path given without a trailing slash (`given`: the
    command's --kt-weight-path) is the PARENT folder's, then weight_path/config.json."""
    notes = []
    parent, own = weights.parent / "config.json", weights / "config.json"
    for path in ((own,) if given and given.endswith("/") else (parent, own)):
        if os.path.isfile(path):
            config = reads.json(path, "config.json")
            if path == parent and os.path.isfile(own):
                notes.append(f"kt-kernel's GPTQ loader reads {parent} (the parent folder's) before the weights' own "
                             "config.json when --kt-weight-path has no trailing slash")
            qc = config.get("quantization_config") if isinstance(config, dict) else None
            return (qc if isinstance(qc, dict) else None), str(path), notes
    return None, None, notes

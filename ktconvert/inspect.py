"""`ktconvert inspect`: what a checkpoint is, from its headers and config.json only (no tensor data read).

inspect(path) -> dict (JSON-ready); render(dict) -> text table. Byte accounting uses the family manifest's
[components] regexes (first match wins); tensors of layers >= num_hidden_layers count as "mtp".
"""
from __future__ import annotations

import re
from pathlib import Path

from ktconvert.errors import ManifestError
from ktconvert.methods import all_methods

_DIGITS = re.compile(r"\d+")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _quant_summary(config: dict) -> dict | None:
    """The interesting keys of config.json's quantization_config (or its text_config's), else None."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        qc = next((v["quantization_config"] for v in config.values()
                   if isinstance(v, dict) and isinstance(v.get("quantization_config"), dict)), None)
    if qc is None:
        return None
    out = {k: qc[k] for k in ("quant_method", "format", "fmt", "weight_block_size", "bits", "group_size", "sym",
                              "desc_act", "activation_scheme") if k in qc}
    groups = qc.get("config_groups")
    if isinstance(groups, dict):
        out["config_groups"] = {name: {k: (g.get("weights") or {}).get(k) for k in
                                       ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure")
                                       if (g.get("weights") or {}).get(k) is not None}
                                for name, g in groups.items() if isinstance(g, dict)}
    return out


def _categorise(checkpoint, info) -> dict[str, int]:
    """Bytes per component category. Names are cached with digits replaced by 0 (few distinct shapes)."""
    from ktconvert.architecture import component_of

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
    except Exception as exc:  # quantized without a decoder: report, don't fail inspect
        out["orientation"] = f"unknown ({exc})"
        return out
    out["gate_up"] = "[E, H, 2I]" if fl.gate_up_transposed else "[E, 2I, H]"
    out["down"] = "[E, I, H]" if fl.down_transposed else "[E, H, I]"
    out["biases"] = bool(fl.gate_up_bias or fl.down_bias)
    if fl.ambiguous:
        out["ambiguous"] = [f"{k}: H == {'2I' if k == 'gate_up' else 'I'}, so the shape cannot tell; assumed "
                            f"{out[k]} (manifest's declared orientation, else the other tensor's convention)"
                            for k in fl.ambiguous]
    return out


def kt_methods(source) -> dict[str, str]:
    """kt-kernel method -> "as is (...)" / "convert: ..." / "no: why", for an opened source (the method registry's
    verdicts, kt-format.md §1.1, §2.6-2.8)."""
    return {m.kt_method: m.inspect_line(source) for m in all_methods()}


def inspect(path) -> dict:
    """Describe checkpoint `path` (directory or .safetensors file) from headers + config.json. See render()."""
    from ktconvert.formats.gguf_source import GGUFSource, describe
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.formats.safetensors_reader import Checkpoint

    if GGUFSource.sniff(path):
        source = GGUFSource.open(path)
        return {**describe(source), "path": str(Path(path)), "kt_methods": kt_methods(source)}
    checkpoint = Checkpoint.open(path)
    try:
        source = HFSource.open_checkpoint(checkpoint)
        unsupported = None
    except ManifestError as exc:
        source, unsupported = None, str(exc)
    dtypes: dict[str, int] = {}
    for ref in checkpoint.tensors.values():
        dtypes[ref.dtype] = dtypes.get(ref.dtype, 0) + ref.nbytes
    quant = _quant_summary(checkpoint.config)
    info = source.info if source else None
    out = {
        "path": str(Path(path)),
        "files": len(checkpoint.shards),
        "file_bytes": checkpoint.total_bytes(),
        "tensors": len(checkpoint.tensors),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: -kv[1])),
        "quantization": quant,
        "model_type": checkpoint.config.get("model_type"),
        "components": _categorise(checkpoint, info),
    }
    if source is None:
        out.update(family=None, supported=False, reason=unsupported)
        return out
    dense = [layer for layer in range(info.n_layers) if layer not in set(info.moe_layers)]
    out.update({
        "family": info.family, "supported": True, "input_format": source.input_format,
        "layers": {"total": info.n_layers, "dense": dense, "moe": list(info.moe_layers),
                   "mtp": list(source.present_mtp_layers()), "mtp_in_config": list(info.mtp_layers)},
        "experts": info.n_experts, "experts_per_tok": info.experts_per_tok, "shared_experts": info.n_shared,
        "hidden": info.hidden, "intermediate": info.intermediate,
        "expert_layout": _expert_layout(source),
        "kt_methods": kt_methods(source),
    })
    return out


def _gb(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def render(result: dict) -> str:
    """The inspect dict as an aligned text report."""
    rows = [("path", result["path"]),
            ("files", f"{result['files']} ({_gb(result['file_bytes'])}), {result['tensors']} tensors"),
            ("model_type", str(result.get("model_type"))),
            ("family", str(result.get("family")) if result.get("supported") else f"unsupported: {result['reason']}")]
    rows.append(("dtypes", ", ".join(f"{k} {_gb(v)}" for k, v in result["dtypes"].items())))
    q = result.get("quantization")
    rows.append(("quantization", "none" if not q else ", ".join(f"{k}={v}" for k, v in q.items())))
    if result.get("supported"):
        lay = result["layers"]
        rows += [("input format", result["input_format"]),
                 ("layers", f"{lay['total']}: dense {_ranges(lay['dense'])}; MoE {_ranges(lay['moe'])}; "
                            f"MTP {_ranges(lay['mtp'])}"),
                 ("experts", f"{result['experts']} routed, {result['experts_per_tok']} per token, "
                             f"{result['shared_experts']} shared"),
                 ("H, I", f"hidden {result['hidden']}, expert intermediate {result['intermediate']}")]
        el = result["expert_layout"]
        desc = el["form"] + (f" ({el['pattern']})" if "pattern" in el else "")
        if el["form"] == "fused":
            desc += (f": gate_up {el.get('gate_up', '?')}, down {el.get('down', '?')}"
                     + (", gate/up interleaved" if el.get("interleaved_gate_up") else ""))
            desc += "" if "orientation" not in el else f" {el['orientation']}"
        rows.append(("expert layout", desc + (", with biases" if el.get("biases") else "")))
        rows += [("  note", a) for a in el.get("ambiguous", [])]
    rows.append(("bytes", ""))
    rows += [(f"  {k}", _gb(v)) for k, v in result["components"].items()]
    if result.get("supported"):
        rows.append(("kt-kernel methods", ""))
        rows += [(f"  {k}", v) for k, v in result["kt_methods"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}".rstrip() for k, v in rows)

"""``verify`` of a LLAMAFILE output (routed experts as GGUF, ``formats/gguf_sink.py``).

Structure: the files and tensors the writing sink plans for the manifest's method, layers and model dims
(``GgufSink.planned_files`` / ``layer_tensors``, built without touching the folder) against every ``*.gguf`` in the
folder as gguf-py's ``GGUFReader`` reads it: names, ggml types, shapes, byte counts, file sizes, nothing else.
A llama-quantize mix's down tensors take a type that depends on the model's block count, which the manifest does
not record: there each tensor's type must be one the mix gives that layer for some block count, and the sizes
follow the type found.

Numerics: each sampled expert decoded by gguf-py's ``gguf.quants.dequantize`` (a decoder independent of ktconvert's
quantizer), with a source compared against the source's weights: relative L2 per projection and of the layer's MoE
output on seeded random activations, limited by the type's ``thresholds["moe_rel_l2"]``.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, Keys, quants

from ktconvert.errors import InputError, KtConvertError
from ktconvert.formats.gguf_sink import GgufSink
from ktconvert.quant import ggml_quant
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.verification.numeric_amx import (PROBE, check_layers, choose_experts, choose_layers, numeric_options,
                                                open_checked_source, rel_l2, silu_mul)

PROJS = ("gate", "up", "down")


def dequantize(raw: np.ndarray, ggml_type) -> np.ndarray:
    """One expert's blocks (uint8) of `ggml_type` (a gguf.GGMLQuantizationType) -> float32, flat (gguf-py)."""
    return np.asarray(quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(ggml_type)),
                      dtype=np.float32).reshape(-1)


def planned_sink(manifest: dict, method) -> GgufSink:
    """The sink that wrote the manifest's output, as a plan only (without the non-expert tensors' specs: an
    --include-dense output's shards are then taken from the manifest's files)."""
    model = manifest["model"]
    layers = [int(x) for x in model["layers"]]
    info = SimpleNamespace(n_experts=int(model["experts"]), hidden=int(model["hidden"]),
                           intermediate=int(model["intermediate"]), model_type=str(model.get("model_type", "")),
                           n_layers=max(layers) + 1, mtp_layers=(), experts_per_tok=1)
    return GgufSink(None, method, layers, info, numa=int(manifest["numa"]))


def _allowed_types(method, proj: str, layer: int) -> set[str]:
    """The types the method gives `proj` of `layer` for any block count (one type, but a mix's down tensors)."""
    return {method.expert_type(proj, layer, n) for n in range(layer + 1, 8 * (layer + 2) + 1)}


def check_structure(root, manifest: dict, method) -> tuple[list[str], str]:
    """(problem lines, detail) of the folder's GGUF files against the plan of the manifest's output: the shard
    names and sizes of the sink's plan (an --include-dense output: the manifest's GGUF files), every expert tensor
    once with its type, shape and bytes, split.no / split.count / split.tensors.count as llama.cpp checks them, and
    no tensor the manifest does not record."""
    sink = planned_sink(manifest, method)
    dense = bool(manifest.get("include_dense"))
    if dense:
        planned = {name: None for name in sorted(manifest.get("files", {})) if name.endswith(".gguf")}
    else:
        planned = {name: f.nbytes for name, f in sink.planned_files().items()}
    found = {p.name: p for p in sorted(root.glob("*.gguf"))}
    problems = [f"{name}: missing" for name in planned if name not in found]
    problems += [f"{name}: not a file of this output's plan" for name in found if name not in planned]
    mixed = method.ggml_type != method.base_type()
    expected = {name: (layer, proj, kind, shape) for layer in sink.layers
                for (name, kind, shape), proj in zip(sink.layer_tensors(layer), PROJS)}
    recorded = set(manifest.get("tensors", {}))
    seen: dict[str, str] = {}
    total = 0
    for index, name in enumerate(planned):
        if name not in found:
            continue
        try:
            reader = GGUFReader(found[name])
        except (ValueError, KeyError, IndexError, OSError) as exc:
            problems.append(f"{name}: unreadable GGUF ({exc})")
            continue
        if not mixed and planned[name] is not None and found[name].stat().st_size != planned[name]:
            problems.append(f"{name}: {found[name].stat().st_size} bytes, expected {planned[name]}")
        split = {key: _field(reader, key) for key in (Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT,
                                                      Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)}
        if [split[Keys.Split.LLM_KV_SPLIT_NO], split[Keys.Split.LLM_KV_SPLIT_COUNT]] != [index, len(planned)]:
            problems.append(f"{name}: split.no / split.count {split[Keys.Split.LLM_KV_SPLIT_NO]} / "
                            f"{split[Keys.Split.LLM_KV_SPLIT_COUNT]}, expected {index} / {len(planned)}")
        total = split[Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT] if index == 0 else total
        for t in reader.tensors:
            if t.name in seen:
                problems.append(f"{name}: {t.name}: also in {seen[t.name]}")
            seen[t.name] = name
            if t.name not in expected:
                if not (dense and t.name in recorded):
                    problems.append(f"{name}: {t.name}: not an expected expert tensor")
                continue
            layer, proj, kind, (e, n, k) = expected[t.name]
            got = t.tensor_type.name
            allowed = _allowed_types(method, proj, layer) if mixed else {kind}
            if got not in allowed:
                problems.append(f"{name}: {t.name}: ggml type {got}, expected {' or '.join(sorted(allowed))}")
            elif [int(x) for x in t.shape] != [k, n, e]:
                problems.append(f"{name}: {t.name}: shape {[int(x) for x in t.shape]}, expected {[k, n, e]}")
            elif int(t.n_bytes) != e * n * ggml_quant.row_bytes(got, k):
                want = e * n * ggml_quant.row_bytes(got, k)
                problems.append(f"{name}: {t.name}: {int(t.n_bytes)} bytes, expected {want}")
    problems += [f"{sink.file_of(layer)}: {key}: missing" for key, (layer, *_) in expected.items()
                 if key not in seen and sink.file_of(layer) in found and not dense]
    problems += [f"{key}: missing from every GGUF file" for key in expected if key not in seen and dense]
    if found and planned and total != len(seen) and not [p for p in problems if p.endswith("missing")]:
        problems.append(f"split.tensors.count {total}, the files hold {len(seen)}")
    return problems, (f"{len(planned)} GGUF files, {len(expected)} expert tensors expected, "
                      f"{sum(1 for k in expected if k in seen)} found")


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_numerics(manifest: dict, open_reader, source=None, tokens: int = 8, layers=None, experts="4",
                   threshold=None, seed: int = 0, *, method) -> dict:
    """{"ok", "problems", "summary", "probe", "layers": [{layer, experts, with a source weight_rel_l2 (the worst
    matrix), gate_rel_l2 / up_rel_l2 / down_rel_l2, moe_rel_l2}]}. open_reader() -> (layer, expert) -> {proj:
    float32 matrix} (the method's reader, gguf-py's dequantization, hashes checked against the manifest)."""
    tokens, layers, experts, threshold = numeric_options(tokens, layers, experts, threshold)
    report = {"ok": False, "problems": [], "layers": [], "summary": "numerics not run", "probe": PROBE}
    try:
        model = manifest["model"]
        all_layers = [int(x) for x in model["layers"]]
        hidden, inter, n_experts = int(model["hidden"]), int(model["intermediate"]), int(model["experts"])
        chosen = choose_layers(all_layers, layers)
        read = open_reader()
    except (KeyError, TypeError, ValueError) as exc:
        report["problems"].append(f"ktconvert.json or a GGUF file lacks what the numerics need ({exc!r})")
        return report
    except (KtConvertError, InputError) as exc:
        report["problems"].append(str(exc))
        return report
    src, mismatch = open_checked_source(source, manifest, all_layers, (hidden, inter, n_experts))
    if mismatch:
        report["problems"].append(mismatch)
        return report
    limit = method.thresholds["moe_rel_l2"] if threshold is None else float(threshold)
    rng = np.random.default_rng(seed)
    check_layers(report, chosen, src, limit, lambda layer: _check_layer(
        read, src, layer, choose_experts(rng, n_experts, experts), rng.standard_normal((tokens, hidden))),
        f" ({method.ggml_type})")
    report["ok"] = not report["problems"]
    worst = max((r.get("moe_rel_l2", 0.0) for r in report["layers"]), default=0.0)
    report["summary"] = (f"{len(report['layers'])} layer(s) of {method.ggml_type}, decoded by gguf-py and hashed"
                         + (f"; MoE vs source rel L2 max {worst:.4g} (limit {limit:g})" if src else ""))
    return report


def _check_layer(read, src, layer: int, sample: list[int], x: np.ndarray) -> dict:
    row = {"layer": layer, "experts": list(sample), "problems": []}
    got_y, ref_y = np.zeros_like(x), np.zeros_like(x)
    energy = {p: [0.0, 0.0] for p in PROJS}
    worst = 0.0
    for e in sample:
        try:
            mats = {p: m.astype(np.float64) for p, m in read(layer, e).items()}
        except KtConvertError as exc:
            row["problems"].append(str(exc))
            continue
        if not all(np.isfinite(m).all() for m in mats.values()):
            row["problems"].append(f"expert {e}: NaN or Inf in the decoded weights")
            continue
        got_y += _expert(mats, x)
        if src is None:
            continue
        w = src.read_expert(layer, e)
        ref = {p: bf16_bits_to_f32(getattr(w, p)).astype(np.float64) for p in PROJS}
        ref_y += _expert(ref, x)
        worst = max([worst] + [rel_l2(mats[p], ref[p]) for p in PROJS])
        for p in PROJS:
            energy[p][0] += float(((mats[p] - ref[p]) ** 2).sum())
            energy[p][1] += float((ref[p] ** 2).sum())
    if src is not None:
        row["weight_rel_l2"], row["moe_rel_l2"] = worst, rel_l2(got_y, ref_y)
        row.update({f"{p}_rel_l2": float(np.sqrt(d2 / w2)) if w2 > 0 else 0.0 for p, (d2, w2) in energy.items()})
    return row


def _expert(m: dict, x: np.ndarray) -> np.ndarray:
    return silu_mul(x @ m["gate"].T, x @ m["up"].T) @ m["down"].T

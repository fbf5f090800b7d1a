"""Identify the HF-layout formats kt-kernel reads in place (kt-format.md §2.6-2.7, kt-native-formats.md) from key
patterns, dtypes and shapes: BF16, FP8 (128x128 blocks), FP8_PERCHANNEL, RAWINT4 (compressed-tensors
pack-quantized), GPTQ_INT4, MXFP4, NVFP4, MXFP8; and formats no kt-kernel method reads (AWQ, compressed-tensors
NVFP4, gpt-oss's fused MXFP4), said as such.

Every expert matrix is ``{base}.{block}.E.{proj}.{suffix}`` (block ``mlp.experts``, ``block_sparse_moe.experts``,
``ffn.experts`` or ``experts``; proj ``gate_proj/up_proj/down_proj`` or ``w1/w3/w2``) or, for BF16, the packed
``{base}.mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]. I is gate's output rows, H down's: so every
matrix's k is known and the packing (bytes per weight) and the group size (k / scale columns) follow from shapes.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.launchcheck.identity import Identity, LayerSummary, consolidate, expert_range
from ktconvert.launchcheck.identify_kt import _ranges
from ktconvert.methods import all_methods

EXPERT_KEY = re.compile(r"^(?P<base>(?:.*\.)?layers)\.(?P<layer>\d+)\.(?P<block>mlp\.experts|block_sparse_moe\.experts|"
                        r"ffn\.experts|experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\."
                        r"(?P<suffix>[A-Za-z0-9_]+)$")
PACKED_KEY = re.compile(r"^(?P<base>(?:.*\.)?layers)\.(?P<layer>\d+)\.mlp\.experts\.(?P<name>gate_up_proj|down_proj|"
                        r"gate_up_proj_blocks|gate_up_proj_scales|down_proj_blocks|down_proj_scales)$")
PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# the key names each kt-kernel loader reads: {method: {(block, projection style)}} (utils/loader.py, 0.7.2)
HF_NAMING = {("mlp.experts", "_proj"), ("block_sparse_moe.experts", "w"), ("experts", "w")}
LOADER_NAMING = {"MXFP4": {("ffn.experts", "w")}, "MXFP8": {("block_sparse_moe.experts", "w")},
                 "NVFP4": {("mlp.experts", "_proj")}, "RAW": {("mlp.experts", "_proj")}}
GROUPED = ("MXFP4", "NVFP4", "MXFP8", "GPTQ_INT4", "RAW")


def registered_with(suffix: str, dtype: str) -> type | None:
    """The registered in-place method whose tensors include (suffix, dtype), asked of the registry."""
    for method in all_methods():
        if method.writable and not method.needs_conversion \
                and method.tensor_specs(256, 256).get(suffix, ("",))[0] == dtype:
            return method
    return None


def _names() -> dict[str, tuple[str, type | None]]:
    """{format label: (kt-kernel method name, registered class or None)}."""
    by_kt = {m.kt_method: m for m in all_methods() if m.writable and not m.needs_conversion}
    bf16, fp8, raw = (registered_with(*spec) for spec in (("weight", "BF16"), ("weight_scale_inv", "F32"),
                                                         ("weight_packed", "I32")))
    return {"BF16": (bf16.kt_method if bf16 else "BF16", bf16), "FP8": (fp8.kt_method if fp8 else "FP8", fp8),
            "RAW": (raw.kt_method if raw else "", raw),
            **{label: (label, by_kt.get(label))
               for label in ("FP8_PERCHANNEL", "GPTQ_INT4", "MXFP4", "NVFP4", "MXFP8")}}


def hf_entries(headers) -> tuple[dict, dict]:
    """({layer: {(expert, proj): {suffix: TensorRef}}}, {layer: {name: TensorRef}} of packed 3-D experts), plus the
    naming seen, from the shard headers."""
    per_matrix: dict = defaultdict(lambda: defaultdict(dict))
    packed: dict = defaultdict(dict)
    naming: dict = {}
    for header in headers:
        for name, ref in header.tensors.items():
            m = EXPERT_KEY.match(name)
            if m:
                layer = int(m["layer"])
                per_matrix[layer][(int(m["expert"]), PROJ[m["proj"]])][m["suffix"]] = ref
                naming.setdefault(layer, (m["base"], m["block"], "_proj" if m["proj"].endswith("_proj") else "w"))
                continue
            m = PACKED_KEY.match(name)
            if m:
                packed[int(m["layer"])][m["name"]] = ref
                naming.setdefault(int(m["layer"]), (m["base"], "mlp.experts", "packed"))
    return {k: dict(v) for k, v in per_matrix.items()}, {"packed": dict(packed), "naming": naming}


def classify(stored: dict) -> str:
    """The format label of one matrix's tensors {suffix: TensorRef}."""
    dt = {s: r.dtype for s, r in stored.items()}
    if "qweight" in dt and "scales" in dt:
        q, s = stored["qweight"].shape, stored["scales"].shape
        return "GPTQ_INT4" if len(q) == 2 and len(s) == 2 and s[1] == q[1] else "AWQ"
    if "weight_packed" in dt:
        return "CT-NVFP4" if "weight_global_scale" in dt else "RAW"
    weight = dt.get("weight")
    if weight == "BF16" and len(dt) == 1:
        return "BF16"
    if weight in ("F16", "F32") and len(dt) == 1:
        return "F16/F32"
    if weight == "F8_E4M3":
        if dt.get("weight_scale_inv") == "U8":
            return "MXFP8"
        scale = stored.get("weight_scale_inv") or stored.get("weight_scale")
        if scale is None:
            return "unknown"
        shape, n = tuple(scale.shape), stored["weight"].shape[0]
        if shape in ((n,), (n, 1)) and "weight_scale_inv" not in dt:
            return "FP8_PERCHANNEL"
        return "FP8" if len(shape) == 2 else "FP8 per-tensor"
    if weight in ("U8", "I8") and "weight_scale" in dt and "weight_scale_2" in dt:
        return "NVFP4"
    if weight in ("U8", "I8") and "scale" in dt:
        return "MXFP4"
    return "unknown"


def rows(label: str, stored: dict) -> int:
    """Output rows N of a matrix of format `label`."""
    if label in ("GPTQ_INT4", "AWQ"):
        q = stored["qweight"].shape
        return q[1] if label == "GPTQ_INT4" else q[0]
    main = stored.get("weight_packed") or stored.get("weight")
    return main.shape[0] if main is not None and main.shape else 0


def detail(label: str, stored: dict, k: int) -> tuple[int | None, dict, list[str]]:
    """(group size, facts, problems) of one matrix of format `label` whose input dimension is k."""
    facts, problems = {}, []
    dt = {s: r.dtype for s, r in stored.items()}
    gs = None
    if label == "GPTQ_INT4":
        q, s = stored["qweight"].shape, stored["scales"].shape
        if q[0] * 8 != k:
            problems.append(f"qweight rows {q[0]} are not k/8 = {k}/8 (not 4-bit GPTQ)")
        gs = k // s[0] if s[0] and k % s[0] == 0 else None
        facts.update(scale_dtype=dt["scales"], qzeros="qzeros" in dt, g_idx="g_idx" in dt)
    elif label in ("RAW", "CT-NVFP4"):
        w, s = stored["weight_packed"], stored.get("weight_scale")
        per = {"I32": 8, "U8": 2, "I8": 2}.get(w.dtype, 0)
        if w.shape[-1] * per != k:
            problems.append(f"weight_packed {w.dtype} {list(w.shape)} does not hold 4-bit values of k = {k} "
                            f"({32 * w.shape[-1] // k if w.dtype == 'I32' and k else '?'}-bit packing?)")
        if s is not None and len(s.shape) == 2 and s.shape[1]:
            gs = k // s.shape[1]
        facts.update(scale_dtype=dt.get("weight_scale"), zero_point="weight_zero_point" in dt,
                     g_idx="weight_g_idx" in dt)
        if label == "RAW":
            if dt.get("weight_scale") != "BF16":
                problems.append(f"weight_scale is {dt.get('weight_scale')}: kt-kernel asserts BF16 scales")
            if "weight_zero_point" in dt:
                problems.append(("weight_zero_point: asymmetric int4, which kt-kernel reads as symmetric", "garbage"))
            if "weight_g_idx" in dt:
                problems.append(("weight_g_idx (activation order): kt-kernel reads the columns in stored order",
                                 "garbage"))
    elif label in ("MXFP4", "NVFP4", "MXFP8"):
        w = stored["weight"]
        scale = stored["scale" if label == "MXFP4" else "weight_scale" if label == "NVFP4" else "weight_scale_inv"]
        per = 1 if label == "MXFP8" else 2
        if w.shape[-1] * per != k:
            problems.append(f"weight {w.dtype} {list(w.shape)} does not hold {'8' if per == 1 else '4'}-bit values "
                            f"of k = {k}")
        gs = k // scale.shape[-1] if len(scale.shape) == 2 and scale.shape[-1] else None
        facts["scale_dtype"] = scale.dtype
    elif label == "FP8":
        scale = stored.get("weight_scale_inv") or stored["weight_scale"]
        n = stored["weight"].shape[0]
        if len(scale.shape) == 2 and all(scale.shape):
            facts["block"] = [-(-n // scale.shape[0]), -(-k // scale.shape[1])]
        facts["scale_suffix"] = "weight_scale_inv" if "weight_scale_inv" in stored else "weight_scale"
        facts["scale_dtype"] = scale.dtype
    elif label == "FP8_PERCHANNEL":
        facts["scale_dtype"] = stored["weight_scale"].dtype
    return gs, facts, problems


def identify_hf(folder: Path, per_matrix: dict, extra: dict) -> Identity:
    """Identity of the per-expert (or packed) HF expert tensors found by hf_entries."""
    names = _names()
    summaries, facts, problems, groups = [], {}, [], {}
    for layer in sorted(set(per_matrix) | set(extra["packed"])):
        if layer in extra["packed"] and layer not in per_matrix:
            summaries.append(_packed_layer(layer, extra["packed"][layer], problems))
            continue
        matrices = per_matrix[layer]
        experts = expert_range({e for e, _ in matrices}, layer, str(folder))
        for e in range(experts):
            for proj in ("gate", "up", "down"):
                if (e, proj) not in matrices:
                    raise _input_error(folder, f"layer {layer}: expert {e} has no {proj} projection")
        labels = {classify(stored) for stored in matrices.values()}
        if len(labels) > 1:
            raise _input_error(folder, f"layer {layer}: experts stored in several formats "
                                       f"({', '.join(sorted(labels))})")
        label = labels.pop()
        inter, hidden = rows(label, matrices[(0, "gate")]), rows(label, matrices[(0, "down")])
        gs_seen = set()
        for (e, proj), stored in matrices.items():
            n, k = (inter, hidden) if proj != "down" else (hidden, inter)
            if rows(label, stored) != n:
                raise _input_error(folder, f"layer {layer}: expert {e} {proj} has {rows(label, stored)} rows, expert 0 "
                                           f"{n}")
            gs, f, p = detail(label, stored, k)
            gs_seen.add(gs)
            facts.update(f)
            problems += [_where(f"layer {layer} expert {e} {proj}: ", x) for x in p]
        if len(gs_seen) > 1:
            problems.append((f"layer {layer}: group sizes differ between projections ({sorted(map(str, gs_seen))}): "
                             "kt-kernel takes gate's for all three", "garbage"))
        gs = next(iter(gs_seen)) if label in GROUPED else None
        groups[layer] = gs
        summaries.append(LayerSummary(layer, label, experts, hidden, inter, None, gs, {}))
    common = consolidate(str(folder), summaries)
    layers = [s.layer for s in summaries]
    kt, registered = names.get(common.label, (None, None))
    identity = Identity(str(folder), "HF safetensors", kt or None, layers, common.experts, common.intermediate,
                        common.hidden, group_size=common.group_size, registered=registered,
                        facts={**facts, "format": common.label}, problems=_dedupe(problems),
                        source=("hf", per_matrix))
    _explain(identity, common, extra["naming"], layers)
    return identity


def _packed_layer(layer: int, tensors: dict, problems: list) -> LayerSummary:
    gate_up, down = tensors.get("gate_up_proj"), tensors.get("down_proj")
    if gate_up is None or down is None or len(gate_up.shape) != 3 or len(down.shape) != 3:
        label = "gpt-oss fused" if any(n.endswith(("_blocks", "_scales")) for n in tensors) else "fused (partial)"
        return LayerSummary(layer, label, 0, 0, 0)
    (e, a, b), (_, c, d) = gate_up.shape, down.shape
    if (a, b) == (2 * d, c):
        inter, hidden = d, c
    else:
        inter, hidden = c, b // 2 if b % 2 == 0 else 0
        problems.append((f"layer {layer}: gate_up_proj is [E, H, 2I] {list(gate_up.shape)}; kt-kernel's BF16 loader "
                         "reads the packed form as [E, 2I, H]", "garbage"))
    label = "BF16" if gate_up.dtype == "BF16" and down.dtype == "BF16" else f"packed {gate_up.dtype}"
    return LayerSummary(layer, label, e, hidden, inter, None, None, {})


def _explain(identity: Identity, common: LayerSummary, naming: dict, layers: list[int]) -> None:
    """Fill identity.how / notes / problems from the format label and the key names."""
    label, how = common.label, identity.how
    identity.facts["evidence"] = _LABEL_HOW.get(label, label)
    base, block, style = naming.get(layers[0], ("", "", ""))
    how["method"] = f"{identity.method or 'no kt-kernel method'}: {_LABEL_HOW.get(label, label)}; keys " \
                    f"{base}.L.{block}" + (".{gate_up_proj,down_proj}" if style == "packed" else
                                           ".E." + ("{gate,up,down}_proj" if style == "_proj" else "{w1,w3,w2}"))
    how["experts"] = f"{common.experts} per layer: expert ids 0..{common.experts - 1}"
    how["intermediate"] = f"{common.intermediate}: output rows of gate"
    how["hidden"] = f"{common.hidden}: output rows of down"
    how["layers"] = f"{len(layers)} MoE layers: " + _ranges(layers)
    if common.group_size is not None:
        how["group_size"] = f"{common.group_size}: k / scale columns of each matrix"
    identity.facts["naming"] = f"{base}.L.{block}" + ("" if style == "packed" else f" ({style} names)")
    wanted = LOADER_NAMING.get(label, HF_NAMING if label in ("BF16", "FP8", "FP8_PERCHANNEL", "GPTQ_INT4") else None)
    if wanted is not None and style != "packed" and (block, style) not in wanted:
        looks = " or ".join(f"{b}.E." + ("{gate,up,down}_proj" if s == "_proj" else "{w1,w3,w2}")
                            for b, s in sorted(wanted))
        identity.problems.append(f"keys {base}.L.{block}.E.* ({style} names): kt-kernel's {identity.method} loader "
                                 f"looks for {looks} and finds no experts")
    if label == "F16/F32":
        identity.notes.append("the experts are F16 / F32: kt-kernel's BF16 method expects BF16 tensors (convert with "
                              "`ktconvert cpu SRC OUT --method bf16`)")
    if label in ("AWQ", "CT-NVFP4", "gpt-oss fused", "unknown", "FP8 per-tensor") or \
            label.startswith(("packed", "fused")):
        identity.problems.append(f"{_LABEL_HOW.get(label, label)}: no kt-kernel method reads this layout")


_LABEL_HOW = {
    "BF16": "BF16 weight tensors",
    "F16/F32": "F16 / F32 weight tensors",
    "FP8": "F8_E4M3 weight + 2-D block scale",
    "FP8_PERCHANNEL": "F8_E4M3 weight + per-row weight_scale [N] / [N, 1]",
    "RAW": "compressed-tensors pack-quantized int4: weight_packed + BF16 weight_scale [N, k/group]",
    "GPTQ_INT4": "GPTQ qweight int32 [k/8, N] + scales [k/group, N]",
    "MXFP4": "E2M1 nibbles weight [N, k/2] + E8M0 scale [N, k/group]",
    "NVFP4": "E2M1 nibbles weight [N, k/2] + E4M3 weight_scale [N, k/group] + F32 weight_scale_2",
    "MXFP8": "F8_E4M3 weight + U8 (E8M0) weight_scale_inv [N, k/group]",
    "FP8 per-tensor": "F8_E4M3 weight + one scale per tensor",
    "AWQ": "AWQ qweight int32 [k, N/8] + scales [k/group, N]",
    "CT-NVFP4": "compressed-tensors NVFP4 (weight_packed + weight_global_scale)",
    "gpt-oss fused": "gpt-oss fused MXFP4 (gate_up_proj_blocks / _scales)",
    "unknown": "expert tensors of no known format",
}


def _where(prefix: str, problem):
    return prefix + problem if isinstance(problem, str) else (prefix + problem[0], problem[1])


def _dedupe(lines: list, limit: int = 3) -> list:
    """The first `limit` problems of each kind (text after the "layer L expert E proj: " part), and how many more."""
    out, seen, dropped = [], {}, 0
    for line in lines:
        text = line if isinstance(line, str) else line[0]
        kind = text.split(": ", 1)[-1]
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= limit:
            out.append(line)
        else:
            dropped += 1
    return out + ([(f"... and {dropped} more like these", "")] if dropped else [])


def _input_error(folder: Path, message: str) -> InputError:
    return InputError(message, file=str(folder), hint="an incomplete or mixed folder")

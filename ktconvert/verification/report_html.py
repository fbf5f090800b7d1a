"""``verify --report FILE.html``: what ``verify`` measured, as one self-contained page (``ktconvert.util.svg_report``).

The page, in order:

* the verdict (OK, or FAILED with every problem line), what was verified (the output's ``ktconvert.json``: kind,
  method, NUMA count, layout, quantizer, model) and the table of checks as ``verify`` printed it;
* one part per **error group**: the per-layer numbers one numeric check produced (``error_groups``). Today: the CPU
  experts' numerics (``result["numerics"]``; random probe vectors, or calibration tokens where that check ran:
  its ``probe`` names the kind), a GPU checkpoint's decompressed experts (``result["gpu"]["errors"]``) and its
  dequantized FP8 linears (``result["gpu"]["errors"]["linears"]``). Each
  part says what the numbers were measured on, draws the per-layer error curve (gate / up / down / MoE relative
  L2, the limit dashed), lists the layers, draws a layer x expert heat map of the sampled experts' error and names
  the worst experts;
* the thresholds of every group and what ran the numerics (native implementation, tokens, seed).

A numeric check plugs in by reporting per-layer rows (``"layers"``: ``{"layer", "<series>_rel_l2": float, ...}``,
or ``"outputs": {name: {"moe_rel_l2"}}`` for several outputs compared side by side), optionally
``"expert_errors": [{"expert", "rel_l2"}]`` per row, and a ``"probe"`` kind. Rows whose problems start with
``"layer L:"`` in the report's ``problems`` are marked failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert import __version__

from ktconvert.util import svg_report as html
from ktconvert.errors import KtConvertError, OutputError, UsageError
from ktconvert.formats.fileio import write_atomic
from ktconvert.formats.out_manifest import MANIFEST_NAME, load_manifest

MAX_WORST = 10
# row key -> legend name of the per-layer error curve, in drawing order
SERIES = (("gate_rel_l2", "gate"), ("up_rel_l2", "up"), ("down_rel_l2", "down"), ("moe_rel_l2", "MoE"))
KERNEL_SERIES = (("kernel_rel", "kernel vs numpy (projections)"), ("moe_kernel_rel", "kernel vs numpy (MoE)"))
THRESHOLD_MEANING = {
    "moe_rel_l2": "largest relative L2 of a layer's MoE output against the source weights",
    "moe_cosine": "smallest cosine of a layer's MoE output with the source weights' output",
    "kernel_rel": "largest relative L2 of the native kernels against numpy's dequantization of the same bytes",
    "limit": "largest relative L2 of one decompressed expert matrix against the source",
    "fp8_linear_rel_l2": "largest relative L2 of one dequantized FP8 linear against the source",
}
PROBES = {
    "random": "random probe vectors: seeded Gaussian activations, each token routed to top-k of the layer's "
              "sampled experts",
    "calibration": "calibration tokens: the hidden states real text gives at each layer, routed by the model's own "
                   "router",
}


@dataclass
class ErrorGroup:
    """The per-layer numbers of one numeric check.

    key: the data-group of its plots ("cpu", "gpu"); probe: what the numbers were measured on; rows: per checked
    layer {"layer", "ok", "errors": {legend name: relative L2}, "cosine": float | None, "sampled": int | None
    (experts run one by one), "tokens": int | None (a calibrated check: every expert the router picks)};
    experts: (layer, expert, relative L2) of every sampled expert; expert_measure: what an expert's number is;
    limits: {legend name: y} of the curve's dashed lines; thresholds: {name: value} the check used."""

    key: str
    title: str
    probe: str
    rows: list[dict] = field(default_factory=list)
    experts: list[tuple[int, int, float]] = field(default_factory=list)
    expert_measure: str = ""
    limits: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)
    facts: list[tuple[str, object]] = field(default_factory=list)
    no_experts: str = "No per-expert error (no source weights to compare with)."
    tables: list[str] = field(default_factory=list)     # further HTML tables, after the layer table
    curve: bool = True                                  # draw the per-layer curve (False: the tables say it all)


# ---------------------------------------------------------------------------------------------- the groups

def error_groups(result: dict, manifest: dict | None) -> list[ErrorGroup]:
    """The error groups of a verify result (``verification.run.verify``'s dict), in page order."""
    groups = []
    if isinstance(result.get("numerics"), dict):
        groups.append(_numerics_group(result["numerics"], manifest))
    gpu_errors = (result.get("gpu") or {}).get("errors") or {}
    if gpu_errors.get("layers"):
        groups.append(_gpu_group(gpu_errors, manifest))
    if (gpu_errors.get("linears") or {}).get("modules"):
        groups.append(_linears_group(gpu_errors["linears"]))
    return groups


def _numerics_group(numerics: dict, manifest: dict | None) -> ErrorGroup:
    probe = str(numerics.get("probe", "random"))
    method = numerics.get("method") or (manifest or {}).get("method", "")
    group = ErrorGroup("cpu", f"CPU experts ({method})" if method else "CPU experts", _probe_text(probe, numerics),
                       thresholds=dict(numerics.get("thresholds") or {}))
    failed = _failed_layers(numerics.get("problems", []))
    names = _output_names(numerics)
    for row in numerics.get("layers", []):
        errors = _row_errors(row, names)
        if not errors:
            errors = {label: float(row[key]) for key, label in KERNEL_SERIES if _is_number(row.get(key))}
        group.rows.append({"layer": int(row["layer"]), "ok": row["layer"] not in failed, "errors": errors,
                           "cosine": row.get("moe_cosine"),
                           "sampled": len(row["experts"]) if "experts" in row else None,
                           "tokens": row.get("tokens") if "experts" not in row else None})
        group.experts += [(int(row["layer"]), int(x["expert"]), float(x["rel_l2"]))
                          for x in row.get("expert_errors", [])]
    group.expert_measure = "relative L2 of the expert's output against the source weights' output on the probes"
    moe_limit = group.thresholds.get("moe_rel_l2")
    if moe_limit is not None and any(name.startswith("MoE") for r in group.rows for name in r["errors"]):
        group.limits["MoE limit"] = moe_limit
    elif any(r["errors"] for r in group.rows) and group.thresholds.get("kernel_rel") is not None:
        group.limits["kernel limit"] = group.thresholds["kernel_rel"]
    group.facts = [(name, numerics[key]) for name, key in (("native implementation", "variant"),
                                                           ("probe tokens per layer", "tokens"), ("seed", "seed"))
                   if key in numerics]
    calibration = numerics.get("calibration") or {}
    if calibration:
        facts = [("calibration file", Path(calibration["file"]).name if calibration.get("file") else None),
                 ("samples", calibration.get("samples")), ("tokens", calibration.get("tokens")),
                 ("routing", "the model's own router, every expert it picks")]
        group.facts += [(name, value) for name, value in facts if value is not None]
    for key, path in (numerics.get("outputs") or {}).items():
        group.facts.append((f"output {names.get(key, key)}", path))
    if any(r["errors"] for r in group.rows) and probe == "calibration":
        group.no_experts = "No per-expert error: this check measures each layer's whole MoE output on the " \
                           "calibration tokens (every expert the router picks), not experts one by one."
    return group


def _output_names(numerics: dict) -> dict:
    """{key of a compared output: its legend name}: "out" and "compare" with their folders' names where the
    result names them (verify --compare), else the keys."""
    outputs = numerics.get("outputs") or {}
    names = {}
    for key, path in outputs.items():
        folder = Path(str(path)).name
        names[key] = f"{key}: {folder}" if folder and folder != key else key
    return names


def _gpu_group(errors: dict, manifest: dict | None) -> ErrorGroup:
    scheme = (manifest or {}).get("method", "")
    group = ErrorGroup("gpu", f"GPU experts ({scheme})" if scheme else "GPU experts",
                       "weights only: the first sampled experts of each MoE layer decompressed by compressed-tensors "
                       "and compared matrix by matrix with the source weights (no activations)",
                       thresholds={"limit": errors.get("limit")})
    worst_layer = {}
    for x in errors.get("experts", []):
        group.experts.append((int(x["layer"]), int(x["expert"]), float(x["rel_l2"])))
        worst_layer[x["layer"]] = max(worst_layer.get(x["layer"], 0.0), float(x["rel_l2"]))
    limit = errors.get("limit")
    for row in errors["layers"]:
        layer = row["layer"]
        errs = {p: float(row[p]) for p in ("gate", "up", "down") if _is_number(row.get(p))}
        group.rows.append({"layer": layer, "ok": limit is None or worst_layer.get(layer, 0.0) <= limit,
                           "errors": errs, "cosine": None, "tokens": None,
                           "sampled": sum(1 for x in errors.get("experts", []) if x["layer"] == layer)})
    group.expert_measure = "relative L2 of the expert's worst matrix against the source"
    if limit is not None:
        group.limits["matrix limit"] = limit
    group.facts = [("matrices compared", errors.get("matrices", 0)), ("mean relative L2", errors.get("mean_rel_l2")),
                   ("max relative L2", errors.get("max_rel_l2"))]
    return group


def _linears_group(linears: dict) -> ErrorGroup:
    """The GPU checkpoint's FP8 linears: per checked layer the worst and the mean linear, and every linear's
    number in a table."""
    limit = linears.get("limit")
    group = ErrorGroup("linears", "FP8 linears", "weights only: each block-FP8 linear of the first, middle and "
                       "last layers dequantized (E4M3 codes x their 128x128 block's weight_scale_inv) and compared "
                       "with the source weights (no activations)", thresholds={"fp8_linear_rel_l2": limit})
    modules = linears["modules"]
    by_layer: dict = {}
    for m in modules:
        if m.get("layer") is not None:
            by_layer.setdefault(int(m["layer"]), []).append(float(m["rel_l2"]))
    for layer, errs in sorted(by_layer.items()):
        group.rows.append({"layer": layer, "ok": limit is None or max(errs) <= limit, "cosine": None, "tokens": None,
                           "sampled": None, "errors": {"worst linear": max(errs), "mean": float(np.mean(errs))}})
    if limit is not None:
        group.limits["FP8 linear limit"] = limit
    group.no_experts = "Linears are not experts: one number per linear, listed below."
    group.curve = False         # a few layers only: the tables show them
    group.tables.append(html.table(["linear", "layer", "relative L2"],
                                   [[m["module"], "" if m.get("layer") is None else m["layer"], float(m["rel_l2"])]
                                    for m in modules], caption="every FP8 linear compared"))
    group.facts = [("linears compared", len(modules)), ("max relative L2", linears.get("max_rel_l2"))]
    return group


def _row_errors(row: dict, names: dict | None = None) -> dict:
    """{legend name: relative L2} of one layer row: the SERIES keys, then one MoE error per compared output
    (named by `names`, {key: legend name}, else its key)."""
    errors = {label: float(row[key]) for key, label in SERIES if _is_number(row.get(key))}
    for key, output in (row.get("outputs") or {}).items():
        if _is_number(output.get("moe_rel_l2")):
            errors[f"MoE ({(names or {}).get(key, key)})"] = float(output["moe_rel_l2"])
    return errors


def _probe_text(probe: str, numerics: dict) -> str:
    text = PROBES.get(probe, probe)
    calibration = numerics.get("calibration") or {}
    if probe == "calibration" and calibration:
        text += f" ({calibration.get('tokens')} tokens from {calibration.get('samples')} samples" + \
                (f" of {Path(calibration['file']).name}" if calibration.get("file") else "") + ")"
    elif probe == "random" and "tokens" in numerics:
        text += f" ({numerics['tokens']} tokens per layer, seed {numerics.get('seed', 0)})"
    if not any(_row_errors(r) for r in numerics.get("layers", [])):
        text += ". No source weights were given (--source): only the native kernels against numpy's dequantization " \
                "of the same bytes, and the hashes"
    return text


def _failed_layers(problems: list) -> set[int]:
    failed = set()
    for line in problems:
        head, _, rest = str(line).partition(":")
        if head.startswith("layer ") and rest and head[6:].isdigit():
            failed.add(int(head[6:]))
    return failed


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------- the page

def build_report(result: dict, manifest: dict | None = None) -> str:
    """The HTML page (a string) of verify result `result`; `manifest`: the output's ktconvert.json (None: read
    from result["out"] when it is a folder holding one)."""
    manifest = manifest if manifest is not None else read_manifest(result.get("out", ""))
    groups = error_groups(result, manifest)
    sections = [_verdict(result, manifest)] + [_group_section(g, manifest) for g in groups]
    sections.append(_thresholds_section(groups))
    title = f"ktconvert verify: {Path(str(result.get('out', ''))).name or result.get('out', '')}"
    return html.page(title, sections, subtitle=f"{result.get('out', '')} (ktconvert {__version__})")


def read_manifest(out) -> dict | None:
    """OUT's ktconvert.json, or None where OUT is no folder with a readable one (a bundle, a hub repo)."""
    try:
        return load_manifest(out) if (Path(out) / MANIFEST_NAME).is_file() else None
    except (KtConvertError, OSError):
        return None


def _verdict(result: dict, manifest: dict | None) -> str:
    problems = result.get("problems", [])
    verdict = html.status(bool(result.get("ok")), "verification OK" if result.get("ok") else
                          f"verification FAILED: {html.count(len(problems), 'problem line')}")
    parts = [verdict]
    if problems:
        parts.append(html.bullets(problems))
    parts.append(html.table(["", "value"], _output_rows(manifest)) if manifest else
                 "<p>No readable ktconvert.json: the output itself is not described.</p>")
    checks = [[c["name"], c["status"], c.get("detail", "")] for c in result.get("checks", [])]
    parts.append(html.table(["check", "status", "detail"], checks, caption="checks, in the order verify ran them"))
    return html.section("Verdict", *parts)


def _output_rows(manifest: dict) -> list[list]:
    model = manifest.get("model") or {}
    keys = ("kind", "method", "layout", "quant", "group_size") if manifest.get("kind") == "gpu" else \
        ("kind", "method", "numa", "layout", "quant", "group_size")          # a GPU checkpoint has no NUMA count
    rows = [[key, manifest[key]] for key in keys if manifest.get(key) is not None]
    rows += [["family", f"{model.get('family', '')} ({model.get('model_type', '')})"],
             ["MoE layers", len(model.get("layers", []))], ["routed experts per layer", model.get("experts", "")],
             ["hidden, intermediate", f"{model.get('hidden', '')}, {model.get('intermediate', '')}"],
             ["files", len(manifest.get("files", {}))], ["written by", f"ktconvert {manifest.get('tool_version', '')}"]]
    return rows


def _group_section(group: ErrorGroup, manifest: dict | None) -> str:
    parts = [f"<p>Measured on {html.esc(group.probe)}.</p>"]
    series = {name: [(r["layer"], r["errors"][name]) for r in group.rows if name in r["errors"]]
              for name in _series_names(group)}
    if series and group.curve:
        parts.append(html.line_chart(series, title=f"Relative L2 error per layer: {group.title}", x_label="layer",
                                     y_label="relative L2", y_min=0, limits=group.limits, group=group.key))
    parts.append(_layer_table(group))
    if group.experts:
        parts.append(_heat_map(group, manifest))
        parts.append(_worst_table(group))
    else:
        parts.append(f"<p>{html.esc(group.no_experts)}</p>")
    parts += group.tables
    return html.section(f"Error per layer: {group.title}", *parts)


def _series_names(group: ErrorGroup) -> list[str]:
    names = []
    for row in group.rows:
        names += [name for name in row["errors"] if name not in names]
    return names


def _layer_table(group: ErrorGroup) -> str:
    names = _series_names(group)
    cosine = any(r["cosine"] is not None for r in group.rows)
    what = [(key, title) for key, title in (("sampled", "experts sampled"), ("tokens", "calibration tokens"))
            if any(r.get(key) is not None for r in group.rows)]
    header = ["layer", "status"] + [title for _, title in what] + [f"{n} rel L2" for n in names]
    header += ["MoE cosine"] if cosine else []
    rows = [[r["layer"], "ok" if r["ok"] else "FAILED"] + [r.get(key, "") for key, _ in what]
            + [r["errors"].get(n, float("nan")) for n in names] + ([r["cosine"]] if cosine else [])
            for r in group.rows]
    return html.table(header, rows)


def _heat_map(group: ErrorGroup, manifest: dict | None) -> str:
    layers = [r["layer"] for r in group.rows]
    n_experts = int(((manifest or {}).get("model") or {}).get("experts") or 0)
    n_experts = max(n_experts, 1 + max(e for _, e, _ in group.experts))
    values = np.full((len(layers), n_experts), np.nan)
    row_of = {layer: i for i, layer in enumerate(layers)}
    for layer, e, rel in group.experts:
        if layer in row_of:
            values[row_of[layer], e] = rel
    limit = next((float(v) for v in group.limits.values() if _is_number(v) and v > 0), None)
    finite = values[np.isfinite(values)]
    top = limit if limit is not None else (float(finite.max()) if finite.size and finite.max() > 0 else 1.0)
    scale = f"0 (dark) to {html.fmt(top)}" + (f", the {next(iter(group.limits))} (bright; above it: as bright)"
                                               if limit is not None else ", the largest value (bright)")
    return html.heat_map(values, row_labels=layers, title="Sampled experts' error", x_label="expert",
                         y_label="layer", value_label="relative L2", group=group.key, scale=(0.0, top),
                         caption=f"Each cell: {group.expert_measure}. Colour: {scale}. Hatched: not sampled.")


def _worst_table(group: ErrorGroup) -> str:
    worst = sorted(group.experts, key=lambda x: (-x[2], x[0], x[1]))[:MAX_WORST]
    rows = [[rank, layer, e, rel] for rank, (layer, e, rel) in enumerate(worst, 1)]
    return html.table(["rank", "layer", "expert", "relative L2"], rows,
                      caption=f"worst sampled experts ({group.expert_measure})")


def _thresholds_section(groups: list[ErrorGroup]) -> str:
    if not groups:
        return html.section("Method and thresholds", "<p>No numeric check ran.</p>")
    rows = [[g.title, name, value, THRESHOLD_MEANING.get(name, "")] for g in groups
            for name, value in g.thresholds.items() if value is not None]
    facts = [[g.title, name, value] for g in groups for name, value in g.facts if value is not None]
    return html.section("Method and thresholds", html.table(["group", "threshold", "value", "meaning"], rows),
                        html.table(["group", "", "value"], facts, caption="how the numerics ran"),
                        note="A layer fails when its numbers cross a threshold; the verdict lists each such line.")


# ---------------------------------------------------------------------------------------------- the file

def check_target(path, out) -> Path:
    """`path` as the report's file, checked before verify runs: its folder exists, it is no folder, and it lies
    outside the output folder `out` (a file there would make OUT's own structure check fail)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError("the report path is a folder", file=str(path), expected="a file name such as verify.html")
    if not path.parent.is_dir():
        raise OutputError("folder does not exist", file=str(path.parent))
    out_dir = Path(str(out))
    if out_dir.is_dir() and out_dir.resolve() in path.resolve().parents:
        raise UsageError("the report would be written into the output folder it verifies", file=str(path),
                         hint="write it next to the output folder")
    return path


def write_report(path, result: dict, manifest: dict | None = None) -> Path:
    """Write the page (build_report) to `path` atomically (temporary name, then renamed); returns the path."""
    path = Path(path)
    write_atomic(path, build_report(result, manifest).encode("utf-8"))
    return path

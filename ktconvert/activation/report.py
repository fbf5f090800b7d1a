"""``expert-stats --report FILE.html``: the counts as a picture (ktconvert.util.svg_report building blocks).

* a summary table (model, tokens, top-k, calibration identity);
* a layer × expert heat map of each MoE layer's share of routed (token, expert) pairs (dense layers: no data), on
  a fixed scale: 0 to HOT times the share every expert would take under uniform routing;
* the top-N coverage curve: the share of a layer's routed pairs its N most used experts take (mean, least and most
  concentrated layer, and the uniform N/E line) — what N GPU experts per layer could serve at best;
* per layer, the share SGLang-KT's frequency placement puts on the GPU at a few --kt-gpu-experts-ratio values.
"""
from __future__ import annotations

import numpy as np

from pathlib import Path

from ktconvert.util import svg_report as html
from ktconvert.activation.counts import ExpertActivation
from ktconvert.activation.placement import SglangMoeLayers, gpu_expert_budget, placement, routed_share
from ktconvert.formats.fileio import write_atomic

RATIOS = (0.1, 0.2, 0.5)
HOT = 3     # the heat map's brightest colour: this many times the uniform share (100 / E %) or more


def layer_shares(counts: np.ndarray, moe_layers) -> np.ndarray:
    """float64 [L, E]: each MoE layer's counts divided by its total; NaN rows for other layers."""
    shares = np.full(counts.shape, np.nan)
    for L in moe_layers:
        total = counts[L].sum()
        shares[L] = counts[L] / total if total else 0.0
    return shares


def top_n_curves(counts: np.ndarray, moe_layers) -> np.ndarray:
    """float64 [len(moe_layers), E]: [i, n-1] = share of layer moe_layers[i]'s routed pairs taken by its n most
    used experts."""
    rows = []
    for L in moe_layers:
        ordered = np.sort(counts[L].astype(np.float64))[::-1]
        total = ordered.sum()
        rows.append(np.cumsum(ordered) / total if total else np.zeros_like(ordered))
    return np.asarray(rows)


def build_report(activation: ExpertActivation, title: str = "Expert activation", layers=None) -> str:
    """The HTML page (a string) for `activation`; `layers`: SGLang-KT's view of the model
    (placement.sglang_moe_layers), default the MoE layers recorded in the counts."""
    meta, counts = activation.meta, activation.counts
    moe = list(meta.get("moe_layers", []))
    layers = layers or SglangMoeLayers(activation.n_layers, activation.n_experts, tuple(moe))
    return html.page(title, [_summary(activation), _heat_section(counts, moe), _coverage_section(counts, moe),
                             _placement_section(counts, layers)],
                     subtitle="Routed calibration tokens per decoder layer and expert (ktconvert expert-stats).")


def _summary(activation: ExpertActivation) -> str:
    meta = activation.meta
    routing = meta.get("routing", {})
    rows = [["model_type", meta.get("model_type", "")], ["decoder layers", activation.n_layers],
            ["MoE layers", len(meta.get("moe_layers", []))], ["routed experts per layer", activation.n_experts],
            ["top-k", meta.get("top_k", "")], ["calibration tokens", meta.get("tokens", "")],
            ["samples", meta.get("samples", "")], ["hidden states", routing.get("hidden_states", "")],
            ["dtype", routing.get("dtype", "")], ["calibration file sha256", meta.get("calibration_sha256") or "-"],
            ["tokens sha256", meta.get("tokens_sha256", "")]]
    return html.section("Summary", html.table(["", "value"], rows))


def _heat_section(counts: np.ndarray, moe: list) -> str:
    shares = layer_shares(counts, moe)
    uniform = 100 / max(counts.shape[1], 1)
    figure = html.heat_map(100 * shares, row_labels=list(range(counts.shape[0])), title="Routed share per expert",
                           x_label="expert", y_label="layer", value_label="% of the layer's routed pairs",
                           scale=(0.0, HOT * uniform),
                           caption=f"Colour: 0% (dark) to {HOT}x the uniform share of {html.fmt(uniform)}% "
                                   f"({html.count(counts.shape[1], 'expert')}) or more (bright).")
    return html.section("Layer × expert", figure, note="Each MoE layer's row sums to 100% (every token counts once "
                        "for each of its top-k experts). Hatched rows: dense layers. Hover a cell for its value.")


def _coverage_section(counts: np.ndarray, moe: list) -> str:
    if not moe:
        return html.section("Top-N coverage", "<p>No MoE layer.</p>")
    curves = 100 * top_n_curves(counts, moe)
    n = np.arange(1, counts.shape[1] + 1)
    area = curves.sum(axis=1)
    least, most = int(np.argmin(area)), int(np.argmax(area))
    series = {"mean over MoE layers": list(zip(n, curves.mean(axis=0))),
              f"most concentrated (layer {moe[most]})": list(zip(n, curves[most])),
              f"least concentrated (layer {moe[least]})": list(zip(n, curves[least])),
              "uniform (N / E)": list(zip(n, 100 * n / counts.shape[1]))}
    figure = html.line_chart(series, title="Share of routed pairs taken by a layer's top-N experts",
                             x_label="N (GPU experts in the layer)", y_label="% of routed pairs", y_min=0, y_max=100)
    picks = sorted({max(1, round(r * counts.shape[1])) for r in RATIOS})
    rows = [[L] + [float(curves[i, p - 1]) for p in picks] for i, L in enumerate(moe)]
    table = html.table(["layer"] + [f"top {html.count(p, 'expert')} (%)" for p in picks], rows)
    return html.section("Top-N coverage", figure, table, note="How much of each layer's routing its N most used "
                        "experts take: the best any N GPU experts per layer can do on these tokens.")


def _placement_section(counts: np.ndarray, layers) -> str:
    moe = list(layers.moe_layers)
    freq = counts.astype(np.float32)
    series, rows = {}, []
    for ratio in RATIOS:
        budget = gpu_expert_budget(layers, ratio=ratio)
        _, mask = placement(layers, budget, freq)
        shares = 100 * np.asarray(routed_share(freq, mask, moe))
        series[f"ratio {ratio} ({html.count(budget, 'expert')})"] = list(zip(moe, shares))
        rows.append([ratio, budget, float(shares.mean()) if moe else 0.0, float(shares.min()) if moe else 0.0])
    figure = html.line_chart(series, title="Routed share on the GPU per layer, frequency placement",
                             x_label="layer", y_label="% of the layer's routed pairs", y_min=0, y_max=100)
    table = html.table(["--kt-gpu-experts-ratio", "GPU experts", "mean share (%)", "worst layer (%)"], rows)
    return html.section("SGLang-KT frequency placement", figure, table,
                        note="kt-kernel's rule: the global top-k of these counts over all layers (some layers get "
                             "more GPU experts than others).")


def write_report(path, activation: ExpertActivation, title: str = "Expert activation", layers=None):
    """Write the page (build_report) to `path` atomically."""
    write_atomic(Path(path), build_report(activation, title, layers).encode("utf-8"))
    return path

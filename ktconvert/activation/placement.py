"""Which routed experts SGLang-KT keeps on the GPU, by its own rules, and the VRAM they take.

SGLang-KT (kvcache-ai/sglang ``kt_ep_wrapper._init_kt_gpu_experts_masks``):

* reads the text config (``text_config`` when present): ``num_hidden_layers``; the expert count from
  ``num_local_experts``, else ``num_experts``, else ``n_routed_experts``; its MoE layers are
  ``L >= first_k_dense_replace and L % moe_layer_freq == 0`` (defaults 0 and 1; a list ``moe_layer_freq`` moves
  first_k_dense_replace to its first true entry; ``num_hash_layers`` is subtracted from first_k_dense_replace).
  This is SGLang's rule, not the architecture manifest's: Qwen's ``mlp_only_layers`` are MoE layers to it;
* the total GPU expert count: ``int(moe_layers * num_experts * ratio)`` with ``--kt-gpu-experts-ratio`` (which wins
  over the other), else ``--kt-num-gpu-experts`` (per layer) × moe_layers;
* ``--kt-expert-placement-strategy frequency`` with a counts file: kt-kernel's ``generate_gpu_experts_masks``:
  the global top-k of the float32 counts over every (layer, expert) — dense layers' zero rows included, so with
  a budget larger than the experts that received tokens, zero-count slots (possibly of dense layers, where they
  buy nothing) are filled in ``torch.topk(..., sorted=False)``'s order; ``uniform`` (SGLang's default): the
  budget split evenly over the MoE layers, the first ``budget % moe_layers`` layers one more, experts
  0..n-1 of each layer. Dense layers' rows are then set all-GPU (those layers never reach kt-kernel).
* a layer's GPU experts take ``count × (bytes of one GPU expert)`` of VRAM (the GPU checkpoint's expert scheme:
  ``ktconvert.gpu.plan``).

The selection uses ``torch.topk`` exactly as kt-kernel calls it, so ties at the budget's edge resolve as they do
at server start; ``boundary_ties`` says when the choice among equal counts decided anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ktconvert.activation.counts import load_activation
from ktconvert.errors import InputError
from ktconvert.formats.hf_source import HFSource
from ktconvert.run.inputs import Input
from ktconvert.gpu.plan import GpuOptions, plan_gpu
from ktconvert.util.progress import human_bytes

STRATEGIES = ("frequency", "uniform")


@dataclass(frozen=True)
class SglangMoeLayers:
    """The layer / expert geometry SGLang-KT derives from config.json."""

    num_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]


def sglang_moe_layers(config: dict) -> SglangMoeLayers:
    """SGLang-KT's view of `config` (config.json as a dict); InputError when it cannot find the counts."""
    cfg = config.get("text_config") or config
    num_layers = cfg.get("num_hidden_layers")
    num_experts = next((cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                        if cfg.get(k) is not None), None)
    if num_layers is None or num_experts is None:
        raise InputError("SGLang-KT finds no layer or expert count in config.json", file="config.json",
                         expected="num_hidden_layers and num_local_experts / num_experts / n_routed_experts")
    first = cfg.get("first_k_dense_replace", 0) or 0
    first = max(0, first - (cfg.get("num_hash_layers", 0) or 0))
    freq = cfg.get("moe_layer_freq", 1)
    if isinstance(freq, list):
        first = max(first, next((i for i, v in enumerate(freq) if v), 0))
        freq = 1
    moe = tuple(L for L in range(num_layers) if L >= first and L % freq == 0)
    return SglangMoeLayers(int(num_layers), int(num_experts), moe)


def gpu_expert_budget(layers: SglangMoeLayers, ratio: float | None = None, per_layer: int | None = None) -> int:
    """Total GPU experts SGLang-KT allocates: --kt-gpu-experts-ratio wins over --kt-num-gpu-experts (per layer)."""
    if ratio is not None:
        return int(len(layers.moe_layers) * layers.num_experts * ratio)
    if per_layer is None:
        raise ValueError("give ratio or per_layer")
    return int(per_layer) * len(layers.moe_layers)


def frequency_mask(freq: np.ndarray, budget: int) -> np.ndarray:
    """kt-kernel's generate_gpu_experts_masks: bool [L, E], True for the `budget` largest entries of float32 `freq`
    [L, E] over all layers at once (torch.topk, largest, unsorted — ties resolve in torch's order)."""
    import torch

    flat = torch.from_numpy(np.ascontiguousarray(freq, np.float32)).reshape(-1)
    budget = max(0, min(int(budget), flat.numel()))
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    if budget:
        mask[torch.topk(flat, k=budget, largest=True, sorted=False).indices] = True
    return mask.reshape(freq.shape).numpy()


def uniform_mask(layers: SglangMoeLayers, budget: int) -> np.ndarray:
    """SGLang's uniform strategy: bool [L, E], experts 0..n-1 of each MoE layer, the budget split evenly and the
    first `budget % moe_layers` MoE layers one expert more."""
    mask = np.zeros((layers.num_layers, layers.num_experts), bool)
    n_moe = len(layers.moe_layers)
    for i, L in enumerate(layers.moe_layers):
        mask[L, :min(budget // n_moe + (1 if i < budget % n_moe else 0), layers.num_experts)] = True
    return mask


def boundary_ties(freq: np.ndarray, mask: np.ndarray) -> dict | None:
    """When entries equal to the smallest selected count were left out: {"count", "selected", "tied"} (how many
    of `tied` equal entries got a GPU slot), else None."""
    if not mask.any() or mask.all():
        return None
    edge = freq[mask].min()
    tied = int(np.count_nonzero(freq == edge))
    selected = int(np.count_nonzero(mask & (freq == edge)))
    return None if selected == tied else {"count": float(edge), "selected": selected, "tied": tied}


def placement(layers: SglangMoeLayers, budget: int, freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, mask), bool [L, E] each: the strategy's choice (frequency when `freq`, float32 [L, E], is given,
    else uniform) and SGLang-KT's final mask, with dense layers' rows all True."""
    chosen = frequency_mask(freq, budget) if freq is not None else uniform_mask(layers, budget)
    mask = chosen.copy()
    mask[[L for L in range(layers.num_layers) if L not in layers.moe_layers]] = True
    return chosen, mask


def routed_share(freq: np.ndarray, mask: np.ndarray, moe_layers) -> list[float]:
    """Per MoE layer: the fraction of its routed (token, expert) pairs that land on GPU experts."""
    out = []
    for L in moe_layers:
        total = float(freq[L].sum())
        out.append(float(freq[L][mask[L]].sum()) / total if total else 0.0)
    return out


def overall_share(freq: np.ndarray, mask: np.ndarray, moe_layers) -> float:
    """The fraction of all MoE layers' routed (token, expert) pairs that land on GPU experts."""
    moe = list(moe_layers)
    total = float(freq[moe].sum())
    return float(freq[moe][mask[moe]].sum()) / total if total else 0.0


def coverage(layers: SglangMoeLayers, counts: np.ndarray, ratio: float) -> dict:
    """{"ratio", "gpu_experts", "routed_share"}: SGLang-KT's frequency placement from `counts` [L, E] with
    --kt-gpu-experts-ratio `ratio`, and the share of routed pairs it puts on the GPU."""
    freq = np.asarray(counts, np.float32)
    budget = gpu_expert_budget(layers, ratio=ratio)
    _, mask = placement(layers, budget, freq)
    return {"ratio": ratio, "gpu_experts": budget, "routed_share": overall_share(freq, mask, layers.moe_layers)}


def plan_placement(src, *, ratio: float | None = None, per_layer: int | None = None, stats=None,
                   gpu_experts: str = "w4a16", group_size: int = 128) -> dict:
    """The GPU experts SGLang-KT would choose for checkpoint `src` with --kt-gpu-experts-ratio `ratio` or
    --kt-num-gpu-experts `per_layer`, from counts file `stats` (strategy frequency) or without (uniform), and
    their VRAM with `gpu_experts` (w4a16 / w8a16, group `group_size`) GPU experts.

    Returns {strategy, stats, budget, moe_layers, layers: [{layer, gpu_experts [ids], count, vram_bytes,
    routed_share?}], gpu_experts_total, vram_per_expert_bytes, vram_bytes, routed_share?, ties?, notes}."""
    if (ratio is None) == (per_layer is None):
        raise InputError("give the GPU expert budget one way", expected="a ratio or a per-layer count")
    source = src.source if isinstance(src, Input) else HFSource.open(src)     # an Input: opened with its options
    layers = sglang_moe_layers(source.config_json())
    budget = gpu_expert_budget(layers, ratio, per_layer)
    freq, made_from = None, None
    if stats is not None:
        activation = load_activation(stats, layers.num_layers, layers.num_experts)
        freq, made_from = activation.counts, (activation.meta.get("source") or {}).get("config_sha256")
    chosen, mask = placement(layers, budget, freq)
    per_expert = plan_gpu(src, GpuOptions.make(experts=gpu_experts, group_size=group_size))["vram_per_expert_bytes"]
    rows = [{"layer": L, "gpu_experts": np.flatnonzero(mask[L]).tolist(), "count": int(mask[L].sum()),
             "vram_bytes": int(mask[L].sum()) * per_expert} for L in layers.moe_layers]
    result = {"source": getattr(src, "spec", str(src)), "strategy": "frequency" if freq is not None else "uniform",
              "stats": None if stats is None else str(stats), "budget": budget, "ratio": ratio,
              "per_layer": per_layer, "moe_layers": list(layers.moe_layers), "layers": rows,
              "gpu_experts_total": sum(r["count"] for r in rows), "vram_per_expert_bytes": per_expert,
              "vram_bytes": sum(r["vram_bytes"] for r in rows), "gpu_scheme": gpu_experts.lower(),
              "notes": _notes(source.info, layers, budget, rows)}
    if made_from and made_from != source.config_sha256():
        result["notes"].append("the counts were made from another config.json (sha256 differs): another model?")
    if freq is not None:
        for row, share in zip(rows, routed_share(freq, mask, layers.moe_layers)):
            row["routed_share"] = share
        result["routed_share"] = overall_share(freq, mask, layers.moe_layers)
        result["ties"] = boundary_ties(freq, chosen)
    return result


def _notes(info, layers: SglangMoeLayers, budget: int, rows: list) -> list[str]:
    notes = []
    if tuple(info.moe_layers) != layers.moe_layers:
        notes.append(f"SGLang-KT treats layers {list(layers.moe_layers)} as MoE layers (first_k_dense_replace / "
                     f"moe_layer_freq), the checkpoint has routed experts in {list(info.moe_layers)}")
    placed = sum(r["count"] for r in rows)
    if placed < budget:
        notes.append(f"{budget - placed} of the {budget} GPU slots place no expert (kt-kernel's top-k reached dense "
                     f"layers' zero rows, or the budget exceeds the routed experts)")
    return notes


def render_placement(result: dict) -> str:
    """Human-readable plan: budget, per-layer GPU experts and VRAM, routed share when counts were given."""
    how = f"--kt-gpu-experts-ratio {result['ratio']}" if result["ratio"] is not None else \
        f"--kt-num-gpu-experts {result['per_layer']}"
    lines = [f"gpu experts ({result['strategy']}{', ' + result['stats'] if result['stats'] else ''}): {how} -> "
             f"{result['budget']} experts over {len(result['moe_layers'])} MoE layers; "
             f"{result['gpu_scheme'].upper()} {human_bytes(result['vram_per_expert_bytes'])} each, "
             f"{human_bytes(result['vram_bytes'])} in all"]
    if "routed_share" in result:
        lines.append(f"  calibration tokens' routed pairs on the GPU: {100 * result['routed_share']:.1f}%")
    for row in result["layers"]:
        share = f", {100 * row['routed_share']:.1f}% routed" if "routed_share" in row else ""
        lines.append(f"  layer {row['layer']:>3}: {row['count']:>4} experts, {human_bytes(row['vram_bytes'])}"
                     f"{share}: {_ranges(row['gpu_experts'])}")
    if result.get("ties"):
        t = result["ties"]
        lines.append(f"  note: {t['selected']} of {t['tied']} experts with count {t['count']:g} were chosen at the "
                     f"budget's edge (kt-kernel's torch.topk order decides)")
    lines += [f"  note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    parts, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            parts.append(str(start) if start == e else f"{start}-{e}")
            start = None
    return ",".join(parts) or "-"

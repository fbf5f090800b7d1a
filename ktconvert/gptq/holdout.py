"""Held-out selection per expert: GPTQ is written only where it beats the data-free quantizer on tokens it did not
see.

Split (deterministic, from the calibration file alone, ``every`` = ``SelectionOptions.holdout_every``): with at
least ``2 * every`` samples, sample i (file order) is held out whole when ``i % every == every - 1``; with fewer,
each sample is cut into blocks of ``BLOCK_TOKENS`` tokens and token t of sample i is held out when
``(i + t // BLOCK_TOKENS) % every == every - 1``. Whole samples come first because tokens of one sample share its
context (attention mixes it into every position): held-out blocks of a sample the fit part also saw make GPTQ
look better than it is on other text. GPTQ's Hessians use the other ("fit") tokens only.

Judgement: an expert's error on its routed held-out tokens x_t with routing weights w_t is
``sum_t w_t^2 * |f_q(x_t) - f(x_t)|^2`` (its share of the MoE output's squared error; f = the expert module's own
forward in float32, f_q the same with the candidate's dequantized weights). GPTQ is kept when its error is strictly
smaller than the data-free candidate's; experts with fewer than ``min_tokens`` routed calibration tokens, or with
no routed held-out token, are not tried (the data-free candidate is written).
"""
from __future__ import annotations

from dataclasses import dataclass

from ktconvert.gptq.determinism import deterministic_cpu
from ktconvert.gptq.skeleton import expert_forward, float_params

BLOCK_TOKENS = 64
GPTQ, DATA_FREE, FEW_TOKENS, NOT_PD = "gptq", "data_free", "few_tokens", "not_positive_definite"
REASONS = (GPTQ, DATA_FREE, FEW_TOKENS, NOT_PD)   # why an expert got what it got, in manifest order


@dataclass(frozen=True)
class SelectionOptions:
    """holdout_every: one token block in this many is held out (0: no split, GPTQ written everywhere);
    min_tokens: routed calibration tokens an expert needs before GPTQ is tried."""

    holdout_every: int = 4
    min_tokens: int = 64

    def __post_init__(self):
        if self.holdout_every == 1 or self.holdout_every < 0:
            raise ValueError(f"holdout_every must be 0 (off) or >= 2, not {self.holdout_every}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, not {self.min_tokens}")

    @property
    def enabled(self) -> bool:
        return self.holdout_every > 0


def holdout_masks(lengths: list[int], every: int) -> list:
    """Per sample (file order, lengths[i] tokens): bool [lengths[i]] tensor, True where the token is held out
    (module docstring; every = 0: nothing held out)."""
    import torch

    whole = len(lengths) >= 2 * every
    masks = []
    for i, n in enumerate(lengths):
        unit = torch.full((n,), i) if whole else torch.arange(n) // BLOCK_TOKENS + i
        masks.append(unit % every == every - 1 if every > 0 else torch.zeros(n, dtype=torch.bool))
    return masks


def expert_errors(expert, candidates: dict, x, weight) -> dict:
    """{name: float} squared held-out error of each candidate (module docstring). candidates: {name: {"gate" |
    "up" | "down": float32 [n, k] dequantized weights}}; x [T, H] the held-out inputs, weight [T] their routing
    weights. The expert's other parameters (biases) stay as they are. Computed in float64 at one torch thread on
    CPU, so near-ties cannot turn the choice with the host's thread count or SIMD width."""
    import torch

    params = float_params(expert, torch.float64)
    scale = weight.to(torch.float64).unsqueeze(1)
    with torch.no_grad(), deterministic_cpu(x.device):
        reference = expert_forward(expert, params, x)
        return {name: float(torch.sum(((expert_forward(expert, params, x, weights) - reference) * scale) ** 2))
                for name, weights in candidates.items()}


def choose(errors: dict) -> str:
    """GPTQ when its held-out error is strictly below the data-free one's, else DATA_FREE."""
    return GPTQ if errors[GPTQ] < errors[DATA_FREE] else DATA_FREE

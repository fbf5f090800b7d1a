"""Which experts the model's own router picks, counted where the MoE block hands its choice to the experts.

Every supported family's MoE block computes its router in its own transformers code (softmax or sigmoid scores,
DeepSeek-V3 / Kimi-K2 / GLM's ``e_score_correction_bias`` and group-limited top-k, gpt-oss's top-k-then-softmax,
Qwen's and Mixtral's softmax top-k) and then calls ``experts(hidden_states [T, H], top_k_index int64 [T, k],
top_k_weights [T, k])``. A forward pre-hook on that experts module reads ``top_k_index``: the routed choice
exactly as the model makes it, whatever the family, without re-implementing any router. Normalisation of the
weights does not change the choice, and only the choice is counted.
"""
from __future__ import annotations

import contextlib


class RoutedCounts:
    """Per-expert count of (token, choice) pairs over every forward of one experts module while attached.

    counts: int64 [n_experts]; tokens: tokens seen; top_k: width of the choice (top_k_index.shape[-1])."""

    def __init__(self, n_experts: int, where: str = ""):
        import torch

        self.n_experts, self.where = n_experts, where
        self.counts = torch.zeros(n_experts, dtype=torch.int64)
        self.tokens = 0
        self.top_k = None

    def add(self, top_k_index) -> None:
        """Count one forward's choice: top_k_index int [T, k] (or [..., k]) of expert ids in [0, n_experts)."""
        import torch

        idx = top_k_index.detach().reshape(-1, top_k_index.shape[-1]).to("cpu", torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.n_experts):
            raise ValueError(f"{self.where}: router chose expert ids {int(idx.min())}..{int(idx.max())} "
                             f"outside 0..{self.n_experts - 1}")
        if self.top_k not in (None, idx.shape[1]):
            raise ValueError(f"{self.where}: top-k changed from {self.top_k} to {idx.shape[1]}")
        self.top_k = int(idx.shape[1])
        self.tokens += int(idx.shape[0])
        self.counts += torch.bincount(idx.reshape(-1), minlength=self.n_experts)


def top_k_index_of(args: tuple, kwargs: dict):
    """The routed expert ids among an experts module's call arguments (second positional, or top_k_index)."""
    if "top_k_index" in kwargs:
        return kwargs["top_k_index"]
    if len(args) < 2:
        raise ValueError("experts module called without top_k_index")
    return args[1]


@contextlib.contextmanager
def counting(experts, n_experts: int, where: str = ""):
    """Attach a RoutedCounts to `experts` (a module called as experts(hidden, top_k_index, top_k_weights)) for
    the duration of the block; yields it."""
    counter = RoutedCounts(n_experts, where)

    def hook(module, args, kwargs):
        counter.add(top_k_index_of(args, kwargs))

    handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield counter
    finally:
        handle.remove()

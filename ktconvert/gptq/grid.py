"""GPTQ's error compensation on a fixed symmetric grid: the solve behind ``--quant gptq`` for kt-kernel's AMX and
GPTQ_INT4 files.

llmcompressor's ``quantize_weight`` rounds to compressed-tensors' integer ranges (-8..7 for 4 bits), and kt-kernel's
AMXINT4 forward breaks on code -8 (kt-format.md §2.1): its grid is -7..7 (-127..127 for INT8). This solve is
GPTQ (Frantar et al., 2022, with §3.4's lazy block updates and "act-order") for steps chosen beforehand, on the
``Grid`` the method declares (AMX: -7..7 per row part; GPTQ_INT4: -8..7 per group, F16 steps):

    H      the Hessian [k, k] (any positive multiple of X^T X over the layer's calibration inputs X [T, k])
    dead   columns with H[j, j] == 0 (inputs always zero) get H[j, j] = 1: plain rounding, the weight kept
    damp   H += dampening * mean(diag H) * I (llmcompressor's percdamp)
    order  columns by descending diag H (act-order; the steps travel with their columns)
    U      upper Cholesky factor of H^-1
    loop   column j in that order: q_j = clamp(round_half_even(w_j / s_j), qmin, qmax), s_j the step of w_j's
           row and group; err_j = (w_j - q_j s_j) / U[j, j]; the columns after j absorb -err_j U[j, j+1:]
           (inside a block of `block_size` columns at once, across blocks with one matrix product)

Rows are independent given H, so gate and up (one Hessian) run as one [2I, H] matrix. float32 throughout, run at
one torch thread without oneDNN by the caller (``determinism.deterministic_cpu``, MKL pinned by
``determinism.pin_process``), so the codes do not depend on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Grid:
    """The quantization grid a method declares for ``--quant gptq``: integer codes qmin..qmax of ``bits`` bits, one
    step per ``group_size`` input columns (0: one per row or NUMA part), symmetric (no zero point: w ~= code * step),
    steps stored as ``scale_dtype`` (a safetensors dtype: "F16", "BF16", "F32"). The solve below quantizes on it."""

    bits: int
    group_size: int
    symmetric: bool = True
    scale_dtype: str = "F32"
    qmin: int = 0
    qmax: int = 0

    @classmethod
    def int_sym(cls, bits: int, group_size: int, scale_dtype: str) -> "Grid":
        """Two's-complement symmetric codes -2^(b-1)..2^(b-1)-1 (AutoGPTQ sym, compressed-tensors' int groups)."""
        return cls(bits, group_size, True, scale_dtype, -(1 << (bits - 1)), (1 << (bits - 1)) - 1)


def inverse_factor(hessian, dampening: float):
    """float32 [k, k] Hessian -> (U float32 [k, k] upper Cholesky factor of the damped inverse, permutation int64 [k]
    of act-order), or None when the damped Hessian is not positive definite (the caller keeps its data-free codes)."""
    import torch

    H = hessian.to(torch.float32).clone()
    diag = torch.diagonal(H)
    diag.masked_fill_(diag == 0, 1.0)
    perm = torch.argsort(diag, descending=True, stable=True)
    H = H[perm][:, perm]
    torch.diagonal(H).add_(dampening * torch.mean(torch.diagonal(H)))
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:
        return None
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True), perm


def solve(weight, factor, step, qmax: int, block_size: int = 128, qmin: int | None = None):
    """GPTQ codes of `weight` float32 [n, k] on the grid step * (qmin..qmax) (qmin None: -qmax).

    factor: ``inverse_factor``'s (U, perm); step: float32 [n, G] (column j uses group j // (k / G); a step of 0
    gives codes 0 there, as kt-kernel's zero rows). Returns codes int8 [n, k] (torch) in qmin..qmax."""
    import torch

    U, perm = factor
    lo = -qmax if qmin is None else qmin
    n, k = weight.shape
    group = k // step.shape[1]
    W = weight.to(torch.float32)[:, perm].clone()
    S = torch.repeat_interleave(step.to(torch.float32), group, dim=1)[:, perm]
    live = S > 0
    S = torch.where(live, S, torch.ones_like(S))
    Q = torch.zeros((n, k), dtype=torch.float32)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        err = torch.zeros_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            q = torch.clamp(torch.round(W1[:, i] / S[:, j]), lo, qmax) * live[:, j]
            Q[:, j] = q
            err[:, i] = (W1[:, i] - q * S[:, j]) / U1[i, i]
            W1[:, i:] -= err[:, i:i + 1] * U1[i, i:].unsqueeze(0)
        W[:, i2:] -= err @ U[i1:i2, i2:]
    codes = torch.empty_like(Q)
    codes[:, perm] = Q
    return codes.to(torch.int8)


def solve_expert(weights: dict, gate_up_hessian, down_hessian, steps: dict, dampening: float, qmax: int,
                 block_size: int = 128, qmin: int | None = None) -> dict | None:
    """GPTQ codes {proj: int8 numpy [n, k]} of one expert: gate and up (one Hessian) solved as one [2I, H] matrix,
    down on its own, each on its `steps` (float32 torch, per proj) and the grid qmin..qmax; None when a damped
    Hessian is not positive definite (the caller keeps its data-free codes). The caller runs it under
    ``determinism.deterministic_cpu``."""
    import torch

    gate_up_factor = inverse_factor(gate_up_hessian, dampening)
    down_factor = inverse_factor(down_hessian, dampening)
    if gate_up_factor is None or down_factor is None:
        return None
    stacked = solve(torch.cat([weights["gate"], weights["up"]]), gate_up_factor,
                    torch.cat([steps["gate"], steps["up"]]), qmax, block_size, qmin=qmin)
    codes = dict(zip(("gate", "up"), np.split(stacked.numpy(), 2)))
    codes["down"] = solve(weights["down"], down_factor, steps["down"], qmax, block_size, qmin=qmin).numpy()
    return codes

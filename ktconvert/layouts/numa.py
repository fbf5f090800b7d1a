"""NUMA split of one expert into T equal parts along the intermediate dimension I (kt-format.md §2.0 item 2).

Part t holds gate/up rows [t*I_t, (t+1)*I_t) (its matrices are [n=I_t, k=H]) and, for down, columns
[t*I_t, (t+1)*I_t) of every one of the H rows ([n=H, k=I_t]). H is never split; the runtime sums the T partial
down outputs. Which T a method can write is the method's rule (``ktconvert.methods``: ``valid_numa``).
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import ShapeError
from ktconvert.formats.base import ExpertWeights


def numa_slices(intermediate: int, parts: int) -> list[slice]:
    """The T equal slices of range(I); ShapeError unless T >= 1 and I % T == 0."""
    if parts < 1 or intermediate % parts:
        raise ShapeError("intermediate size must split evenly across NUMA parts",
                         expected="I % T == 0 (T >= 1)", found=f"I={intermediate}, T={parts}",
                         hint=f"T must divide {intermediate}")
    step = intermediate // parts
    return [slice(t * step, (t + 1) * step) for t in range(parts)]


def split_expert(ew: ExpertWeights, parts: int) -> list[ExpertWeights]:
    """Split one expert (gate/up uint16 [I, H], down uint16 [H, I]) into ``parts`` ExpertWeights (the reference of
    the split the methods apply per matrix; benchmarks and tests build kt-kernel's inputs with it).

    Gate/up parts are row slices (views); down parts are contiguous copies of the column slices. gate_bias and
    up_bias [I] are sliced like their rows. down_bias [H] belongs to the output, which the runtime sums over the
    parts, so part 0 carries it whole and the other parts carry zeros (the sum reproduces it exactly).
    """
    inter, hidden = ew.gate.shape
    if ew.up.shape != (inter, hidden) or ew.down.shape != (hidden, inter):
        raise ShapeError("expert projections disagree",
                         expected=f"gate/up [I, H] and down [H, I] with I={inter}, H={hidden}",
                         found=f"gate {list(ew.gate.shape)}, up {list(ew.up.shape)}, down {list(ew.down.shape)}")
    out = []
    for t, sl in enumerate(numa_slices(inter, parts)):
        out.append(ExpertWeights(
            gate=ew.gate[sl], up=ew.up[sl], down=np.ascontiguousarray(ew.down[:, sl]),
            gate_bias=None if ew.gate_bias is None else ew.gate_bias[sl],
            up_bias=None if ew.up_bias is None else ew.up_bias[sl],
            down_bias=None if ew.down_bias is None else (ew.down_bias if t == 0 else np.zeros_like(ew.down_bias)),
        ))
    return out

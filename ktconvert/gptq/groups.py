"""GPTQ for the in-place methods that declare a grid (``method.gptq_grid()``, a ``grid.Grid``: GPTQ_INT4's AutoGPTQ
symmetric INT4, codes -8..7, one F16 step per group of input columns and output column).

As for the AMX files (gptq.cpu), the steps are the data-free quantizer's (``scale_quant``, default "mse": the method's
``--quant mse`` search) and GPTQ's error compensation (``grid.solve``) chooses the codes on that fixed grid; the
method turns codes and steps into its tensors (``method.from_codes``), so the files keep its format byte for byte.
An expert written data-free gets exactly the tensors ``--quant scale_quant`` writes. The solve runs under
``determinism.deterministic_cpu``: the bytes depend on neither the thread count nor the host's instruction set.
"""
from __future__ import annotations

import numpy as np

from ktconvert.gptq import grid
from ktconvert.gptq.determinism import deterministic_cpu
from ktconvert.gptq.holdout import SelectionOptions
from ktconvert.gptq.loop import GptqOptions
from ktconvert.layouts.naming import PROJS
from ktconvert.methods import METHODS


class GroupQuantizer:
    """LayerStream quantizer for a method with ``gptq_grid``; payload per proj: (codes int8 [n, k] in
    grid.qmin..grid.qmax, steps float32 [n, k / group_size]) with w ~= codes * step.

    The method is kept by name and group size (``method_name``, ``group_size``) so the quantizer pickles for Ray;
    scale_quant and selection as cpu.AmxQuantizer's."""

    def __init__(self, method, scale_quant: str | None = None,
                 selection: SelectionOptions | None = SelectionOptions()):
        self.grid = method.gptq_grid()
        if not self.grid.symmetric or self.grid.group_size <= 0:
            raise ValueError(f"{method.name}: the GPTQ group solve needs a symmetric grouped grid, not {self.grid}")
        self.method_name, self.group_size = method.name, method.group_size
        self.fallback_quant = scale_quant or "mse"
        self.selection = selection

    @property
    def method(self):
        return METHODS.get(self.method_name).configured(self.group_size)

    def quantize(self, expert, gate_up, down, options: GptqOptions, where: str) -> dict | None:
        """GPTQ payloads of one expert on the data-free quantizer's steps; None when a damped Hessian is not
        positive definite (the caller writes the data-free payloads)."""
        import torch

        weights = {p: getattr(expert, p + "_proj").weight.detach().to("cpu") for p in PROJS}
        steps = {p: s for p, (_, s) in self.fallback(expert, where).items()}
        with deterministic_cpu("cpu"):
            codes = grid.solve_expert(weights, gate_up[0].to("cpu"), down[0].to("cpu"),
                                      {p: torch.from_numpy(s) for p, s in steps.items()}, options.dampening,
                                      self.grid.qmax, options.block_size, qmin=self.grid.qmin)
        if codes is None:
            return None
        return {p: (np.ascontiguousarray(codes[p]), steps[p]) for p in PROJS}

    def fallback(self, expert, where: str) -> dict:
        """Data-free (codes, steps) of every projection (the method's ``fallback_quant`` encoder)."""
        method = self.method
        return {p: method.group_codes(bf16_bits(getattr(expert, p + "_proj").weight), f"{where} {p}",
                                      self.fallback_quant) for p in PROJS}

    def dequantized(self, payloads: dict) -> dict:
        """{proj: float32 torch [n, k]} the weights kt-kernel computes with (codes * step)."""
        import torch

        return {p: torch.from_numpy(codes.astype(np.float32) * np.repeat(steps, self.group_size, axis=1))
                for p, (codes, steps) in payloads.items()}


def write_layer(writer, method, result) -> None:
    """One layer's payloads as the method's tensors to an in-place LayerWriter: writer.put_stored(proj, e, tensors)."""
    for (e, proj), (codes, steps) in sorted(result.payloads.items()):
        writer.put_stored(proj, e, method.from_codes(codes, steps, f"layer {result.layer} expert {e} {proj}"))


def bf16_bits(weight) -> np.ndarray:
    """A torch weight as uint16 BF16 bits [n, k] (numpy)."""
    import torch

    return weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)

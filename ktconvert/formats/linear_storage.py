"""How one non-expert linear of an HF checkpoint is stored, and its weight read as BF16 bits: float (BF16 / F16 /
F32 ``weight``), block FP8 (F8_E4M3 ``weight`` + a 2-D float ``weight_scale_inv`` / ``weight_scale`` grid, read by
the FP8 decoder of ``formats.decoders.fp8``), or another quantized form a decoder reads (GPTQ / AWQ ``qweight``,
compressed-tensors ``weight_packed``, NVFP4, MXFP8, per-tensor FP8, ...). Sources answer ``stored_linear`` /
``read_linear`` with these (formats.base.Source)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ktconvert.formats.base import TensorRef
from ktconvert.formats.decoders import MatrixRefs, decode_matrix, has_weight, locate
from ktconvert.formats.decoders.fp8 import grid_refs
from ktconvert.quant.bf16 import float_to_bf16_bits

FLOAT_DTYPES = ("BF16", "F16", "F32")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclass(frozen=True)
class StoredLinear:
    """One linear module as stored. kind: "float", "fp8-block", "decoded" (a decoder reads it: `refs`) or "other"
    (no form ktconvert reads as a linear); weight: its ``.weight`` TensorRef (None when there is none); scale: the
    FP8 scale grid's TensorRef ("fp8-block"); block: the ``weight_block_size`` of a ``quant_method: fp8``
    checkpoint ("fp8-block"; None: no such block, the grid implies it)."""

    module: str
    kind: str
    weight: TensorRef | None = None
    scale: TensorRef | None = None
    refs: MatrixRefs | None = None
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...] | None:
        """[n, k] of a decoded linear, else the stored weight's shape (None without one)."""
        if self.refs is not None:
            return tuple(self.refs.shape)
        return None if self.weight is None else tuple(self.weight.shape)


def _fp8_scale(checkpoint, module: str, ref) -> TensorRef | None:
    """The 2-D float scale (block grid, or [N, 1] per channel) of an F8_E4M3 ``weight``, None when there is none."""
    if ref.dtype != "F8_E4M3":
        return None
    scales = [checkpoint.tensors.get(f"{module}.{s}") for s in SCALE_SUFFIXES]
    if not any(s is not None and s.dtype in FLOAT_DTYPES and len(s.shape) == 2 for s in scales):
        return None
    return next(s for s in scales if s is not None)


def stored_linear(checkpoint, scheme: Callable, module: str) -> StoredLinear:
    """How `module` is stored in `checkpoint` (headers only). scheme: returns the checkpoint's QuantScheme (or None),
    asked only where a decoder or the FP8 block is needed."""
    tensors = checkpoint.tensors
    ref = tensors.get(module + ".weight")
    scale = None if ref is None else _fp8_scale(checkpoint, module, ref)
    if module not in tensors and has_weight(checkpoint, module) and not (
            ref is not None and (ref.dtype in FLOAT_DTYPES or scale is not None)):
        quant = scheme()
        if quant is not None:
            return StoredLinear(module, "decoded", ref, refs=locate(checkpoint, module, quant))
    if ref is None:
        return StoredLinear(module, "other")
    if ref.dtype in FLOAT_DTYPES:
        return StoredLinear(module, "float", ref)
    if scale is not None:
        quant = scheme()
        block = quant.groups[0].block if quant is not None and quant.quant_method == "fp8" else None
        return StoredLinear(module, "fp8-block", ref, scale, block=block)
    return StoredLinear(module, "other", ref)


def read_bf16(checkpoint, scheme: Callable, stored: StoredLinear) -> np.ndarray:
    """The weight of linear `stored` as BF16 bits uint16 [n, k]: float converted (round to nearest even), block FP8
    by the FP8 decoder (in the checkpoint's block, else the one its grid implies), the rest by the decoders."""
    module = stored.module
    if stored.kind == "float":
        return float_to_bf16_bits(checkpoint.read(stored.weight.name), stored.weight.dtype)
    if stored.kind == "fp8-block":
        quant = scheme()
        group = quant.group_for(module) if quant is not None else None
        kind = "float-quantized" if group is not None and group.fmt == "float-quantized" else "fp8-block"
        return decode_matrix(checkpoint, module, None, refs=grid_refs(checkpoint, module, stored.block, kind))
    return decode_matrix(checkpoint, module, scheme(), refs=stored.refs)

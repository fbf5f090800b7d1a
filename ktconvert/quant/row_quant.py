"""Per-row quantizers for the AMX formats, picked by ``--quant``: ``ROW_QUANT.get(name)``.

Each entry is ``fn(w_bf16 uint16 [n, k], bits (4 | 8), where: str) -> (codes int8 [n, k] in -7..7 / -127..127,
d float32 [n])`` with w ~= codes * (16 if bits == 4 else 1) * d, the file format kt-kernel reads unchanged.
"rtn" is kt-kernel's own rounding (quant/amx_rows.py); ``quant/mse.py`` registers "mse". An entry may carry
``fn.quantize_packed(w_bf16, bits, threads=1, where="") -> (blob, scale) | None``: a fast path returning kt-kernel's
tiled blob directly (None: not available here, use fn + numpy tiling).
"""
from __future__ import annotations

import numpy as np

from ktconvert.quant import amx_rows
from ktconvert.registry import Registry

ROW_QUANT: Registry = Registry("quantization")


@ROW_QUANT.register("rtn")
def rtn_rows(w_bf16: np.ndarray, bits: int, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """kt-kernel's round-to-nearest per-row quantization (quant/amx_rows.py)."""
    return (amx_rows.quantize_int4_rows if bits == 4 else amx_rows.quantize_int8_rows)(w_bf16, where=where)

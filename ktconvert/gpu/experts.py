"""Routed-expert quantization for the GPU checkpoint: compressed-tensors ``pack-quantized`` W4A16 / W8A16.

RTN exactly as llmcompressor's ``model_free_ptq`` does it, through compressed-tensors' own functions:
per group of `group_size` input columns, min/max of the BF16 weight (the ``memoryless_minmax`` observer's statistic),
``calculate_qparams`` (symmetric: scale = max|w| / (range / 2), zero scales replaced by BF16 eps), the scale kept in the
weight dtype (BF16, as the module parameter holds it), then ``PackedQuantizationCompressor.compress`` (``quantize`` +
``pack_to_int32``). Tests compare the bytes with what ``model_free_ptq`` writes for the same source.

Tensors per expert matrix W [n, k] (HF orientation):
  weight_packed  int32 [n, k * bits / 32]   (32/bits values per word, low bits first, stored q + 2^(bits-1))
  weight_scale   BF16 bits (uint16) [n, k / group_size]
  weight_shape   int64 [2] = [n, k]
No zero point (symmetric), no g_idx.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ktconvert.errors import ShapeError, UnknownNameError

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
EXPERT_SCHEMES = {"w4a16": 4, "w8a16": 8}
GROUP_SIZES = (32, 64, 128)


def bits_of(experts: str) -> int:
    """4 for "w4a16", 8 for "w8a16" (case-insensitive)."""
    try:
        return EXPERT_SCHEMES[experts.lower()]
    except KeyError:
        raise UnknownNameError("unknown GPU expert scheme", expected=", ".join(EXPERT_SCHEMES),
                               found=repr(experts)) from None


def expert_specs(base: str, n: int, k: int, bits: int, group_size: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of the three tensors of module `base` (no ".weight" suffix)."""
    check_shape(n, k, bits, group_size, base)
    return [(f"{base}.weight_packed", "I32", (n, k * bits // 32)),
            (f"{base}.weight_scale", "BF16", (n, k // group_size)),
            (f"{base}.weight_shape", "I64", (2,))]


def expert_bytes(n: int, k: int, bits: int, group_size: int) -> int:
    """Bytes of one expert matrix's three tensors."""
    return n * k * bits // 8 + 2 * n * (k // group_size) + 16


def check_shape(n: int, k: int, bits: int, group_size: int, where: str = "") -> None:
    """ShapeError unless k splits into whole groups and whole int32 words."""
    if group_size <= 0 or k % group_size or (k * bits) % 32:
        raise ShapeError("expert in_features is not a multiple of the group size", tensor=where or None,
                         expected=f"k % {group_size} == 0 (and k * {bits} % 32 == 0)", found=f"[{n}, {k}]",
                         hint=f"choose --group-size among {list(GROUP_SIZES)} dividing {k}")


@lru_cache(maxsize=None)
def scheme(bits: int, group_size: int, actorder: str | None = None):
    """compressed-tensors QuantizationScheme: int, symmetric, group strategy, pack-quantized, targets ["Linear"]."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group_size,
                            dynamic=False, actorder=actorder)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def _bf16_tensor(w_bf16: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(w_bf16).view(np.int16)).view(torch.bfloat16)


def quantize_expert_rtn(w_bf16: np.ndarray, bits: int, group_size: int, where: str = "") -> dict[str, np.ndarray]:
    """RTN-quantize one expert matrix. w_bf16: uint16 [n, k] BF16 bits.

    Returns {"weight_packed": int32 [n, k*bits/32], "weight_scale": uint16 BF16 bits [n, k/group_size],
    "weight_shape": int64 [2]}.
    """
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = w_bf16.shape
    check_shape(n, k, bits, group_size, where)
    sch = scheme(bits, group_size)
    with torch.no_grad():
        weight = _bf16_tensor(w_bf16)
        grouped = weight.unflatten(-1, (-1, group_size))           # [n, groups, group_size]
        scale, zero_point = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), sch.weights)
        state = {"weight": weight, "weight_scale": scale.to(weight.dtype),
                 "weight_zero_point": zero_point.to(torch.int8)}
        packed = PackedQuantizationCompressor.compress(state, sch)
    return {"weight_packed": packed["weight_packed"].numpy(),
            "weight_scale": packed["weight_scale"].view(torch.int16).numpy().view(np.uint16),
            "weight_shape": packed["weight_shape"].to(torch.int64).numpy()}


def decompress_expert(packed: np.ndarray, scale_bf16: np.ndarray, shape, bits: int, group_size: int,
                      actorder: str | None = None) -> np.ndarray:
    """compressed-tensors' own decompression of one expert -> float32 [n, k] (for verification)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {"weight_packed": torch.from_numpy(np.ascontiguousarray(packed)),
             "weight_scale": _bf16_tensor(scale_bf16),
             "weight_shape": torch.tensor([int(x) for x in np.asarray(shape).reshape(-1)])}
    out = PackedQuantizationCompressor.decompress(state, scheme(bits, group_size, actorder))
    return out["weight"].to(torch.float32).numpy()

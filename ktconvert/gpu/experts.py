"""Routed-expert quantization for the GPU checkpoint: compressed-tensors ``pack-quantized`` W4A16 / W8A16.

RTN exactly as llmcompressor's ``model_free_ptq`` does it with compressed-tensors 0.19 on BF16 weights: per group
of `group_size` input columns (or per row: channel-wise), scale = BF16(max|w| / (range / 2)) (7.5 for int4, 127.5
for int8; a zero scale becomes the BF16 eps 2^-7), q = round_half_even(clamp(BF16(w / scale), qmin, qmax)), packed
by ``pack_to_int32``. It runs in C (``ktconvert.native.ct_quant``, chosen at run time like every kernel) or in numpy
(``ktconvert.quant.ct_int4``); no torch. Tests compare the bytes with compressed-tensors' own
``calculate_qparams`` + ``PackedQuantizationCompressor.compress`` and with what ``model_free_ptq`` writes.

Tensors per expert matrix W [n, k] (HF orientation):
  weight_packed  int32 [n, k * bits / 32]   (32/bits values per word, low bits first, stored q + 2^(bits-1))
  weight_scale   BF16 bits (uint16) [n, k / group_size] ([n, 1] channel-wise)
  weight_shape   int64 [2] = [n, k]
No zero point (symmetric), no g_idx. ``scheme`` and ``decompress_expert`` (GPTQ, verification) use
compressed-tensors itself, imported only there.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ktconvert.errors import ShapeError, UnknownNameError
from ktconvert.native import ct_quant
from ktconvert.quant import ct_int4

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
def scheme(bits: int, group_size: int, actorder: str | None = None, observer: str | None = None):
    """compressed-tensors QuantizationScheme: int, symmetric, group strategy, pack-quantized, targets ["Linear"];
    observer: the weight observer llmcompressor picks the scales with (None: its default, min-max; "mse": its
    MSE grid search, ``llmcompressor.observers.mse``)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    extra = {} if observer is None else {"observer": observer}
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group_size,
                            dynamic=False, actorder=actorder, **extra)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def _bf16_tensor(w_bf16: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(w_bf16).view(np.int16)).view(torch.bfloat16)


def quantize_expert_rtn(w_bf16: np.ndarray, bits: int, group_size: int | None, where: str = "", *,
                        impl: str | None = None, threads: int = 1) -> dict[str, np.ndarray]:
    """RTN-quantize one expert matrix. w_bf16: uint16 [n, k] BF16 bits; group_size None: channel-wise.

    Returns {"weight_packed": int32 [n, k*bits/32], "weight_scale": uint16 BF16 bits [n, k/group_size],
    "weight_shape": int64 [2]}. impl: None (native when built, else numpy), "numpy", or "scalar" | "avx2" |
    "avx512"; every choice gives the same bytes. NumericError on NaN/Inf (compressed-tensors would write garbage).
    """
    n, k = w_bf16.shape
    check_shape(n, k, bits, k if group_size is None else group_size, where)
    if impl != "numpy" and (impl is not None or ct_quant.usable()):
        packed, scale = ct_quant.rtn_quantize(w_bf16, bits, group_size, threads=threads, impl=impl,
                                              name=where or None)
    else:
        q, scale = ct_int4.quantize_sym_groups(w_bf16, k if group_size is None else group_size, bits, where)
        packed = ct_int4.pack_int32(q, bits, where)
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": np.array([n, k], np.int64)}


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

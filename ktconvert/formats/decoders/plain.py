"""Unquantized weights: BF16 as stored, F16 / F32 rounded to BF16 (round-to-nearest-even)."""
from __future__ import annotations

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.decoders.base import (FLOAT_DTYPES, FLOAT_FORMATS, Decoder, MatrixRefs, per_expert_shape,
                                             shape_error, tensor_ref)
from ktconvert.quant.bf16 import float_to_bf16_bits

_QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_scale_inv")


class PlainDecoder(Decoder):
    """``<module>.weight`` (or a fused ``[E, ...]`` tensor under its own name) in BF16 / F16 / F32."""

    scheme = "plain"

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return FLOAT_FORMATS[dtype]

    @classmethod
    def locate(cls, checkpoint, base: str, group, expert: int | None) -> MatrixRefs:
        t = checkpoint.tensors
        for suffix in _QUANTIZED_SUFFIXES:
            if f"{base}.{suffix}" in t:
                raise InputError("quantized tensor found for a module the quantization_config does not quantize "
                                 "(ignored or untargeted)", file=tensor_ref(checkpoint, f"{base}.{suffix}").file.name,
                                 tensor=f"{base}.{suffix}", hint="check quantization_config ignore / config_groups")
        name = base if base in t and expert is not None else f"{base}.weight"
        ref = tensor_ref(checkpoint, name)
        if ref.dtype not in FLOAT_DTYPES:
            raise shape_error(ref, "unquantized expert weight has an unsupported dtype", "BF16, F16 or F32",
                              ref.dtype)
        shape = per_expert_shape(ref, expert)
        if len(shape) != 2:
            raise shape_error(ref, "expert weight is not a matrix", "2-D [n, k]", str(list(shape)))
        return MatrixRefs(cls.scheme, name, {}, expert, shape, None)

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        return np.ascontiguousarray(float_to_bf16_bits(data, checkpoint.tensors[refs.primary].dtype))

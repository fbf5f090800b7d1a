"""gpt-oss ``quant_method: mxfp4``: ``W_blocks`` U8 [E, n, k/32, 16] (E2M1 nibbles) + ``W_scales`` U8 [E, n, k/32]
(E8M0 exponents); modules in ``modules_to_not_convert`` are plain."""
from __future__ import annotations

import numpy as np

from ktconvert.errors import ShapeError
from ktconvert.formats.decoders.base import (Decoder, MatrixRefs, QuantGroup, QuantScheme, per_expert_shape,
                                             read_partner, shape_error, tensor_ref)
from ktconvert.quant import mxfp4


class Mxfp4Decoder(Decoder):
    """E2M1 values in 32-element blocks with one E8M0 scale each."""

    scheme, quant_method = "mxfp4", "mxfp4"
    primary_suffixes = ("_blocks",)

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        ignore = tuple(qc.get("modules_to_not_convert") or ())
        return QuantScheme("mxfp4", "mxfp4", (QuantGroup(cls.scheme, num_bits=4, strategy="group", group_size=32),),
                           ignore)

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return "mxfp4"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        b = tensor_ref(checkpoint, f"{base}_blocks")
        s = tensor_ref(checkpoint, f"{base}_scales")
        for ref in (b, s):
            if ref.dtype not in ("U8", "F8_E8M0"):
                raise shape_error(ref, "MXFP4 tensor has the wrong dtype", "U8", ref.dtype)
        b_shape, s_shape = per_expert_shape(b, expert), per_expert_shape(s, expert)
        try:
            shape = mxfp4.check_shapes(b_shape, s_shape, where=b.name)
        except ShapeError as exc:
            raise shape_error(b, "MXFP4 blocks and scales disagree", exc.expected, exc.found) from None
        return MatrixRefs(cls.scheme, b.name, {"scale": s.name}, expert, shape, group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out"      # 32-element blocks along in-features

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        return mxfp4.dequant(data, read_partner(checkpoint, refs.partners["scale"], refs.index0), where)

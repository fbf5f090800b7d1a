"""AutoAWQ GEMM checkpoints (``quant_method: awq``, ``version`` / ``format`` "gemm"): per Linear ``qweight`` I32
[K, N/8] + ``qzeros`` I32 [G, N/8], both packed along out-features in AWQ's order (field i of a word holds column
AWQ_ORDER[i] of its eight), + ``scales`` F16 (or BF16 / F32) [G, N]; 4 bits, G = ceil(K / group_size). Fused
experts store the same tensors with a leading [E] axis. W[k, n] = (q - z) * scale, the stored zero is z.

``zero_point: false`` reads the fields as offset binary (z = 8, qzeros ignored), as compressed-tensors'
AutoAWQ converter does. GEMV / GEMV-fast / llm-awq packings are refused."""
from __future__ import annotations

import numpy as np

from ktconvert.formats.decoders.base import (Decoder, MatrixRefs, QuantGroup, QuantScheme, bad_config, matrix_shape,
                                             tensor_ref)
from ktconvert.formats.decoders.gptq import (check_scales, check_zeros, group_size_of, hf_ignore, int_arg, make_group,
                                             packed_refs, read_scale, read_zeros)
from ktconvert.quant import qweight

AWQ_BITS = (4,)


class AwqDecoder(Decoder):
    """AutoAWQ GEMM: 4-bit fields packed along out-features in AWQ's order, asymmetric by default."""

    scheme, quant_method = "awq", "awq"
    primary_suffixes = (".qweight",)

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        version = str(qc.get("version") or qc.get("format") or "gemm").lower()
        if str(qc.get("backend", "")).lower() == "llm-awq":
            version = "llm-awq"
        if version != "gemm":
            raise bad_config("unsupported AWQ packing", expected="version gemm", found=repr(version))
        bits = int_arg(qc, "bits", qc.get("w_bit", 4), AWQ_BITS)
        gs = group_size_of({"group_size": qc.get("group_size", qc.get("q_group_size", 128))})
        ignore = tuple(hf_ignore(qc.get("modules_to_not_convert")))
        sym = not bool(qc.get("zero_point", True))
        return QuantScheme("awq", f"awq-int{bits}", (make_group(cls.scheme, ("Linear",), bits, gs, sym),), ignore)

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return f"awq-int{group.num_bits}"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        qw, sc = packed_refs(checkpoint, base)
        bits, gs = group.num_bits, group.group_size
        k, words = matrix_shape(qw, expert)
        n = words * qweight.per_word(bits)
        groups = check_scales(qw, sc, expert, k, n, gs, "AWQ")
        partners = {"scale": sc.name}
        if not group.symmetric:
            partners["zeros"] = check_zeros(tensor_ref(checkpoint, f"{base}.qzeros"), expert, groups, n, bits).name
        elif f"{base}.qzeros" in checkpoint.tensors:
            partners["unused"] = f"{base}.qzeros"      # stored, not read (zero_point: false), still an expert tensor
        return MatrixRefs(cls.scheme, qw.name, partners, expert, (n, k), group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out"

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        group = refs.group
        n, k = refs.shape
        q = qweight.unpack_cols(data, group.num_bits, qweight.AWQ_ORDER, where)
        scale, product = read_scale(checkpoint, refs)
        zeros = read_zeros(checkpoint, refs, n, 0, qweight.AWQ_ORDER)
        return qweight.dequant(q, zeros, scale, group.group_size, product_dtype=product)

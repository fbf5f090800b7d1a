"""GPTQ checkpoints (AutoGPTQ, GPTQModel, transformers' GPTQConfig; ``quant_method: gptq``): per Linear
``qweight`` I32 [K*b/32, N] + ``qzeros`` I32 [G, N*b/32] + ``scales`` F16 (or BF16 / F32) [G, N] + optional
``g_idx`` I32 [K]; b = 2, 4 or 8 bits, G = ceil(K / group_size) (one group when group_size is -1). Fused experts
store the same tensors with a leading [E] axis. The math is ``ktconvert.quant.qweight``.

quantization_config: ``bits``, ``group_size``, ``sym``, ``desc_act``, ``checkpoint_format`` (transformers 5 also
writes it as ``format``): "gptq" (v1, the default: qzeros hold z - 1) or "gptq_v2" (qzeros hold z); Marlin /
BitBLAS repacked checkpoints are refused. ``modules_to_not_convert`` and GPTQModel's ``dynamic`` per-module
rules (``-:regex`` skips a module, ``+:regex`` / ``regex`` overrides bits / group_size / sym) select the group.

g_idx (act-order / desc_act checkpoints) is read whenever it is stored: column k uses scale and zero row g_idx[k],
as AutoGPTQ's and GPTQModel's torch dequantization do; a g_idx of k // group_size changes nothing. A symmetric
checkpoint without qzeros uses z = 2^(b-1)."""
from __future__ import annotations

import re

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.decoders.base import (FLOAT_DTYPES, Decoder, MatrixRefs, QuantGroup, QuantScheme, bad_config,
                                             checked_g_idx,
                                             float_values, matrix_shape, per_expert_shape, read_partner, shape_error,
                                             tensor_ref)
from ktconvert.quant import qweight

CHECKPOINT_FORMATS = {"gptq": "gptq", "gptq_v1": "gptq", "gptq_v2": "gptq-v2"}   # -> decoder scheme


def int_arg(qc: dict, key: str, default, allowed=None, where: str = "quantization_config"):
    value = qc.get(key, default)
    if type(value) is not int or (allowed is not None and value not in allowed):
        raise bad_config(f"bad {key} in {where}", expected=" or ".join(map(str, allowed)) if allowed else "an int",
                         found=repr(value))
    return value


def group_size_of(qc: dict, where: str = "quantization_config") -> int | None:
    """group_size: a positive int, or -1 (one group over all in-features: returned as None)."""
    gs = qc.get("group_size", 128)
    if type(gs) is not int or (gs <= 0 and gs != -1):
        raise bad_config(f"bad group_size in {where}", expected="a positive int or -1", found=repr(gs))
    return None if gs == -1 else gs


def hf_ignore(modules) -> list[str]:
    """transformers' ``modules_to_not_convert`` as ``re:`` patterns: an entry skips the modules it regex-matches
    from the start of the name, and those whose name ends with it."""
    out = []
    for m in modules or ():
        m = str(m)
        try:
            re.compile(m)
            out.append("re:" + m)
        except re.error:
            out.append("re:" + re.escape(m))
        out.append("re:.*" + re.escape(m) + "$")
    return out


def make_group(fmt: str, targets: tuple[str, ...], bits: int, gs: int | None, sym: bool) -> QuantGroup:
    return QuantGroup(fmt, targets, bits, "group" if gs else "channel", group_size=gs, symmetric=sym)


def checkpoint_scheme(qc: dict) -> str:
    """The decoder scheme, "gptq" (v1) or "gptq-v2", from checkpoint_format / format / is_marlin_format;
    bad_config otherwise."""
    if qc.get("is_marlin_format"):
        raise bad_config("Marlin-repacked GPTQ checkpoint", expected="checkpoint_format gptq or gptq_v2",
                         found="is_marlin_format: true")
    raw = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    fmt = CHECKPOINT_FORMATS.get(str(raw).lower())
    if fmt is None:
        raise bad_config("unsupported GPTQ checkpoint_format", expected="gptq or gptq_v2", found=repr(raw))
    return fmt


class GptqDecoder(Decoder):
    """``checkpoint_format: gptq`` (v1): the stored zero point is z - 1."""

    scheme, quant_method = "gptq", "gptq"
    primary_suffixes = (".qweight",)
    zero_offset = 1

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        fmt = checkpoint_scheme(qc)
        bits = int_arg(qc, "bits", 4, qweight.SUPPORTED_BITS)
        gs, sym = group_size_of(qc), bool(qc.get("sym", True))
        ignore = hf_ignore(qc.get("modules_to_not_convert"))
        groups = []
        dynamic = qc.get("dynamic") or {}
        if not isinstance(dynamic, dict):
            raise bad_config("bad dynamic in quantization_config", expected="an object", found=repr(dynamic))
        for pattern, override in dynamic.items():
            where = f"dynamic rule {pattern!r}"
            regex = str(pattern)[2:] if str(pattern)[:2] in ("-:", "+:") else str(pattern)
            try:
                re.compile(regex)
            except re.error as exc:
                raise bad_config(f"bad regex in {where}", found=str(exc)) from None
            if str(pattern).startswith("-:"):
                ignore.append("re:" + regex)
                continue
            override = override if isinstance(override, dict) else {}
            o_bits = int_arg(override, "bits", bits, qweight.SUPPORTED_BITS, where)
            o_gs = group_size_of({"group_size": override.get("group_size", gs or -1)}, where)
            groups.append(make_group(fmt, ("re:" + regex,), o_bits, o_gs, bool(override.get("sym", sym))))
        groups.append(make_group(fmt, ("Linear",), bits, gs, sym))
        return QuantScheme("gptq", f"gptq-int{bits}", tuple(groups), tuple(ignore))

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return f"gptq-int{group.num_bits}"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        qw, sc = packed_refs(checkpoint, base)
        bits, gs = group.num_bits, group.group_size
        rows, n = matrix_shape(qw, expert)
        k = rows * qweight.per_word(bits)
        groups = check_scales(qw, sc, expert, k, n, gs, f"{bits}-bit rows")
        partners = {"scale": sc.name}
        zeros = checkpoint.tensors.get(f"{base}.qzeros")
        if zeros is not None:
            partners["zeros"] = check_zeros(zeros, expert, groups, n, bits).name
        elif not group.symmetric:
            tensor_ref(checkpoint, f"{base}.qzeros")          # asymmetric without zero points: missing tensor
        g_idx = checkpoint.tensors.get(f"{base}.g_idx")
        if g_idx is not None:
            partners["g_idx"] = checked_g_idx(g_idx, expert, k).name
        return MatrixRefs(group.fmt, qw.name, partners, expert, (n, k), group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out"      # decoded from the input-major packing: always [out_features, in_features]

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        group = refs.group
        n, k = refs.shape
        q = qweight.unpack_rows(data, group.num_bits, where)
        scale, product = read_scale(checkpoint, refs)
        zeros = read_zeros(checkpoint, refs, n, cls.zero_offset)
        g_idx = None
        if "g_idx" in refs.partners:
            g_ref = checkpoint.tensors[refs.partners["g_idx"]]
            g_idx = checked_group_index(read_partner(checkpoint, g_ref.name, refs.index0), scale.shape[0],
                                        group.group_size, g_ref)
        return qweight.dequant(q, zeros, scale, group.group_size, g_idx, product_dtype=product)


class GptqV2Decoder(GptqDecoder):
    """``checkpoint_format: gptq_v2`` (GPTQModel): the stored zero point is z."""

    scheme, quant_method = "gptq-v2", None
    zero_offset = 0


# ---------------------------------------------------------------- shared with AWQ

def packed_refs(checkpoint, base: str):
    """(qweight, scales) TensorRefs of module `base` (GPTQ and AWQ name them alike), their dtypes checked."""
    qw = tensor_ref(checkpoint, f"{base}.qweight")
    sc = tensor_ref(checkpoint, f"{base}.scales")
    if qw.dtype != "I32":
        raise shape_error(qw, "qweight has the wrong dtype", "I32", qw.dtype)
    if sc.dtype not in FLOAT_DTYPES:
        raise shape_error(sc, "scales has the wrong dtype", "F16, BF16 or F32", sc.dtype)
    return qw, sc


def check_scales(qw, sc, expert: int | None, k: int, n: int, gs: int | None, packing: str) -> int:
    """The number of groups G = ceil(K / group_size) after checking scales is [G, N] (InputError naming scales
    when its N or rank is off, naming qweight when its K does not fit the scales' groups)."""
    groups = -(-k // gs) if gs else 1
    s_shape = tuple(per_expert_shape(sc, expert))
    if len(s_shape) != 2 or s_shape[1] != n:
        raise shape_error(sc, f"scales do not match the {n} out-features of qweight {list(qw.shape)}",
                          str([groups, n]), str(list(sc.shape)))
    if s_shape[0] != groups:
        fits = f"K in ({(s_shape[0] - 1) * gs}, {s_shape[0] * gs}]" if gs else "any K"
        raise shape_error(qw, f"qweight's in-features do not fit the {s_shape[0]} groups of scales (group_size "
                              f"{gs or -1}, {packing})", fits, f"K = {k}, qweight {list(qw.shape)}")
    return groups


def check_zeros(ref, expert: int | None, groups: int, n: int, bits: int, name: str = "qzeros"):
    """The zero-point tensor's header: I32 [groups, n*b/32] (n a multiple of 32/b)."""
    if ref.dtype != "I32":
        raise shape_error(ref, f"{name} has the wrong dtype", "I32", ref.dtype)
    per = qweight.per_word(bits)
    want = (groups, -(-n // per))
    if n % per or tuple(per_expert_shape(ref, expert)) != want:
        raise shape_error(ref, f"{name} do not match {groups} groups of {n} {bits}-bit zero points", str(list(want)),
                          str(list(ref.shape)))
    return ref


def read_scale(checkpoint, refs: MatrixRefs) -> tuple[np.ndarray, type]:
    """(float32 scale values [G, N], the product dtype: float16 for F16 scales, else float32)."""
    ref = checkpoint.tensors[refs.partners["scale"]]
    scale = float_values(read_partner(checkpoint, ref.name, refs.index0), ref.dtype)
    return scale, (np.float16 if ref.dtype == "F16" else np.float32)


def read_zeros(checkpoint, refs: MatrixRefs, n: int, offset: int, order=None) -> np.ndarray:
    """int16 [G, N] zero points: the stored fields + offset, or 2^(b-1) when none are stored."""
    bits = refs.group.num_bits
    if "zeros" not in refs.partners:
        groups = checkpoint.tensors[refs.partners["scale"]].shape[-2]
        return np.full((groups, n), 1 << (bits - 1), dtype=np.int16)
    packed = read_partner(checkpoint, refs.partners["zeros"], refs.index0)
    return qweight.unpack_cols(packed, bits, order).astype(np.int16) + np.int16(offset)


def checked_group_index(g_idx: np.ndarray, groups: int, group_size: int | None, ref) -> np.ndarray | None:
    """int64 [K] group of each input column, None when it is the plain k // group_size; InputError naming `ref`
    when an index is outside [0, groups)."""
    g = np.asarray(g_idx).reshape(-1).astype(np.int64)
    if g.size and (g.min() < 0 or g.max() >= groups):
        raise InputError("g_idx names a group that does not exist", file=ref.file.name, tensor=ref.name,
                         expected=f"group indices in [0, {groups})", found=f"[{int(g.min())}, {int(g.max())}]")
    plain = np.arange(g.size) // group_size if group_size else np.zeros(g.size, dtype=np.int64)
    return None if np.array_equal(g, plain) else g

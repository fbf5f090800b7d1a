"""compressed-tensors ``pack-quantized`` integer weights (Kimi-K2 INT4, W4A16, W8A16): ``W.weight_packed`` I32 +
``W.weight_scale`` + ``W.weight_shape`` [+ ``W.weight_zero_point`` when asymmetric]; group / channel / tensor.

Activation order "group" (GPTQ ``actorder: group``, compressed-tensors up to 0.18) stores ``W.weight_g_idx`` int32
[k]: column j belongs to group g_idx[j] (scale and zero point column g_idx[j]) instead of j // group_size.
compressed-tensors' decompression sorts the columns by g_idx, dequantizes consecutive groups and puts the columns
back; that is defined when every group holds exactly group_size columns, which is checked (a g_idx of all -1 is
"unset": column order, as compressed-tensors reads it). Channel and tensor strategies have one group per row, so
g_idx does not change them and is ignored, as compressed-tensors ignores it."""
from __future__ import annotations

import numpy as np

from ktconvert.formats.decoders.base import (FLOAT_DTYPES, Decoder, MatrixRefs, QuantGroup, bad_config, checked_g_idx,
                                             float_values, matrix_shape, per_expert_shape, read_partner, shape_error,
                                             tensor_ref)
from ktconvert.quant import ct_int4


class PackQuantizedDecoder(Decoder):
    """Integers packed into int32 words, low bits first, stored q + 2^(bits-1)."""

    scheme, ct_format = "pack-quantized", "pack-quantized"
    ct_description = "pack-quantized int 2/4/8-bit (group/channel/tensor)"
    primary_suffixes = (".weight_packed",)

    @classmethod
    def parse_ct_group(cls, name: str, group: dict, weights: dict) -> QuantGroup | None:
        strategy = str(weights.get("strategy", "tensor")).lower()
        bits = int(weights.get("num_bits", 8))
        if str(weights.get("type", "int")).lower() != "int" or bits not in ct_int4.SUPPORTED_BITS \
                or strategy not in ("group", "channel", "tensor"):
            return None
        gs = weights.get("group_size")
        if strategy == "group" and not (type(gs) is int and gs > 0):
            raise bad_config(f"config group {name!r}: group strategy without a positive group_size", found=repr(gs))
        return QuantGroup(cls.scheme, tuple(group.get("targets") or ("Linear",)), bits, strategy,
                          group_size=gs if strategy == "group" else None,
                          symmetric=bool(weights.get("symmetric", True)))

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return f"ct-int{group.num_bits}"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        p = tensor_ref(checkpoint, f"{base}.weight_packed")
        s = tensor_ref(checkpoint, f"{base}.weight_scale")
        partners = {"scale": s.name}
        if p.dtype != "I32":
            raise shape_error(p, "weight_packed has the wrong dtype", "I32", p.dtype)
        if s.dtype not in FLOAT_DTYPES:
            raise shape_error(s, "weight_scale has the wrong dtype", "BF16, F16 or F32", s.dtype)
        n, words = matrix_shape(p, expert)
        s_shape = per_expert_shape(s, expert)
        k = _packed_k(checkpoint, base, group, n, words, s_shape, partners, expert)
        if words != ct_int4.packed_cols(k, group.num_bits):
            raise shape_error(p, f"weight_packed width does not hold {k} values of {group.num_bits} bits",
                              f"[{n}, {ct_int4.packed_cols(k, group.num_bits)}]", str([n, words]))
        want = {"group": (n, k // group.group_size) if group.group_size else None,
                "channel": (n, 1)}.get(group.strategy)
        ok = tuple(s_shape) == want or (group.strategy == "tensor" and int(np.prod(s_shape)) == 1)
        if group.strategy == "group" and k % group.group_size:
            raise shape_error(p, "in_features not a multiple of group_size", f"k % {group.group_size} == 0",
                              f"k = {k}")
        if not ok:
            raise shape_error(s, f"weight_scale does not match [{n}, {k}] with strategy {group.strategy}",
                              str(list(want or [1])), str(list(s_shape)))
        if not group.symmetric:
            partners["zero_point"] = tensor_ref(checkpoint, f"{base}.weight_zero_point").name
        g_idx = checkpoint.tensors.get(f"{base}.weight_g_idx")
        if g_idx is not None and group.strategy == "group":
            partners["g_idx"] = checked_g_idx(g_idx, expert, k).name
        return MatrixRefs(cls.scheme, p.name, partners, expert, (n, k), group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out"      # packed along in-features, groups of in-features

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        group = refs.group
        n, k = refs.shape
        s_name = refs.partners["scale"]
        s_dtype = checkpoint.tensors[s_name].dtype
        scale = float_values(read_partner(checkpoint, s_name, refs.index0), s_dtype)
        zp = None
        if "zero_point" in refs.partners:
            zp_packed = read_partner(checkpoint, refs.partners["zero_point"], refs.index0)
            zp = ct_int4.unpack_int32(np.ascontiguousarray(zp_packed.T), n, group.num_bits, where).T
        product = np.float16 if s_dtype == "F16" else np.float32
        order = None
        if "g_idx" in refs.partners:
            g_ref = checkpoint.tensors[refs.partners["g_idx"]]
            order = group_order(read_partner(checkpoint, g_ref.name, refs.index0), k, group.group_size, g_ref)
        if order is None:
            return ct_int4.dequant_packed(data, k, group.num_bits, scale, group.group_size, zp,
                                          product_dtype=product, where=where)
        q = ct_int4.unpack_int32(np.ascontiguousarray(data), k, group.num_bits, where)
        grouped = ct_int4.dequant(np.ascontiguousarray(q[:, order]), scale, group.group_size, zp,
                                  product_dtype=product, where=where)
        bits = np.empty_like(grouped)
        bits[:, order] = grouped
        return bits


def _packed_k(checkpoint, base, group, n, words, s_shape, partners, expert=None) -> int:
    """in_features from weight_shape when present (it is tiny: read it; a fused one is [2] or [E, 2]), else from
    the group scale."""
    shape_name = f"{base}.weight_shape"
    if shape_name in checkpoint.tensors:
        partners["shape"] = shape_name
        ws = np.asarray(checkpoint.read(shape_name))
        ws = (ws[expert] if expert is not None and ws.ndim == 2 else ws).reshape(-1)
        if ws.size != 2 or int(ws[0]) != n:
            ref = checkpoint.tensors[shape_name]
            raise shape_error(ref, "weight_shape disagrees with weight_packed", f"[{n}, k]", str(ws.tolist()))
        return int(ws[1])
    if group.strategy == "group" and len(s_shape) == 2:
        return s_shape[1] * group.group_size
    return words * 32 // group.num_bits


def group_order(g_idx: np.ndarray, k: int, group_size: int, ref) -> np.ndarray | None:
    """int64 [k]: the column order that makes each group's columns consecutive (stable sort of g_idx), or None when
    the columns already are in group order (identity g_idx, or all -1 = unset). InputError naming `ref` (the g_idx
    tensor) unless g_idx maps exactly group_size columns to each of the k / group_size groups."""
    g_idx = np.asarray(g_idx).reshape(-1).astype(np.int64)
    unset = g_idx == -1
    if unset.all():
        return None
    groups = k // group_size
    if unset.any():
        raise shape_error(ref, "weight_g_idx mixes -1 (unset) with group indices", "all -1 or all in "
                          f"[0, {groups})", f"{int(unset.sum())} of {k} columns -1")
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise shape_error(ref, "weight_g_idx names a group that does not exist", f"group indices in [0, {groups})",
                          f"[{int(g_idx.min())}, {int(g_idx.max())}]")
    sizes = np.bincount(g_idx, minlength=groups)
    if (sizes != group_size).any():
        bad = int(np.flatnonzero(sizes != group_size)[0])
        raise shape_error(ref, "weight_g_idx does not give every group group_size columns",
                          f"{group_size} columns per group", f"group {bad} has {int(sizes[bad])}")
    order = np.argsort(g_idx, kind="stable")
    return None if np.array_equal(order, np.arange(k)) else order

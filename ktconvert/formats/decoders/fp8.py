"""FP8 (e4m3) weights with block scales: DeepSeek / Kimi / GLM ``quant_method: fp8`` block checkpoints
(``W.weight`` F8_E4M3 [n, k] + ``W.weight_scale_inv`` F32 or BF16 [ceil(n/bn), ceil(k/bk)]) and compressed-tensors
``float-quantized`` groups (llmcompressor FP8_BLOCK / FP8 channel / tensor: ``W.weight_scale``, often BF16).
Product in float32 (compressed-tensors ``FP8BlockDequantizer``; F16 scales of float-quantized multiply in F16).
``quant_method: fp8`` without ``weight_block_size``, and byte (E8M0) scales, are read by ``fp8_scaled``."""
from __future__ import annotations

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.decoders.base import (DECODERS, FLOAT_DTYPES, Decoder, MatrixRefs, QuantGroup, QuantScheme,
                                             bad_config, float_values, matrix_shape, per_expert_shape, read_partner,
                                             shape_error, tensor_ref)
from ktconvert.quant import fp8


def _block_of(value, what: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise bad_config(f"bad {what}", expected="[block_n, block_k] positive ints", found=repr(value))
    return int(value[0]), int(value[1])


def effective_block(group: QuantGroup, n: int, k: int) -> tuple[int, int]:
    """The (bn, bk) block the scale grid is made of: channel = (1, k), tensor = (n, k)."""
    if group.strategy == "channel":
        return 1, k
    if group.strategy == "tensor":
        return n, k
    return group.block


def _weight_name(checkpoint, base: str, expert: int | None) -> str:
    """``<base>.weight``, or a fused FP8 tensor stored under its own name (transformers 5: ``gate_up_proj`` +
    ``gate_up_proj_scale_inv``)."""
    return base if expert is not None and base in checkpoint.tensors else f"{base}.weight"


def fp8_refs(checkpoint, base: str, expert: int | None, suffixes: tuple[str, ...]):
    """(weight, scale) TensorRefs of an FP8 matrix, the weight's dtype checked (the scale's is the caller's)."""
    w = tensor_ref(checkpoint, _weight_name(checkpoint, base, expert))
    s = _scale_ref(checkpoint, w, suffixes)
    if w.dtype != "F8_E4M3":
        raise shape_error(w, "FP8 weight has the wrong dtype", "F8_E4M3", w.dtype)
    return w, s


def _scale_ref(checkpoint, weight, suffixes: tuple[str, ...]):
    """The scale tensor of FP8 weight `weight`: the weight's name + the first of `suffixes` present; InputError
    naming the shard holding the weight and the scheme's own scale name (suffixes[0]) when none is."""
    for suffix in suffixes:
        ref = checkpoint.tensors.get(weight.name + suffix)
        if ref is not None:
            return ref
    raise InputError("FP8 weight without its scale tensor", file=weight.file.name, tensor=weight.name + suffixes[0],
                     expected=" or ".join(weight.name + x for x in suffixes), found="neither")


class Fp8BlockDecoder(Decoder):
    """``quant_method: fp8`` with ``weight_block_size``: DeepSeek-convention block FP8."""

    scheme, quant_method = "fp8-block", "fp8"
    scale_suffixes = ("_scale_inv", "_scale")   # the scheme's own name first

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise bad_config("unsupported fp8 fmt", expected="e4m3", found=repr(qc.get("fmt")))
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        if qc.get("weight_block_size") is None:      # per-channel / per-tensor weight_scale (decoders.fp8_scaled)
            return QuantScheme("fp8", "fp8-scaled", (QuantGroup("fp8-scaled", strategy="channel"),), ignore)
        block = _block_of(qc["weight_block_size"], "weight_block_size")
        return QuantScheme("fp8", "fp8-block", (QuantGroup(cls.scheme, block=block),), ignore)

    @classmethod
    def input_format(cls, group, dtype: str) -> str:
        return "fp8-block" if group is None or group.strategy == "block" else f"fp8-{group.strategy}"

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
        w, s = fp8_refs(checkpoint, base, expert, cls.scale_suffixes)
        if s.dtype in ("U8", "F8_E8M0"):             # E8M0 exponents: MXFP8 (decoders.fp8_scaled)
            return DECODERS.get("mxfp8").locate(checkpoint, base, group, expert)
        if s.dtype not in FLOAT_DTYPES:
            raise shape_error(s, "FP8 scale has the wrong dtype", "F32, BF16 or F16", s.dtype)
        n, k = shape = matrix_shape(w, expert)
        s_shape = per_expert_shape(s, expert)
        want = fp8.block_scale_shape(n, k, effective_block(group, n, k))
        ok = tuple(s_shape) == want or (group.strategy == "channel" and tuple(s_shape) in ((n,), (n, 1))) \
            or (group.strategy == "tensor" and int(np.prod(s_shape)) == 1)
        if not ok:
            raise shape_error(s, f"scale shape does not match weight [{n}, {k}] in "
                                 f"{list(effective_block(group, n, k))} blocks", str(list(want)), str(list(s_shape)))
        return MatrixRefs(group.fmt, w.name, {"scale": s.name}, expert, shape, group)

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        return "out" if refs.group is not None and refs.group.strategy == "channel" else None

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        s_name = refs.partners["scale"]
        s_dtype = checkpoint.tensors[s_name].dtype
        scale = float_values(read_partner(checkpoint, s_name, refs.index0), s_dtype)
        n, k = refs.shape
        block = effective_block(refs.group, n, k)
        scale = scale.reshape(fp8.block_scale_shape(n, k, block))
        product = np.float16 if refs.kind == "float-quantized" and s_dtype == "F16" else np.float32
        return fp8.dequant_block(data, scale, block, product_dtype=product, where=where)


class FloatQuantizedDecoder(Fp8BlockDecoder):
    """compressed-tensors ``float-quantized`` 8-bit float groups: block / channel / tensor strategies."""

    scheme, quant_method, ct_format = "float-quantized", None, "float-quantized"
    scale_suffixes = ("_scale", "_scale_inv")
    ct_description = "float-quantized 8-bit float (block/channel/tensor)"

    @classmethod
    def parse_ct_group(cls, name: str, group: dict, weights: dict) -> QuantGroup | None:
        strategy = str(weights.get("strategy", "tensor")).lower()
        if str(weights.get("type", "int")).lower() != "float" or int(weights.get("num_bits", 8)) != 8 \
                or strategy not in ("block", "channel", "tensor"):
            return None
        block = _block_of(weights.get("block_structure"), "block_structure") if strategy == "block" else None
        return QuantGroup(cls.scheme, tuple(group.get("targets") or ("Linear",)), 8, strategy, block=block)


def grid_refs(checkpoint, base: str, block: tuple[int, int] | None = None, kind: str = "fp8-block") -> MatrixRefs:
    """MatrixRefs of an F8_E4M3 ``<base>.weight`` with a 2-D float scale grid (``weight_scale_inv`` or
    ``weight_scale``), for a non-expert linear: read in `block`, or without one in the block the grid implies
    ([ceil(n/sn), ceil(k/sk)]: [N, 1] is per channel), by the decoder of `kind` ("fp8-block", or
    "float-quantized": an F16 scale then multiplies in F16). InputError naming the scale when the grid does not
    cover the weight in that block."""
    w, s = fp8_refs(checkpoint, base, None, Fp8BlockDecoder.scale_suffixes)
    n, k = matrix_shape(w, None)
    if s.dtype not in FLOAT_DTYPES or len(s.shape) != 2:
        raise shape_error(s, "FP8 scale is not a 2-D float grid", "F32, BF16 or F16 [rows, cols]",
                          f"{s.dtype} {list(s.shape)}")
    sn, sk = s.shape
    block = block or (-(-n // sn), -(-k // sk))
    if tuple(s.shape) != fp8.block_scale_shape(n, k, block):
        raise shape_error(s, f"scale shape does not match weight [{n}, {k}] in {list(block)} blocks",
                          str(list(fp8.block_scale_shape(n, k, block))), str(list(s.shape)))
    return MatrixRefs(kind, w.name, {"scale": s.name}, None, (n, k), QuantGroup(kind, block=block))

"""Quantized HF inputs: detect the scheme from config.json, validate tensors from headers, decode one expert matrix.

Supported ``quantization_config`` forms (everything else is an InputError naming config.json):

* ``quant_method: fp8`` + ``weight_block_size`` (DeepSeek-V3 / Kimi-K2 / GLM FP8): ``W.weight`` F8_E4M3 [n, k] +
  ``W.weight_scale_inv`` (F32, or BF16) [ceil(n/bn), ceil(k/bk)]; product in float32 (compressed-tensors
  ``FP8BlockDequantizer``).
* ``quant_method: compressed-tensors``, group format ``float-quantized`` (llmcompressor FP8_BLOCK / FP8 channel):
  ``W.weight`` F8_E4M3 + ``W.weight_scale`` (often BF16); strategies block / channel / tensor.
* ``quant_method: compressed-tensors``, group format ``pack-quantized`` (Kimi-K2 INT4, W4A16, W8A16):
  ``W.weight_packed`` I32 + ``W.weight_scale`` + ``W.weight_shape`` [+ ``W.weight_zero_point``].
* ``quant_method: mxfp4`` (gpt-oss): ``W_blocks`` U8 [E, n, k/32, 16] + ``W_scales`` U8 [E, n, k/32].

Tensors of a module listed in ``ignore`` / ``modules_to_not_convert`` (or matching no config group) are read as
plain BF16 / F16 / F32 ``W.weight``. Matrices come back in nn.Linear orientation [n, k] = [out, in] as BF16 bits.

The hook for HFSource: ``scheme = detect_scheme(checkpoint.config)`` once, ``validate_matrix(...)`` for every
expert matrix at plan time (headers only), then ``decode_matrix(checkpoint, base_name, scheme, expert)``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ktconvert.errors import InputError, KtConvertError, ShapeError
from ktconvert.quant import ct_int4, fp8, mxfp4
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

CONFIG = "config.json"
FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class QuantGroup:
    """One compressed-tensors config group (or the single scheme of fp8 / mxfp4 checkpoints)."""

    fmt: str                         # "fp8-block" | "float-quantized" | "pack-quantized" | "mxfp4"
    targets: tuple[str, ...] = ("Linear",)
    num_bits: int = 8
    strategy: str = "block"          # block | channel | tensor | group
    block: tuple[int, int] | None = None
    group_size: int | None = None
    symmetric: bool = True


@dataclass(frozen=True)
class QuantScheme:
    """What config.json's quantization_config says; input_format is ExpertSource.input_format's value."""

    quant_method: str
    input_format: str                # "fp8-block" | "ct-int4" | "ct-int8" | "mxfp4"
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...] = field(default=())

    def group_for(self, module: str) -> QuantGroup | None:
        """The group quantizing `module` (a tensor base name), or None when it is ignored / untargeted."""
        if any(_name_matches(module, pat) for pat in self.ignore):
            return None
        for group in self.groups:
            if any(t == "Linear" or _name_matches(module, t) for t in group.targets):
                return group
        return None


def _name_matches(name: str, pattern: str) -> bool:
    """compressed-tensors rule: "re:<regex>" is re.match, anything else an exact name; gpt-oss's
    ``modules_to_not_convert`` entries are prefixes with ``*`` wildcards."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if "*" in pattern:
        return re.match(re.escape(pattern).replace(r"\*", r"[^.]*"), name) is not None
    return name == pattern or name.startswith(pattern + ".")


def _bad_config(msg: str, **kw) -> InputError:
    return InputError(msg, file=CONFIG, tensor="quantization_config", **kw)


def detect_scheme(config: dict) -> QuantScheme | None:
    """QuantScheme from config.json (or its text_config), None when the checkpoint is not quantized."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _bad_config("quantization_config is not an object", found=type(qc).__name__)
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8_scheme(qc)
    if method == "compressed-tensors":
        return _ct_scheme(qc)
    if method == "mxfp4":
        ignore = tuple(qc.get("modules_to_not_convert") or ())
        return QuantScheme("mxfp4", "mxfp4", (QuantGroup("mxfp4", num_bits=4, strategy="group", group_size=32),),
                           ignore)
    raise _bad_config("unsupported quant_method", expected="fp8, compressed-tensors or mxfp4",
                      found=repr(qc.get("quant_method")))


def _block_of(value, what: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise _bad_config(f"bad {what}", expected="[block_n, block_k] positive ints", found=repr(value))
    return int(value[0]), int(value[1])


def _fp8_scheme(qc: dict) -> QuantScheme:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise _bad_config("unsupported fp8 fmt", expected="e4m3", found=repr(qc.get("fmt")))
    if "weight_block_size" not in qc:
        raise _bad_config("fp8 checkpoint without weight_block_size", expected="weight_block_size [bn, bk]",
                          found="per-tensor fp8 (not supported)")
    block = _block_of(qc["weight_block_size"], "weight_block_size")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    return QuantScheme("fp8", "fp8-block", (QuantGroup("fp8-block", block=block),), ignore)


def _ct_group(name: str, group: dict, top_format: str | None) -> QuantGroup:
    fmt = group.get("format") or top_format
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _bad_config(f"config group {name!r} has no weights arguments")
    targets = tuple(group.get("targets") or ("Linear",))
    strategy = str(w.get("strategy", "tensor")).lower()
    bits, kind = int(w.get("num_bits", 8)), str(w.get("type", "int")).lower()
    if fmt == "float-quantized" and kind == "float" and bits == 8 and strategy in ("block", "channel", "tensor"):
        block = _block_of(w.get("block_structure"), "block_structure") if strategy == "block" else None
        return QuantGroup("float-quantized", targets, 8, strategy, block=block)
    if fmt == "pack-quantized" and kind == "int" and bits in ct_int4.SUPPORTED_BITS \
            and strategy in ("group", "channel", "tensor"):
        gs = w.get("group_size")
        if strategy == "group" and not (type(gs) is int and gs > 0):
            raise _bad_config(f"config group {name!r}: group strategy without a positive group_size",
                              found=repr(gs))
        return QuantGroup("pack-quantized", targets, bits, strategy, group_size=gs if strategy == "group" else None,
                          symmetric=bool(w.get("symmetric", True)))
    raise _bad_config(f"unsupported compressed-tensors scheme in group {name!r}",
                      expected="float-quantized 8-bit float (block/channel/tensor) or pack-quantized int 2/4/8-bit "
                               "(group/channel/tensor)",
                      found=f"format {fmt!r}, {kind} {bits}-bit, strategy {strategy!r}")


def _ct_scheme(qc: dict) -> QuantScheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _bad_config("compressed-tensors config without config_groups")
    parsed = tuple(_ct_group(str(k), v, qc.get("format")) for k, v in groups.items())
    first = parsed[0]
    fmt = "fp8-block" if first.fmt == "float-quantized" else f"ct-int{first.num_bits}"
    return QuantScheme("compressed-tensors", fmt, parsed, tuple(qc.get("ignore") or ()))


# ----------------------------------------------------------------------------------------------------------------
# Locating and validating one matrix (headers only)


@dataclass(frozen=True)
class MatrixRefs:
    """Where one expert matrix's data live. primary: the bulk tensor (codes / packed / blocks); partners: suffix ->
    tensor name (scale, zero point, shape); index0: the expert slice of a fused [E, ...] tensor, else None."""

    kind: str                        # "plain" | "fp8-block" | "float-quantized" | "pack-quantized" | "mxfp4"
    primary: str
    partners: dict
    index0: int | None
    shape: tuple[int, int]
    group: QuantGroup | None


def _ref(checkpoint, name: str):
    ref = checkpoint.tensors.get(name)
    if ref is None:
        raise InputError("tensor missing", file=getattr(checkpoint.root, "name", None), tensor=name)
    return ref


def _shape_error(ref, msg: str, expected, found) -> InputError:
    return InputError(msg, file=ref.file.name, tensor=ref.name, expected=expected, found=found)


def _per_expert_shape(ref, expert: int | None) -> tuple[int, ...]:
    """Shape of one expert's slice; a 3-D (fused) tensor needs an expert index in range."""
    shape = tuple(ref.shape)
    if expert is None:
        return shape
    if not shape or not 0 <= expert < shape[0]:
        raise _shape_error(ref, "expert index outside the fused tensor", f"index < {shape[0] if shape else 0}",
                           str(expert))
    return shape[1:]


def locate(checkpoint, base_name: str, scheme: QuantScheme | None, expert: int | None = None) -> MatrixRefs:
    """Which tensors hold `base_name` (a module name like ``model.layers.3.mlp.experts.7.up_proj``, or a fused
    ``...experts.gate_up_proj`` with `expert`), by the scheme and the tensors present. InputError on any mismatch."""
    t = checkpoint.tensors
    group = scheme.group_for(base_name) if scheme else None
    if group is not None and group.fmt == "mxfp4" and f"{base_name}_blocks" in t:
        return _locate_mxfp4(checkpoint, base_name, group, expert)
    if group is not None and group.fmt == "pack-quantized":
        return _locate_packed(checkpoint, base_name, group, expert)
    if group is not None and group.fmt in ("fp8-block", "float-quantized"):
        return _locate_fp8(checkpoint, base_name, group, expert)
    for suffix in ("weight_packed", "weight_scale", "weight_scale_inv"):
        if f"{base_name}.{suffix}" in t:
            raise InputError("quantized tensor found for a module the quantization_config does not quantize "
                             "(ignored or untargeted)", file=_ref(checkpoint, f"{base_name}.{suffix}").file.name,
                             tensor=f"{base_name}.{suffix}", hint="check quantization_config ignore / config_groups")
    name = base_name if base_name in t and expert is not None else f"{base_name}.weight"
    ref = _ref(checkpoint, name)
    if ref.dtype not in FLOAT_DTYPES:
        raise _shape_error(ref, "unquantized expert weight has an unsupported dtype", "BF16, F16 or F32", ref.dtype)
    shape = _per_expert_shape(ref, expert)
    if len(shape) != 2:
        raise _shape_error(ref, "expert weight is not a matrix", "2-D [n, k]", str(list(shape)))
    return MatrixRefs("plain", name, {}, expert, shape, None)


def _locate_fp8(checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
    w = _ref(checkpoint, f"{base}.weight")
    scale_name = f"{base}.weight_scale_inv" if f"{base}.weight_scale_inv" in checkpoint.tensors \
        else f"{base}.weight_scale"
    s = _ref(checkpoint, scale_name)
    if w.dtype != "F8_E4M3":
        raise _shape_error(w, "FP8 weight has the wrong dtype", "F8_E4M3", w.dtype)
    if s.dtype not in FLOAT_DTYPES:
        raise _shape_error(s, "FP8 scale has the wrong dtype", "F32, BF16 or F16", s.dtype)
    n, k = shape = _matrix_shape(w, expert)
    s_shape = _per_expert_shape(s, expert)
    block = _effective_block(group, n, k)
    want = fp8.block_scale_shape(n, k, block)
    ok = tuple(s_shape) == want or (group.strategy == "channel" and tuple(s_shape) in ((n,), (n, 1))) \
        or (group.strategy == "tensor" and int(np.prod(s_shape)) == 1)
    if not ok:
        raise _shape_error(s, f"scale shape does not match weight [{n}, {k}] in {list(block)} blocks",
                           str(list(want)), str(list(s_shape)))
    return MatrixRefs(group.fmt, w.name, {"scale": scale_name}, expert, shape, group)


def _effective_block(group: QuantGroup, n: int, k: int) -> tuple[int, int]:
    """The (bn, bk) block the scale grid is made of: channel = (1, k), tensor = (n, k)."""
    if group.strategy == "channel":
        return 1, k
    if group.strategy == "tensor":
        return n, k
    return group.block


def _matrix_shape(ref, expert: int | None) -> tuple[int, int]:
    shape = _per_expert_shape(ref, expert)
    if len(shape) != 2:
        raise _shape_error(ref, "expert weight is not a matrix", "2-D [n, k] per expert", str(list(ref.shape)))
    return shape


def _locate_packed(checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
    p = _ref(checkpoint, f"{base}.weight_packed")
    s = _ref(checkpoint, f"{base}.weight_scale")
    partners = {"scale": s.name}
    if p.dtype != "I32":
        raise _shape_error(p, "weight_packed has the wrong dtype", "I32", p.dtype)
    if s.dtype not in FLOAT_DTYPES:
        raise _shape_error(s, "weight_scale has the wrong dtype", "BF16, F16 or F32", s.dtype)
    n, words = _matrix_shape(p, expert)
    s_shape = _per_expert_shape(s, expert)
    k = _packed_k(checkpoint, base, group, n, words, s_shape, partners)
    if words != ct_int4.packed_cols(k, group.num_bits):
        raise _shape_error(p, f"weight_packed width does not hold {k} values of {group.num_bits} bits",
                           f"[{n}, {ct_int4.packed_cols(k, group.num_bits)}]", str([n, words]))
    want = {"group": (n, k // group.group_size) if group.group_size else None, "channel": (n, 1)}.get(group.strategy)
    ok = tuple(s_shape) == want or (group.strategy == "tensor" and int(np.prod(s_shape)) == 1)
    if group.strategy == "group" and k % group.group_size:
        raise _shape_error(p, "in_features not a multiple of group_size", f"k % {group.group_size} == 0", f"k = {k}")
    if not ok:
        raise _shape_error(s, f"weight_scale does not match [{n}, {k}] with strategy {group.strategy}",
                           str(list(want or [1])), str(list(s_shape)))
    if not group.symmetric:
        partners["zero_point"] = _ref(checkpoint, f"{base}.weight_zero_point").name
    return MatrixRefs("pack-quantized", p.name, partners, expert, (n, k), group)


def _packed_k(checkpoint, base, group, n, words, s_shape, partners) -> int:
    """in_features from weight_shape when present (it is tiny: read it), else from the group scale."""
    shape_name = f"{base}.weight_shape"
    if shape_name in checkpoint.tensors:
        partners["shape"] = shape_name
        ws = np.asarray(checkpoint.read(shape_name)).reshape(-1)
        if ws.size != 2 or int(ws[0]) != n:
            ref = checkpoint.tensors[shape_name]
            raise _shape_error(ref, "weight_shape disagrees with weight_packed", f"[{n}, k]", str(ws.tolist()))
        return int(ws[1])
    if group.strategy == "group" and len(s_shape) == 2:
        return s_shape[1] * group.group_size
    return words * 32 // group.num_bits


def _locate_mxfp4(checkpoint, base: str, group: QuantGroup, expert: int | None) -> MatrixRefs:
    b = _ref(checkpoint, f"{base}_blocks")
    s = _ref(checkpoint, f"{base}_scales")
    for ref in (b, s):
        if ref.dtype not in ("U8", "F8_E8M0"):
            raise _shape_error(ref, "MXFP4 tensor has the wrong dtype", "U8", ref.dtype)
    b_shape, s_shape = _per_expert_shape(b, expert), _per_expert_shape(s, expert)
    try:
        shape = mxfp4.check_shapes(b_shape, s_shape, where=b.name)
    except ShapeError as exc:
        raise _shape_error(b, "MXFP4 blocks and scales disagree", exc.expected, exc.found) from None
    return MatrixRefs("mxfp4", b.name, {"scale": s.name}, expert, shape, group)


def validate_matrix(checkpoint, base_name: str, scheme: QuantScheme | None, expected: tuple[int, int],
                    expert: int | None = None) -> MatrixRefs:
    """locate() plus a check that the matrix is [n, k] = expected; InputError naming file and tensor otherwise."""
    refs = locate(checkpoint, base_name, scheme, expert)
    if tuple(refs.shape) != tuple(expected):
        ref = checkpoint.tensors[refs.primary]
        raise _shape_error(ref, "expert matrix has the wrong shape", str(list(expected)), str(list(refs.shape)))
    return refs


# ----------------------------------------------------------------------------------------------------------------
# Decoding


def _read(checkpoint, name: str, index0: int | None) -> np.ndarray:
    ref = checkpoint.tensors[name]
    if index0 is None or len(ref.shape) < 2:
        return checkpoint.read(name)
    return checkpoint.read_slice(name, index0)


def _float_values(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Scale tensor as float32 values (BF16 arrives as uint16 bits)."""
    return bf16_bits_to_f32(arr) if dtype == "BF16" else np.asarray(arr, dtype=np.float32)


def _primary_array(checkpoint, refs: MatrixRefs, raw: np.ndarray | None) -> np.ndarray:
    """The primary tensor's expert slice, read here or taken from `raw` (its bytes, e.g. from a streaming read)."""
    ref = checkpoint.tensors[refs.primary]
    if raw is None:
        return _read(checkpoint, refs.primary, refs.index0)
    from ktconvert.formats.safetensors_reader import DTYPES

    shape = _per_expert_shape(ref, refs.index0)
    return np.frombuffer(np.ascontiguousarray(raw).reshape(-1).view(np.uint8),
                         dtype=np.dtype(DTYPES[ref.dtype][1])).reshape(shape)


def decode_matrix(checkpoint, base_name: str, scheme: QuantScheme | None, expert: int | None = None, *,
                  refs: MatrixRefs | None = None, raw: np.ndarray | None = None) -> np.ndarray:
    """One expert matrix as BF16 bits, uint16 [n, k] (nn.Linear orientation; a fused gpt-oss gate_up comes back as
    [2I, H] with gate/up rows still interleaved). `refs` skips locate(); `raw` supplies the primary tensor's
    bytes (the expert's slice) so a streaming reader need not read them twice."""
    refs = refs or locate(checkpoint, base_name, scheme, expert)
    data = _primary_array(checkpoint, refs, raw)
    where = refs.primary
    try:
        return _DECODERS[refs.kind](checkpoint, refs, data, where)
    except KtConvertError as exc:
        if exc.file is None:
            exc.file = checkpoint.tensors[refs.primary].file.name
            exc.args = (exc._format(),)
        raise


def _decode_plain(checkpoint, refs, data, where):
    dtype = checkpoint.tensors[refs.primary].dtype
    if dtype == "BF16":
        return np.ascontiguousarray(data, dtype=np.uint16)
    return f32_to_bf16_bits(np.asarray(data, dtype=np.float32))


def _decode_fp8(checkpoint, refs, data, where):
    s_name = refs.partners["scale"]
    s_dtype = checkpoint.tensors[s_name].dtype
    scale = _float_values(_read(checkpoint, s_name, refs.index0), s_dtype)
    n, k = refs.shape
    block = _effective_block(refs.group, n, k)
    scale = scale.reshape(fp8.block_scale_shape(n, k, block))
    product = np.float16 if refs.kind == "float-quantized" and s_dtype == "F16" else np.float32
    return fp8.dequant_block(data, scale, block, product_dtype=product, where=where)


def _decode_packed(checkpoint, refs, data, where):
    group = refs.group
    n, k = refs.shape
    s_name = refs.partners["scale"]
    s_dtype = checkpoint.tensors[s_name].dtype
    scale = _float_values(_read(checkpoint, s_name, refs.index0), s_dtype)
    zp = None
    if "zero_point" in refs.partners:
        zp_packed = _read(checkpoint, refs.partners["zero_point"], refs.index0)
        zp = ct_int4.unpack_int32(np.ascontiguousarray(zp_packed.T), n, group.num_bits, where).T
    product = np.float16 if s_dtype == "F16" else np.float32
    return ct_int4.dequant_packed(data, k, group.num_bits, scale, group.group_size, zp, product_dtype=product,
                                  where=where)


def _decode_mxfp4(checkpoint, refs, data, where):
    scales = _read(checkpoint, refs.partners["scale"], refs.index0)
    return mxfp4.dequant(data, scales, where)


_DECODERS = {"plain": _decode_plain, "fp8-block": _decode_fp8, "float-quantized": _decode_fp8,
             "pack-quantized": _decode_packed, "mxfp4": _decode_mxfp4}


# ----------------------------------------------------------------------------------------------------------------
# HFSource hook: decoders registered into ktconvert.formats.hf_source.DECODERS by input format.
# HFSource names a weight as the manifest does: "<module>.weight" per expert, or the fused "<...>.gate_up_proj".


def _base_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _hf_shape(checkpoint, name: str) -> tuple[int, ...]:
    """Decoded shape: [n, k], or [E, n, k] for a fused gpt-oss MXFP4 tensor (blocks [E, n, k/32, 16])."""
    scheme = detect_scheme(checkpoint.config)
    base = _base_of(name)
    blocks = checkpoint.tensors.get(f"{base}_blocks")
    if blocks is not None and len(blocks.shape) == 4:
        return (blocks.shape[0], *locate(checkpoint, base, scheme, 0).shape)
    return locate(checkpoint, base, scheme).shape


def _hf_decode(checkpoint, name: str, index0: int | None, raw: np.ndarray | None) -> np.ndarray:
    return decode_matrix(checkpoint, _base_of(name), detect_scheme(checkpoint.config), index0, raw=raw)


def _register_hf_decoders() -> None:
    from ktconvert.formats.hf_source import DECODERS, MatrixDecoder

    primaries = {"fp8-block": lambda n: n, "ct-fp8": lambda n: n, "ct-int4": lambda n: n + "_packed",
                 "mxfp4": lambda n: n + "_blocks"}
    for fmt, primary in primaries.items():
        if fmt not in DECODERS:
            DECODERS.register(fmt)(MatrixDecoder(shape=_hf_shape, decode=_hf_decode, primary=primary))


_register_hf_decoders()

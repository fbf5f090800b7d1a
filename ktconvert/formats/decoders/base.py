"""How a stored HF weight becomes BF16 bits: config.json's ``quantization_config`` parsed once into a QuantScheme,
one decoder per storage scheme in ``DECODERS``, and the three operations every reader of HF weights uses:

    scheme = detect_scheme(config)                 # the one parser of quantization_config (None: not quantized)
    refs = locate(checkpoint, base, scheme)        # headers only: which tensors hold the matrix, its shape
    bits = decode_matrix(checkpoint, base, scheme) # uint16 [n, k] BF16 bits, nn.Linear orientation

``base`` is a module name (``model.layers.3.mlp.experts.7.up_proj``) or a fused [E, ...] tensor name with
``expert`` selecting the slice. A decoder class (subclass of ``Decoder`` with its own ``scheme``) registers itself;
it parses its part of quantization_config (a top-level ``quant_method``, or a compressed-tensors group ``format``;
``claims`` takes a whole config first, DeepSeek-V4's ``quant_method: fp8``), finds its tensors (``locate``) and
decodes them. A float tensor stored under the weight's own name is read as plain BF16 / F16 / F32 whatever the
config says; a module the config ignores must be plain.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ktconvert.errors import InputError, KtConvertError, ShapeError
from ktconvert.formats.safetensors_reader import DTYPES
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.registry import Registry

CONFIG = "config.json"
FLOAT_DTYPES = ("BF16", "F16", "F32")
FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


@dataclass(frozen=True)
class QuantGroup:
    """One compressed-tensors config group (or the single scheme of fp8 / mxfp4 checkpoints)."""

    fmt: str                         # the decoder's scheme: "fp8-block" | "float-quantized" | "pack-quantized" | ...
    targets: tuple[str, ...] = ("Linear",)
    num_bits: int = 8
    strategy: str = "block"          # block | channel | tensor | group
    block: tuple[int, int] | None = None
    group_size: int | None = None
    symmetric: bool = True


@dataclass(frozen=True)
class QuantScheme:
    """What config.json's quantization_config says; input_format names the experts' format ("fp8-block",
    "ct-int4", "mxfp4", ...)."""

    quant_method: str
    input_format: str
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


@dataclass(frozen=True)
class MatrixRefs:
    """Where one matrix's data live. kind: the decoder's scheme; primary: the bulk tensor (codes / packed /
    blocks); partners: suffix -> tensor name (scale, zero point, shape); index0: the expert slice of a fused
    [E, ...] tensor, else None; shape: the decoded [n, k]."""

    kind: str
    primary: str
    partners: dict
    index0: int | None
    shape: tuple[int, int]
    group: QuantGroup | None


def _name_matches(name: str, pattern: str) -> bool:
    """compressed-tensors rule: "re:<regex>" is re.match, anything else an exact name; gpt-oss's
    ``modules_to_not_convert`` entries are prefixes with ``*`` wildcards."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if "*" in pattern:
        return re.match(re.escape(pattern).replace(r"\*", r"[^.]*"), name) is not None
    return name == pattern or name.startswith(pattern + ".")


def bad_config(msg: str, **kw) -> InputError:
    """An InputError naming config.json's quantization_config."""
    return InputError(msg, file=CONFIG, tensor="quantization_config", **kw)


# ---------------------------------------------------------------- the decoder classes

class Decoder:
    """One storage scheme of HF weights. Subclasses set ``scheme`` (registry key, QuantGroup.fmt) and register on
    definition; ``quant_method`` / ``ct_format`` say which part of quantization_config they parse."""

    scheme: ClassVar[str] = ""
    quant_method: ClassVar[str | None] = None   # a top-level quant_method this decoder parses alone
    ct_format: ClassVar[str | None] = None      # a compressed-tensors group format it parses
    ct_description: ClassVar[str] = ""          # what of that format it accepts, for error messages
    primary_suffixes: ClassVar[tuple[str, ...]] = ()   # where a module's bulk data lives if not "<module>.weight"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("scheme"):
            DECODERS.register(cls.scheme)(cls)

    @classmethod
    def claims(cls, config: dict) -> bool:
        """Whether this decoder parses config.json's quantization_config whatever its quant_method says."""
        return False

    @classmethod
    def parse_config(cls, qc: dict) -> QuantScheme:
        """The QuantScheme of a quantization_config whose quant_method is this decoder's."""
        raise NotImplementedError

    @classmethod
    def parse_ct_group(cls, name: str, group: dict, weights: dict) -> QuantGroup | None:
        """The QuantGroup of one compressed-tensors config group of this format, None when its weights arguments
        are not what this decoder reads."""
        return None

    @classmethod
    def input_format(cls, group: QuantGroup | None, dtype: str) -> str:
        """The input format of a matrix of this scheme (dtype: its primary tensor's safetensors dtype)."""
        raise NotImplementedError

    @classmethod
    def locate(cls, checkpoint, base: str, group: QuantGroup | None, expert: int | None) -> MatrixRefs:
        """The matrix's tensors, dtypes and shapes checked from headers; InputError naming file and tensor."""
        raise NotImplementedError

    @classmethod
    def decode(cls, checkpoint, refs: MatrixRefs, data: np.ndarray, where: str) -> np.ndarray:
        """uint16 [n, k] BF16 bits from the primary tensor's expert slice `data` (+ partners read here)."""
        raise NotImplementedError

    @classmethod
    def fixed_orientation(cls, refs: MatrixRefs) -> str | None:
        """"out" when this storage format only exists as [out_features, in_features] (it quantizes along
        in-features), so a fused tensor's orientation is known whatever its dims; None when it does not say."""
        return None


DECODERS: Registry = Registry("input decoder", base=Decoder)


# ---------------------------------------------------------------- quantization_config

def quantization_config_of(config: dict) -> dict | None:
    """config.json's quantization_config: top level, else the first nested config dict (text_config) holding
    one; None when there is none."""
    qc = config.get("quantization_config")
    if qc is None:
        qc = next((v["quantization_config"] for v in config.values()
                   if isinstance(v, dict) and v.get("quantization_config") is not None), None)
    return qc


def detect_scheme(config: dict) -> QuantScheme | None:
    """QuantScheme from config.json (or its text_config), None when the checkpoint is not quantized. InputError
    naming config.json for a quantization the decoders do not read."""
    qc = quantization_config_of(config)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise bad_config("quantization_config is not an object", found=type(qc).__name__)
    method = str(qc.get("quant_method", "")).lower()
    claimed = next((d for _, d in DECODERS.items() if d.claims(config)), None)
    if claimed is not None:
        return claimed.parse_config(qc)
    if method == "compressed-tensors":
        return _ct_scheme(qc)
    for _, decoder in DECODERS.items():
        if decoder.quant_method == method:
            return decoder.parse_config(qc)
    known = sorted(d.quant_method for _, d in DECODERS.items() if d.quant_method) + ["compressed-tensors"]
    raise bad_config("unsupported quant_method", expected=" or ".join(known), found=repr(qc.get("quant_method")))


def _ct_scheme(qc: dict) -> QuantScheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise bad_config("compressed-tensors config without config_groups")
    parsed = tuple(_ct_group(str(k), v, qc.get("format")) for k, v in groups.items())
    first = DECODERS.get(parsed[0].fmt)
    return QuantScheme("compressed-tensors", first.input_format(parsed[0], ""), parsed, tuple(qc.get("ignore") or ()))


def _ct_group(name: str, group: dict, top_format: str | None) -> QuantGroup:
    fmt = group.get("format") or top_format
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise bad_config(f"config group {name!r} has no weights arguments")
    for _, decoder in DECODERS.items():
        if decoder.ct_format and decoder.ct_format == fmt:
            parsed = decoder.parse_ct_group(name, group, weights)
            if parsed is not None:
                return parsed
    accepted = " or ".join(d.ct_description for _, d in DECODERS.items() if d.ct_format)
    raise bad_config(f"unsupported compressed-tensors scheme in group {name!r}", expected=accepted,
                     found=f"format {fmt!r}, {weights.get('type', 'int')} {weights.get('num_bits', 8)}-bit, "
                           f"strategy {str(weights.get('strategy', 'tensor')).lower()!r}")


def config_summary(config: dict) -> dict | None:
    """The keys of quantization_config a person looks at (inspect), whether or not a decoder reads it."""
    qc = quantization_config_of(config)
    if not isinstance(qc, dict):
        return None
    out = {k: qc[k] for k in ("quant_method", "format", "fmt", "weight_block_size", "bits", "group_size", "sym",
                              "desc_act", "checkpoint_format", "version", "zero_point", "quant_algo",
                              "activation_scheme") if k in qc}
    groups = qc.get("config_groups")
    if isinstance(groups, dict):
        out["config_groups"] = {name: {k: (g.get("weights") or {}).get(k) for k in
                                       ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure")
                                       if (g.get("weights") or {}).get(k) is not None}
                                for name, g in groups.items() if isinstance(g, dict)}
    return out


# ---------------------------------------------------------------- locating (headers only)

def tensor_ref(checkpoint, name: str):
    """The TensorRef of `name`; InputError naming the checkpoint when it is missing."""
    ref = checkpoint.tensors.get(name)
    if ref is None:
        raise InputError("tensor missing", file=getattr(checkpoint.root, "name", None), tensor=name)
    return ref


def shape_error(ref, msg: str, expected, found) -> InputError:
    return InputError(msg, file=ref.file.name, tensor=ref.name, expected=expected, found=found)


def per_expert_shape(ref, expert: int | None) -> tuple[int, ...]:
    """Shape of one expert's slice; a 3-D (fused) tensor needs an expert index in range."""
    shape = tuple(ref.shape)
    if expert is None:
        return shape
    if not shape or not 0 <= expert < shape[0]:
        raise shape_error(ref, "expert index outside the fused tensor", f"index < {shape[0] if shape else 0}",
                          str(expert))
    return shape[1:]


def matrix_shape(ref, expert: int | None) -> tuple[int, int]:
    shape = per_expert_shape(ref, expert)
    if len(shape) != 2:
        raise shape_error(ref, "expert weight is not a matrix", "2-D [n, k] per expert", str(list(ref.shape)))
    return shape


def plain_name(checkpoint, base: str, expert: int | None) -> str | None:
    """The float tensor holding `base` as is (``base`` itself for a fused tensor, else ``base.weight``), or None."""
    name = base if base in checkpoint.tensors and expert is not None else f"{base}.weight"
    ref = checkpoint.tensors.get(name)
    return name if ref is not None and ref.dtype in FLOAT_DTYPES else None


def has_weight(checkpoint, base: str) -> bool:
    """Whether some decoder's tensors for `base` are in the checkpoint (headers only)."""
    tensors = checkpoint.tensors
    return base in tensors or f"{base}.weight" in tensors or any(
        base + suffix in tensors for _, d in DECODERS.items() for suffix in d.primary_suffixes)


def checked_g_idx(ref, expert: int | None, k: int):
    """A g_idx tensor's header (compressed-tensors' weight_g_idx, GPTQ's g_idx): an integer vector of k group
    indices ([E, k] for a fused tensor); ShapeError naming it otherwise. Returns `ref`."""
    what = ref.name.rsplit(".", 1)[-1]
    if ref.dtype not in ("I32", "I64"):
        raise shape_error(ref, f"{what} has the wrong dtype", "I32 or I64", ref.dtype)
    shape = per_expert_shape(ref, expert) if expert is not None and len(ref.shape) == 2 else tuple(ref.shape)
    if tuple(shape) != (k,):
        raise shape_error(ref, f"{what} does not give a group to each of the {k} input columns", f"[{k}]",
                          str(list(ref.shape)))
    return ref


def locate(checkpoint, base_name: str, scheme: QuantScheme | None, expert: int | None = None) -> MatrixRefs:
    """Which tensors hold `base_name` (a module name like ``model.layers.3.mlp.experts.7.up_proj``, or a fused
    ``...experts.gate_up_proj`` with `expert`), by the scheme and the tensors present. InputError on any mismatch."""
    group = scheme.group_for(base_name) if scheme else None
    if group is None or plain_name(checkpoint, base_name, expert) is not None:
        return DECODERS.get("plain").locate(checkpoint, base_name, None, expert)
    return DECODERS.get(group.fmt).locate(checkpoint, base_name, group, expert)


def validate_matrix(checkpoint, base_name: str, scheme: QuantScheme | None, expected: tuple[int, ...],
                    expert: int | None = None, note: str = "") -> MatrixRefs:
    """locate() plus a check that the matrix is [n, k] = expected; ShapeError naming file and tensor otherwise
    (`note` explains the expected shape)."""
    refs = locate(checkpoint, base_name, scheme, expert)
    if tuple(refs.shape) != tuple(expected):
        ref = checkpoint.tensors[refs.primary]
        raise ShapeError("expert matrix shape disagrees with config.json", file=ref.file.name, tensor=ref.name,
                         expected=f"{list(expected)}{note}", found=str(list(refs.shape)))
    return refs


def input_format(checkpoint, refs: MatrixRefs) -> str:
    """The input format of a located matrix ("bf16", "fp8-block", "ct-int4", ...)."""
    return DECODERS.get(refs.kind).input_format(refs.group, checkpoint.tensors[refs.primary].dtype)


# ---------------------------------------------------------------- decoding

def read_partner(checkpoint, name: str, index0: int | None) -> np.ndarray:
    """A partner tensor (scale, zero point), its expert slice for a fused one."""
    ref = checkpoint.tensors[name]
    if index0 is None or len(ref.shape) < 2:
        return checkpoint.read(name)
    return checkpoint.read_slice(name, index0)


def float_values(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Scale tensor as float32 values (BF16 arrives as uint16 bits)."""
    return bf16_bits_to_f32(arr) if dtype == "BF16" else np.asarray(arr, dtype=np.float32)


def _primary_array(checkpoint, refs: MatrixRefs, raw: np.ndarray | None) -> np.ndarray:
    """The primary tensor's expert slice, read here or taken from `raw` (its bytes, e.g. from a streaming read)."""
    if raw is None:
        return read_partner(checkpoint, refs.primary, refs.index0)
    ref = checkpoint.tensors[refs.primary]
    shape = per_expert_shape(ref, refs.index0)
    return np.frombuffer(np.ascontiguousarray(raw).reshape(-1).view(np.uint8),
                         dtype=np.dtype(DTYPES[ref.dtype][1])).reshape(shape)


def stored_specs(checkpoint, base_name: str, refs: MatrixRefs) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """{suffix: (safetensors dtype, shape)} of the tensors one per-expert matrix `base_name` is stored as (its
    primary and partners, named ``<base_name>.<suffix>``), from the headers; None for a fused tensor's slice."""
    names = [refs.primary, *refs.partners.values()]
    if refs.index0 is not None or not all(n.startswith(base_name + ".") for n in names):
        return None
    return {n[len(base_name) + 1:]: (checkpoint.tensors[n].dtype, tuple(checkpoint.tensors[n].shape)) for n in names}


def stored_arrays(checkpoint, base_name: str, refs: MatrixRefs, raw: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """{suffix: array} of stored_specs' tensors exactly as stored (raw bits; the primary from `raw` when given)."""
    out = {refs.primary[len(base_name) + 1:]: _primary_array(checkpoint, refs, raw)}
    for name in refs.partners.values():
        out[name[len(base_name) + 1:]] = read_partner(checkpoint, name, None)
    return out


def decode_matrix(checkpoint, base_name: str, scheme: QuantScheme | None, expert: int | None = None, *,
                  refs: MatrixRefs | None = None, raw: np.ndarray | None = None) -> np.ndarray:
    """One matrix as BF16 bits, uint16 [n, k] (nn.Linear orientation; a fused gpt-oss gate_up comes back as
    [2I, H] with gate/up rows still interleaved). `refs` skips locate(); `raw` supplies the primary tensor's
    bytes (the expert's slice) so a streaming reader need not read them twice."""
    refs = refs or locate(checkpoint, base_name, scheme, expert)
    data = _primary_array(checkpoint, refs, raw)
    try:
        return DECODERS.get(refs.kind).decode(checkpoint, refs, data, refs.primary)
    except KtConvertError as exc:
        if exc.file is None:
            exc.file = checkpoint.tensors[refs.primary].file.name
            exc.args = (exc._format(),)
        raise

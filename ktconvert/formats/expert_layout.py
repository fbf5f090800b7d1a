"""Which layout holds a checkpoint's routed experts and which way its fused tensors are stored, decided from the
tensors present (headers only), never from the family: ``model_type`` gives the names, the checkpoint the layout.

    detect_layer(checkpoint, info, scheme, layer) -> LayerLayout | None    per_expert / fused / fused_separate
    decide_orientation(layouts, info, forced=None) -> {role: Orientation}  over every fused tensor of the model

Layouts and names: ``ktconvert.architectures.expert_names``.
Orientation of a fused role (gate_up, gate, up, down): "out" is
stored [E, out_features, in_features] (transformers' in-memory form: gate_up [E, 2I, H], down [E, H, I]), "in"
is [E, in, out] (gate_up [E, H, 2I], down [E, I, H]). Evidence, strongest first:

1. the storage format: compressed-tensors pack-quantized, MXFP4 and FP8 per-channel weights are quantized along
   in-features, so they are "out" whatever H and I are (Decoder.fixed_orientation);
2. the shape, when the role's per-expert matrix is not square (gate/up/down with H != I, gate_up with H != 2I);
3. for a square role: the other roles of the checkpoint, when every one decided by 1 or 2 agrees;
4. ``--expert-orientation out|in``, which settles square roles and must agree with everything else.
Otherwise the checkpoint is refused with an error naming the tensor and the flag.
"""
from __future__ import annotations

from dataclasses import dataclass

from ktconvert.errors import InputError, KtConvertError, ShapeError
from ktconvert.formats import decoders

ORIENTATIONS = ("out", "in")
ORIENTATION_FLAG = "--expert-orientation"
ROLE_PROJS = {"gate_up": ("gate", "up"), "gate": ("gate",), "up": ("up",), "down": ("down",)}
ROLE_DIMS = {"gate_up": ("2I", "H"), "gate": ("I", "H"), "up": ("I", "H"), "down": ("H", "I")}   # (out, in)


@dataclass(frozen=True)
class FusedTensor:
    """One fused role of one layer. name: the decoder's base name (the tensor itself, or the module of a
    compressed-tensors ``<name>.weight_packed``); stored: the per-expert matrix [a, b] as stored; experts: E of
    the stored tensor; fixed: the orientation its storage format imposes, or None; bias: [E, out] tensor or None."""

    role: str
    name: str
    stored: tuple[int, int] | None      # None: not located (quantized in a format no decoder reads)
    experts: int
    fixed: str | None
    bias: str | None = None

    @property
    def projs(self) -> tuple[str, ...]:
        return ROLE_PROJS[self.role]


@dataclass(frozen=True)
class LayerLayout:
    """The routed experts of one layer: kind ("per_expert", "fused", "fused_separate"), the MoE expert prefix
    they are under, and the fused tensors (none for per_expert)."""

    layer: int
    kind: str
    prefix: str
    tensors: tuple[FusedTensor, ...] = ()


@dataclass(frozen=True)
class Orientation:
    """How one fused role is stored ("out" or "in") and why (the evidence, as a sentence)."""

    value: str
    why: str


def dims_of(info) -> dict[str, int]:
    return {"H": info.hidden, "I": info.intermediate, "2I": 2 * info.intermediate}


def stored_label(role: str, orientation: str, experts: bool = True) -> str:
    """"[E, 2I, H]" etc.: the stored shape of `role` in `orientation`, in letters (without E: "[2I, H]")."""
    out, inp = ROLE_DIMS[role]
    dims = [out, inp] if orientation == "out" else [inp, out]
    return "[" + ", ".join((["E"] if experts else []) + dims) + "]"


# ---------------------------------------------------------------- detection (one layer)

def _base_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def candidate_layouts(info, layer: int) -> list[tuple[str, str, dict[str, str]]]:
    """[(kind, MoE prefix, {role: full name})] of every layout the family's names allow in `layer`; per_expert
    names expert 0's gate."""
    lay = info.manifest.experts
    out = [("per_expert", info.layer_name(lay.pattern.split(".{E}.")[0], layer),
            {"gate": info.expert_names(layer, 0)["gate"]})]
    for moe in lay.experts_prefixes():
        for kind, roles in lay.fused_candidates(moe):
            out.append((kind, info.layer_name(moe, layer), {r: info.layer_name(n, layer) for r, n in roles.items()}))
    return out


def detect_layer(checkpoint, info, scheme, layer: int, strict: bool = True) -> LayerLayout | None:
    """The layout of `layer`'s routed experts (headers only), None when no layout's first tensor is present.
    InputError when two layouts are present, or a fused layout lacks one of its tensors. strict=False (the
    scheme is unreadable): a fused tensor no decoder locates gets stored None instead of raising."""
    found = []
    for kind, prefix, roles in candidate_layouts(info, layer):
        first = next(iter(roles.values()))
        if decoders.has_weight(checkpoint, _base_of(first)) and (kind, prefix) not in [f[:2] for f in found]:
            found.append((kind, prefix, roles))
    if not found:
        return None
    if len(found) > 1:
        raise InputError(f"layer {layer} holds routed experts in more than one layout", file=_index_name(checkpoint),
                         tensor=next(iter(found[1][2].values())),
                         found=" and ".join(f"{k} under {p}" for k, p, _ in found), expected="one layout per layer")
    kind, prefix, roles = found[0]
    if kind == "per_expert":
        return LayerLayout(layer, kind, prefix)
    biases = info.manifest.experts.fused_bias_names({r: n for r, n in roles.items()})
    return LayerLayout(layer, kind, prefix, tuple(_fused_tensor(checkpoint, scheme, role, name, biases.get(role),
                                                                strict) for role, name in roles.items()))


def _fused_tensor(checkpoint, scheme, role: str, name: str, bias: str | None, strict: bool) -> FusedTensor:
    if not decoders.has_weight(checkpoint, name):
        raise InputError("missing fused expert tensor", file=_index_name(checkpoint), tensor=name,
                         hint="the other tensors of this layer are fused; every role needs its tensor")
    bias = bias if bias in checkpoint.tensors else None
    try:
        refs = decoders.locate(checkpoint, name, scheme, 0)
    except KtConvertError:
        if strict:
            raise
        return FusedTensor(role, name, None, 0, None, bias)
    primary = checkpoint.tensors[refs.primary]
    fixed = decoders.DECODERS.get(refs.kind).fixed_orientation(refs)
    return FusedTensor(role, name, tuple(refs.shape), primary.shape[0], fixed, bias)


def _index_name(checkpoint) -> str:
    if checkpoint.index_file is not None:
        return checkpoint.index_file.name
    return checkpoint.shards[0].path.name if len(checkpoint.shards) == 1 else checkpoint.root.name


# ---------------------------------------------------------------- orientation (the whole model)

def _fits(t: FusedTensor, dims: dict[str, int]) -> set[str]:
    out, inp = (dims[d] for d in ROLE_DIMS[t.role])
    return {o for o, shape in (("out", (out, inp)), ("in", (inp, out))) if tuple(t.stored) == shape}


def _check_tensor(checkpoint_name, t: FusedTensor, info) -> set[str]:
    """The orientations tensor `t` allows (shape and format); ShapeError when none."""
    dims, E = dims_of(info), info.n_experts
    fits = _fits(t, dims) if t.experts == E else set()
    out, inp = ROLE_DIMS[t.role]
    want = (f"{stored_label(t.role, 'out')} or {stored_label(t.role, 'in')} = [{E}, {dims[out]}, {dims[inp]}] or "
            f"[{E}, {dims[inp]}, {dims[out]}] (H={dims['H']}, I={dims['I']})")
    if not fits:
        raise ShapeError("fused expert tensor shape disagrees with config.json", file=checkpoint_name(t),
                         tensor=t.name, expected=want, found=str([t.experts, *t.stored]))
    if t.fixed is not None and t.fixed not in fits:
        raise ShapeError(f"fused expert tensor must be stored {stored_label(t.role, t.fixed)}: its format "
                         "quantizes along in-features", file=checkpoint_name(t), tensor=t.name,
                         expected=stored_label(t.role, t.fixed), found=str([t.experts, *t.stored]))
    return {t.fixed} if t.fixed else fits


def decide_orientation(layouts, info, checkpoint_name, forced: str | None = None) -> dict[str, Orientation]:
    """{role: Orientation} over the fused tensors of `layouts` (LayerLayout list). `forced`: the
    --expert-orientation value or None. checkpoint_name(FusedTensor) -> file name for messages.
    InputError / ShapeError when a role cannot be decided or contradicts another piece of evidence."""
    if forced is not None and forced not in ORIENTATIONS:
        raise InputError(f"bad {ORIENTATION_FLAG}", expected=" or ".join(ORIENTATIONS), found=repr(forced))
    allowed: dict[str, set[str]] = {}
    evidence: dict[str, FusedTensor] = {}
    for layout in layouts:
        for t in layout.tensors:
            fits = _check_tensor(checkpoint_name, t, info)
            joint = allowed.get(t.role, set(ORIENTATIONS)) & fits
            if not joint:
                raise ShapeError(f"fused {t.role} tensors of different layers are stored differently",
                                 file=checkpoint_name(t), tensor=t.name,
                                 expected=" or ".join(stored_label(t.role, o) for o in allowed[t.role]),
                                 found=str([t.experts, *t.stored]))
            allowed[t.role] = joint
            if len(fits) == 1 or t.role not in evidence:
                evidence[t.role] = t
    decided = {role: _why_single(evidence[role], info) for role, values in allowed.items() if len(values) == 1}
    for role, o in decided.items():
        if forced is not None and o.value != forced:
            raise InputError(f"{ORIENTATION_FLAG} {forced} contradicts the stored shape of {role}",
                             file=checkpoint_name(evidence[role]), tensor=evidence[role].name,
                             expected=stored_label(role, forced), found=f"{o.value}: {o.why}")
    out = dict(decided)
    for role in (r for r, values in allowed.items() if len(values) > 1):
        out[role] = _settle(role, evidence[role], decided, forced, info, checkpoint_name)
    return out


def _why_single(t: FusedTensor, info) -> Orientation:
    if t.fixed is not None:
        return Orientation(t.fixed, f"its format quantizes along in-features, so it is stored "
                                    f"{stored_label(t.role, t.fixed)}")
    value = next(iter(_fits(t, dims_of(info))))
    return Orientation(value, f"per expert it is {list(t.stored)} = {stored_label(t.role, value, False)} "
                              f"(H={info.hidden}, I={info.intermediate})")


def _settle(role: str, t: FusedTensor, decided: dict[str, Orientation], forced, info, checkpoint_name) -> Orientation:
    """A square (ambiguous) role: the flag, else the other roles' common orientation, else refuse."""
    out, inp = ROLE_DIMS[role]
    square = f"[E, {t.stored[0]}, {t.stored[1]}] fits both {stored_label(role, 'out')} and " \
             f"{stored_label(role, 'in')} ({out} == {inp} = {t.stored[0]})"
    if forced is not None:
        return Orientation(forced, f"{square}; {ORIENTATION_FLAG} {forced}")
    values = {o.value for o in decided.values()}
    if len(values) == 1:
        value = values.pop()
        others = ", ".join(sorted(decided))
        return Orientation(value, f"{square}; follows {others} (stored {value}-major)")
    raise InputError(f"cannot tell how the fused {role} tensor is stored: {square}"
                     + ("" if not decided else "; the other tensors disagree"), file=checkpoint_name(t),
                     tensor=t.name, hint=f"pass {ORIENTATION_FLAG} out (stored [E, out_features, in_features], "
                                         f"transformers' layout) or {ORIENTATION_FLAG} in ([E, in, out])")

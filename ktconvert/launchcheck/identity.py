"""What a weights folder holds, as ``ktconvert check`` identifies it from headers, names and byte sizes only.

``Identity``: the layout, the kt-kernel method that reads it (or None), the NUMA parts stored in the files
(converted formats only: in-place formats are split by kt-kernel in memory), the group size, the MoE layers, the
routed experts per layer, H and I, with ``how`` saying how each was inferred; ``notes`` state ambiguities instead
of guessing; ``problems`` are facts of the files that no launch flag repairs (kt-kernel refuses them or misreads
them whatever the command says).

``consolidate(per_layer, ...)``: one summary per MoE layer -> the folder's summary; layers that disagree (another
method, expert count or size) are a malformed folder: InputError (exit 3) naming the first two layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ktconvert.errors import InputError


@dataclass
class Identity:
    folder: str
    layout: str
    method: str | None
    layers: list[int]
    experts: int
    intermediate: int
    hidden: int
    numa: int | None = None
    group_size: int | None = None
    alternatives: tuple[str, ...] = ()
    how: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list = field(default_factory=list)        # text, or (text, effect): findings.EFFECTS
    facts: dict = field(default_factory=dict)
    registered: object = None           # the CpuMethod class of `method` where ktconvert has one
    source: object = None               # where the tensors are (for --deep): the identifier's own index

    def to_dict(self) -> dict:
        out = {"layout": self.layout, "method": self.method, "numa": self.numa, "group_size": self.group_size,
               "layers": self.layers, "experts": self.experts, "intermediate": self.intermediate,
               "hidden": self.hidden, "how": dict(self.how), "notes": list(self.notes),
               "problems": [p if isinstance(p, str) else p[0] for p in self.problems], "facts": dict(self.facts)}
        if self.alternatives:
            out["alternatives"] = list(self.alternatives)
        return out


@dataclass
class LayerSummary:
    """One MoE layer: its format label, experts, H, I, NUMA parts (converted formats), group size, how-strings."""

    layer: int
    label: str
    experts: int
    hidden: int
    intermediate: int
    numa: int | None = None
    group_size: int | None = None
    how: dict = field(default_factory=dict)

    def key(self) -> tuple:
        return self.label, self.experts, self.hidden, self.intermediate, self.numa, self.group_size


def consolidate(folder: str, summaries: list[LayerSummary]) -> LayerSummary:
    """The layers' common summary; InputError when two layers differ (mixed methods, experts or sizes)."""
    if not summaries:
        raise InputError("no routed experts found in any known kt-kernel layout", file=folder)
    first = summaries[0]
    for other in summaries[1:]:
        if other.key() != first.key():
            what = ("method" if other.label != first.label else "experts" if other.experts != first.experts else
                    "NUMA parts" if other.numa != first.numa else "group size"
                    if other.group_size != first.group_size else "matrix sizes")
            raise InputError(f"layers {first.layer} and {other.layer} differ in {what}: a folder kt-kernel reads "
                             "holds one format", file=folder, expected=_describe(first), found=_describe(other))
    return first


def _describe(s: LayerSummary) -> str:
    parts = [s.label, f"{s.experts} experts", f"H={s.hidden}", f"I={s.intermediate}"]
    if s.numa is not None:
        parts.append(f"NUMA {s.numa}")
    if s.group_size is not None:
        parts.append(f"group {s.group_size}")
    return f"layer {s.layer}: " + ", ".join(parts)


def expert_range(ids, layer: int, folder: str, what: str = "expert") -> int:
    """The count of ids 0..n-1; InputError when one is missing (kt-kernel probes from 0 and stops at the gap)."""
    ids = sorted(set(ids))
    missing = sorted(set(range(ids[-1] + 1)) - set(ids)) if ids else []
    if missing:
        raise InputError(f"layer {layer}: {what} {missing[0]} is missing (kt-kernel counts {what}s from 0 and "
                         f"stops there)", file=folder, expected=f"{what}s 0..{ids[-1]}",
                         found=f"{len(missing)} missing")
    return len(ids)

"""How a family names its routed experts (a manifest's ``[experts]`` table), for every storage layout.

The names are the family's data; the storage layout is the checkpoint's. A checkpoint of any family may hold
its routed experts in any of these layouts (``{moe}`` is one of the family's MoE expert prefixes, e.g.
``layers.{L}.mlp.experts``; the reader, ``formats/expert_layout.py``, decides which from the tensors present):

    per_expert      2-D per expert:  ``pattern`` with {E} and {proj}    gate/up [I, H], down [H, I]
    fused           3-D per layer:   {moe}.gate_up_proj  [E, 2I, H] or [E, H, 2I]
                                     {moe}.down_proj     [E, H, I]  or [E, I, H]
    fused_separate  3-D per layer:   {moe}.gate_proj, {moe}.up_proj [E, I, H] or [E, H, I] + {moe}.down_proj

``form`` only records the family's usual layout (a hint). A table may name just one layout; the others are
derived: a per-expert ``pattern`` gives ``{moe}`` (the part before ``.{E}.``), a fused ``gate_up`` gives it
(the part before its last dot) and the per-expert names ``{moe}.{E}.{gate,up,down}_proj.weight``.
``moe_prefixes`` adds prefixes where fused tensors of this family also appear (transformers 5 keeps Mixtral's
fused experts under ``mlp.experts``, not ``block_sparse_moe.experts``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ktconvert.errors import ManifestError

STANDARD_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
LAYOUT_KINDS = ("per_expert", "fused", "fused_separate")
EXPERT_KEYS = {"form", "pattern", "proj", "gate_up", "down", "gate_up_bias", "down_bias", "gate_up_interleaved",
               "mxfp4", "moe_prefixes"}


@dataclass(frozen=True)
class ExpertLayout:
    """A family's expert names; patterns are relative to the name prefix and use {L}, {E}, {proj}.

    form: the family's usual layout ("per_expert" or "fused"), a hint only. pattern + proj: per-expert names
    (proj maps gate/up/down to the file's names, e.g. w1/w3/w2). gate_up, down (+ biases): the fused names of the
    first MoE prefix. gate_up_interleaved: rows of gate_up alternate gate, up (gpt-oss; else the first I are gate).
    mxfp4: the hub may store each fused tensor as ``<name>_blocks`` + ``<name>_scales``.
    """

    form: str
    pattern: str = ""
    proj: dict[str, str] = field(default_factory=dict)
    gate_up: str = ""
    down: str = ""
    gate_up_bias: str = ""
    down_bias: str = ""
    gate_up_interleaved: bool = False
    mxfp4: bool = False
    moe_prefixes: tuple[str, ...] = ()

    def __post_init__(self):
        moe = self.gate_up.rsplit(".", 1)[0] if self.gate_up else self.pattern.split(".{E}.")[0]
        derived = {"proj": self.proj or dict(STANDARD_PROJ),
                   "pattern": self.pattern or moe + ".{E}.{proj}.weight",
                   "gate_up": self.gate_up or moe + ".gate_up_proj",
                   "down": self.down or moe + ".down_proj"}
        for key, value in derived.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "moe_prefixes", tuple(self.moe_prefixes))

    def experts_prefixes(self) -> tuple[str, ...]:
        """Every MoE expert prefix (with {L}) where this family's fused tensors may be: the fused names' own,
        the per-expert pattern's, then ``moe_prefixes``."""
        first = (self.gate_up.rsplit(".", 1)[0], self.pattern.split(".{E}.")[0])
        return tuple(dict.fromkeys(first + self.moe_prefixes))

    def fused_candidates(self, moe: str) -> list[tuple[str, dict[str, str]]]:
        """[(layout kind, {role: tensor name pattern})] of the fused layouts under prefix `moe`: gate_up + down,
        then separate gate / up / down (standard names, then the family's own projection names)."""
        if moe == self.gate_up.rsplit(".", 1)[0]:
            out = [("fused", {"gate_up": self.gate_up, "down": self.down})]
        else:
            out = [("fused", {"gate_up": f"{moe}.gate_up_proj", "down": f"{moe}.down_proj"})]
        for names in dict.fromkeys((tuple(STANDARD_PROJ.values()),
                                    (self.proj["gate"], self.proj["up"], self.proj["down"]))):
            out.append(("fused_separate", {role: f"{moe}.{name}" for role, name in zip(("gate", "up", "down"),
                                                                                       names)}))
        return out

    def fused_bias_names(self, names: dict[str, str]) -> dict[str, str]:
        """{role: bias tensor name pattern} next to the fused tensors `names` ({role: name}): the manifest's
        gate_up_bias / down_bias for its own fused names, else ``<name>_bias`` (used where present)."""
        declared = {self.gate_up: self.gate_up_bias, self.down: self.down_bias}
        return {role: declared.get(name) or name + "_bias" for role, name in names.items()}


    def name_regexes(self, prefix: str) -> list[re.Pattern]:
        """Regexes matching routed-expert tensor names under `prefix` in every layout, with any suffix
        (".weight_scale_inv", "_blocks"): the per-expert pattern ({L}, {E} captured), then each fused name."""
        fused = sorted({name for moe in self.experts_prefixes() for _, names in self.fused_candidates(moe)
                        for name in names.values()})
        return [_pattern_regex(prefix + self.pattern, self.proj)] + [
            re.compile(_pattern_regex(prefix + name).pattern + r"(?![.]?\d)") for name in fused]


def _pattern_regex(pattern: str, proj: dict[str, str] | None = None) -> re.Pattern:
    """A name pattern as a regex matching the name and any suffix: {L} and {E} capture numbers, {proj} any of
    the family's projection names."""
    regex = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    if proj:
        regex = regex.replace(r"\{proj\}", "(?:" + "|".join(re.escape(p) for p in proj.values()) + ")")
    return re.compile(regex)


def parse_experts(source: str, table: dict) -> ExpertLayout:
    """The [experts] table of manifest `source` (ManifestError naming the file on a bad table)."""
    for key in table:
        if key not in EXPERT_KEYS:
            raise ManifestError(f"unknown key [experts] {key!r}", file=source,
                                expected="one of " + ", ".join(sorted(EXPERT_KEYS)))
    form = table.get("form", "per_expert")
    if form == "per_expert":
        if not table.get("pattern") or ".{E}." not in table["pattern"] \
                or set(table.get("proj", {})) != {"gate", "up", "down"}:
            raise ManifestError("[experts] per_expert needs pattern (with .{E}.) and proj = {gate, up, down}",
                                file=source)
    elif form == "fused":
        if not table.get("gate_up") or not table.get("down"):
            raise ManifestError("[experts] fused needs gate_up and down", file=source)
    else:
        raise ManifestError("[experts] form", file=source, expected="per_expert or fused", found=repr(form))
    prefixes = table.get("moe_prefixes", [])
    if not isinstance(prefixes, list) or not all(isinstance(p, str) and "{L}" in p for p in prefixes):
        raise ManifestError("[experts] moe_prefixes must be a list of name patterns with {L}", file=source,
                            found=repr(prefixes))
    return ExpertLayout(form=form, **{k: v for k, v in table.items() if k != "form"})

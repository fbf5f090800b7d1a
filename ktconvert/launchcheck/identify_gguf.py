"""Identify a GGUF model (one file, a split set or a folder of ``*.gguf``): kt-kernel's LLAMAFILE method reads
``blk.L.ffn_{gate,up,down}_exps.weight`` (ggml ne [H, I, E] / [I, H, E]) as raw ggml blocks, each tensor of any
ggml type; which types a kt-kernel build runs is ``launchcheck.runtime``. Headers only (gguf_header)."""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

from ktconvert.formats.gguf_source import gguf_files
from ktconvert.launchcheck.identity import Identity, LayerSummary, consolidate
from ktconvert.launchcheck.identify_kt import _ranges
from ktconvert.launchcheck.readers import Reads
from ktconvert.methods import METHODS

GGUF_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")


def is_gguf(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and any(path.glob("*.gguf")))


def identify_gguf(path: Path, reads: Reads) -> Identity:
    files = gguf_files(path)
    tensors, meta = {}, {}
    for f in files:
        m, t = reads.gguf(f)
        meta.update(m)
        tensors.update({name: (f, ref) for name, ref in t.items()})
    per_layer: dict = defaultdict(dict)
    for name, (f, ref) in tensors.items():
        m = GGUF_EXPERT.match(name)
        if m:
            per_layer[int(m.group(1))][m.group(2)] = ref
    summaries, problems, types = [], [], Counter()
    by_proj: dict = defaultdict(Counter)
    for layer, refs in sorted(per_layer.items()):
        if "gate_up" in refs:
            problems.append(f"blk.{layer}.ffn_gate_up_exps: a fused gate/up tensor; kt-kernel's GGUF loader reads "
                            "separate ffn_gate_exps and ffn_up_exps")
            refs = dict(refs, gate=refs["gate_up"], up=refs["gate_up"])
        missing = [p for p in ("gate", "up", "down") if p not in refs]
        if missing:
            problems.append(f"blk.{layer}: no ffn_{missing[0]}_exps.weight")
            continue
        gate, down = refs["gate"].shape, refs["down"].shape
        experts, inter, hidden = (gate + (0, 0, 0))[:3] if len(gate) == 3 else (0, 0, 0)
        if "gate_up" in per_layer[layer]:
            inter //= 2
        if len(down) != 3 or down[1:] != (hidden, inter) or down[0] != experts:
            problems.append(f"blk.{layer}.ffn_down_exps is {list(down)}, not [E, H, I] = {[experts, hidden, inter]}")
        for proj in ("gate", "up", "down"):
            types[refs[proj].dtype] += 1
            by_proj[proj][refs[proj].dtype] += 1
        summaries.append(LayerSummary(layer, "GGUF", experts, hidden, inter))
    common = consolidate(str(path), summaries)
    layers = [s.layer for s in summaries]
    llamafile = METHODS.get("llamafile")
    identity = Identity(str(path), "GGUF", llamafile.kt_method, layers, common.experts, common.intermediate,
                        common.hidden, registered=llamafile, problems=problems,
                        facts={"gguf_types": dict(sorted(types.items())), "gguf_files": len(files),
                               "evidence": "GGUF ffn_*_exps tensors",
                               "architecture": meta.get("general.architecture")},
                        source=("gguf", {layer: refs for layer, refs in per_layer.items()}))
    identity.how.update({
        "method": f"{llamafile.kt_method}: GGUF file{'s' if len(files) > 1 else ''} ({len(files)}), "
                  "blk.L.ffn_{gate,up,down}_exps.weight",
        "experts": f"{common.experts} per layer: outer dimension of ffn_gate_exps",
        "intermediate": f"{common.intermediate}: ffn_gate_exps rows per expert",
        "hidden": f"{common.hidden}: ffn_down_exps rows per expert",
        "layers": f"{len(layers)} MoE layers: " + _ranges(layers),
        "gguf_types": "; ".join(f"{proj}: " + ", ".join(f"{t} x{n}" for t, n in sorted(c.items()))
                                for proj, c in by_proj.items()),
    })
    return identity

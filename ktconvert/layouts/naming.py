"""Names and part shapes of kt-kernel's CPU expert outputs (kt-format.md §2.3, §3.3, §3.4): pure string and index
math, shared by the sinks that write them, the plan that sizes them and the verifier that reads them.

* merged layout: ``model-{i:05d}-of-{N:05d}.safetensors`` shards with keys
  ``blk.{L}.ffn_{gate|up|down}_exps.{E}.numa.{t}.{weight|scale}`` and ``model.safetensors.index.json``;
* kt layout: ``_layer_{L}/_numa_{t}/{PREFIX}_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt``.

Per NUMA part t of T: gate/up are [n=I/T, k=H] (rows t*I/T..), down is [n=H, k=I/T] (input columns t*I/T..).
"""
from __future__ import annotations

import re

from ktconvert.errors import ShapeError

PROJS = ("gate", "up", "down")
INDEX_NAME = "model.safetensors.index.json"
_KT_RE = re.compile(r"^_layer_(\d+)/_numa_(\d+)/([A-Z0-9_]+?)_(gate|up|down)_(\d+)_(\d+)Byte_(quant|scale)_\.kt$")


def shard_name(i: int, total: int) -> str:
    """``model-{i:05d}-of-{total:05d}.safetensors`` (i counts from 1)."""
    return f"model-{i:05d}-of-{total:05d}.safetensors"


def merged_key(layer: int, proj: str, expert: int, t: int, part: str) -> str:
    """``blk.{L}.ffn_{proj}_exps.{E}.numa.{t}.{weight|scale}``."""
    return f"blk.{layer}.ffn_{proj}_exps.{expert}.numa.{t}.{part}"


def kt_relpath(layer: int, t: int, prefix: str, proj: str, expert: int, nbytes: int, part: str) -> str:
    """``_layer_{L}/_numa_{t}/{PREFIX}_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt`` (part: "quant" or "scale")."""
    return f"_layer_{layer}/_numa_{t}/{prefix}_{proj}_{expert}_{nbytes}Byte_{part}_.kt"


def parse_kt_relpath(rel: str) -> dict | None:
    """{layer, t, prefix, proj, expert, bytes, part} of a .kt file's relative path, or None."""
    m = _KT_RE.match(rel)
    if m is None:
        return None
    layer, t, prefix, proj, expert, nbytes, part = m.groups()
    return {"layer": int(layer), "t": int(t), "prefix": prefix, "proj": proj, "expert": int(expert),
            "bytes": int(nbytes), "part": part}


def key_for_kt_path(rel: str) -> str | None:
    """Merged tensor key of a .kt file's relative path, or None if `rel` is not a .kt expert file name."""
    f = parse_kt_relpath(rel)
    if f is None:
        return None
    return merged_key(f["layer"], f["proj"], f["expert"], f["t"], "weight" if f["part"] == "quant" else "scale")


def dense_key(name: str) -> str:
    """kt-kernel's non-expert renaming: leading ``model.layers.`` → ``blk.``, else strip one leading ``model.``."""
    if name.startswith("model.layers."):
        return "blk." + name[len("model.layers."):]
    if name.startswith("model."):
        return name[len("model."):]
    return name


def part_shape(proj: str, hidden: int, intermediate: int, numa: int) -> tuple[int, int]:
    """[n, k] of one NUMA part of `proj`: gate/up [I/T, H], down [H, I/T]."""
    if proj not in PROJS:
        raise ShapeError("unknown projection", expected="/".join(PROJS), found=repr(proj))
    if numa < 1 or intermediate % numa:
        raise ShapeError("intermediate size must be a multiple of the NUMA count",
                         expected="I % T == 0", found=f"I={intermediate}, T={numa}")
    part = intermediate // numa
    return (part, hidden) if proj in ("gate", "up") else (hidden, part)

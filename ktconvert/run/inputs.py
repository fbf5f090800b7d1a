"""The input of a conversion, resolved and opened once: a local path, or ``hf://ORG/NAME[@REV]`` /
``ms://ORG/NAME[@REV]`` downloaded and checked against the hub's hashes first (``ops.hub``), then opened with the
source format that reads it (``formats.sources``). Every plan and output of one command shares this object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.errors import InputError, OutputError
from ktconvert.formats.base import Source
from ktconvert.formats.sources import open_source
from ktconvert.ops import hub
from ktconvert.ops.hub_shards import resolve_in_part


@dataclass
class Input:
    """spec: the source as the user gave it; path: the local checkpoint; source: it opened (headers parsed, family
    resolved); hub: {"hub", "repo", "revision"} of a hub source, plus "expert_orientation" when the source was
    opened with one (recorded in the output manifests, so verify reopens it the same way), else {}; listing:
    {path: hub hash} of a hub source opened in part (what the Ray tasks check their hub against), else {}."""

    spec: str
    path: Path
    source: Source
    hub: dict = field(default_factory=dict)
    listing: dict = field(default_factory=dict)

    def check_output(self, out) -> None:
        """OutputError when folder `out` is the source, inside it or holds it (what every output refuses; plan
        refuses it too)."""
        out, src = Path(out).resolve(), self.path.resolve()
        if out == src or src in out.parents or out in src.parents:
            raise OutputError("output directory overlaps the source", file=out, hint="choose another OUT")


def open_input(src, expert_orientation: str | None = None, in_part: bool = False,
               listing: dict | None = None) -> Input:
    """Resolve and open `src` (an Input passes through). InputError when a local path does not exist.
    expert_orientation: ``--expert-orientation`` ("out" / "in") for square fused expert tensors, or None.
    in_part: a hub source's shards stay on the hub until read (ops.hub_shards; a plan, or a part of some layers,
    downloads only what it reads); listing: the Input.listing it must find (RemoteError otherwise)."""
    if isinstance(src, Input):
        return src
    spec = str(src)
    remote, found = None, {}
    if spec.startswith(("hf://", "ms://")) and in_part:
        path, extra, remote, found = resolve_in_part(spec, expect=listing or None)
    elif spec.startswith(("hf://", "ms://")):
        path, extra = hub.resolve_source(spec)
        path = Path(path)
    else:
        path, extra = Path(spec), {}
        if not path.exists():
            raise InputError("source does not exist", file=path)
    if expert_orientation is not None:
        extra = {**extra, "expert_orientation": expert_orientation}
    return Input(spec, path, open_source(path, expert_orientation, remote), extra, found)

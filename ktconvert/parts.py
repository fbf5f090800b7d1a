"""Parts of one conversion, by MoE layer range: what ``--layers A-B`` selects, the part manifest a part folder
holds when it is complete, and how a run is split into ranges of about equal source bytes.

A part folder holds exactly the files a single run would write for its layers, under the same names, plus
``ktconvert-part.json``::

    {"format": "ktconvert-part", "format_version": 1, "layers": [the part's MoE layers], "all_layers": [every MoE
     layer of the conversion], "writes_rest": bool, "options": {the journal options of the conversion},
     "manifest": {the ktconvert.json a single run writes, restricted to this part: its files, its tensors, the
     source files it read}}

The part holding the first MoE layer ``writes_rest``: it also writes the files that belong to no MoE layer (index,
config.json, copies, the non-expert shard) and reads the source files that hold no MoE layer. ``merge`` joins the
parts' files and the unions of their manifests (ktconvert.merge).
"""
from __future__ import annotations

import re
from pathlib import Path

from ktconvert.errors import InputError, UsageError
from ktconvert.formats.fileio import write_atomic
from ktconvert.formats.out_manifest import manifest_bytes
from ktconvert.safe_read import MAX_MANIFEST_BYTES, read_json

PART_NAME = "ktconvert-part.json"
PART_FORMAT = "ktconvert-part"
PART_FORMAT_VERSION = 1
PART_KEYS = {"layers": list, "all_layers": list, "writes_rest": bool, "options": dict, "manifest": dict}


def parse_range(text: str) -> tuple[int, int]:
    """'A-B' (inclusive decoder layer numbers) or 'A' -> (A, B); UsageError for anything else."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text or "")
    if not match:
        raise UsageError("--layers takes a range of decoder layer numbers", expected="A-B (e.g. 3-17) or A",
                         found=repr(text))
    first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
    if last < first:
        raise UsageError("--layers range is empty", expected="A-B with A <= B", found=text)
    return first, last


def select_layers(all_layers, layer_range) -> list[int] | None:
    """The MoE layers of `all_layers` inside `layer_range` ((A, B), 'A-B' or None: no part -> None); UsageError
    when the range holds none."""
    if layer_range is None:
        return None
    first, last = parse_range(layer_range) if isinstance(layer_range, str) else layer_range
    chosen = [layer for layer in all_layers if first <= layer <= last]
    if not chosen:
        raise UsageError(f"--layers {first}-{last} holds no MoE layer of this conversion",
                         expected=f"a range meeting layers {list(all_layers)}")
    return chosen


def balanced_ranges(layer_bytes: dict[int, int], parts: int) -> list[tuple[int, int]]:
    """Split the layers (keys, decoder layer numbers) into `parts` contiguous ranges of about equal source bytes:
    a range ends at the first layer where the running total reaches k/parts of all bytes. Every range holds at
    least one layer; UsageError when there are fewer layers than parts. Returns [(first, last)] in order."""
    layers = sorted(layer_bytes)
    if parts < 1 or parts > len(layers):
        raise UsageError("--parts must be between 1 and the number of MoE layers", expected=f"1..{len(layers)}",
                         found=str(parts))
    total = sum(layer_bytes.values()) or 1
    ranges, start, running = [], 0, 0
    for i, layer in enumerate(layers):
        running += layer_bytes[layer]
        left_layers, left_parts = len(layers) - i - 1, parts - len(ranges) - 1
        due = running * parts >= (len(ranges) + 1) * total
        if left_parts and (due or left_layers == left_parts) or i == len(layers) - 1:
            ranges.append((layers[start], layer))
            start = i + 1
    return ranges


def write_part(folder, layers: list[int], all_layers: list[int], writes_rest: bool, options: dict,
               manifest: dict) -> dict:
    """Write ``folder/ktconvert-part.json`` (atomically, sorted keys: the same part gives the same bytes)."""
    record = {"format": PART_FORMAT, "format_version": PART_FORMAT_VERSION, "layers": list(layers),
              "all_layers": list(all_layers), "writes_rest": bool(writes_rest), "options": options,
              "manifest": manifest}
    write_atomic(Path(folder) / PART_NAME, manifest_bytes(record))
    return record


def load_part(folder) -> dict:
    """The part manifest of `folder`; InputError naming the file when it is absent, unreadable or malformed."""
    path = Path(folder) / PART_NAME
    if not path.is_file():
        raise InputError("not a finished ktconvert part (no part manifest)", file=str(path),
                         hint="run or resume its `--layers` conversion first")
    record = read_json(path, what="part manifest", max_bytes=MAX_MANIFEST_BYTES)
    if not isinstance(record, dict) or record.get("format") != PART_FORMAT:
        raise InputError("not a ktconvert part manifest", file=str(path), expected=f'"format": "{PART_FORMAT}"')
    if record.get("format_version") != PART_FORMAT_VERSION:
        raise InputError("unsupported part manifest format_version", file=str(path),
                         expected=str(PART_FORMAT_VERSION), found=repr(record.get("format_version")))
    for key, kind in PART_KEYS.items():
        if not isinstance(record.get(key), kind):
            raise InputError(f"part manifest field {key!r} missing or not a {kind.__name__}", file=str(path))
    return record

"""The outputs one `ktconvert convert` writes from one read of the source: its targets, one table each.

A target names its kind (``kinds.KINDS``) by the key that holds its output folder, next to that output's options
(the fields of its options class a streaming pass can write: ``OutputKind.target_fields``)::

    {"cpu": "out/int4-numa2", "method": "amxint4", "numa": 2}
    {"cpu": "out/int8-numa1", "method": "amxint8", "numa": 1}
    {"gpu": "out/gpu", "experts": "w4a16"}

The command line builds this list from ``--cpu OUT [options] --gpu OUT [options] ...``, a targets file holds it as
``[[targets]]`` tables (relative folders resolved against the file's folder), and the Python API takes it as is
(``ktconvert.convert(src, targets=[...])``). Every table is checked against its kind's schema, generated from the
options' fields when the table is read (so a kind registered later is read the same way): an unknown key, a key of
another kind or a value of the wrong type is a UsageError (exit 2) naming the target and the key. Two targets may
not write the same folder, nor one inside the other. Light: imports nothing heavy (the command line classifies
its options with the same schema).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import OutputError, UsageError
from ktconvert.kinds import KINDS
from ktconvert.util.toml_schema import check_table, read_toml


@dataclass(frozen=True)
class Target:
    """One output of a pass: kind (a name in kinds.KINDS), out (its folder), values (fields of the kind's options),
    name (how messages call it: 'target 2 (cpu out/int8)')."""

    kind: str
    out: Path
    values: dict
    name: str


def is_gptq(target: Target) -> bool:
    """True for a target asking for --quant gptq (calibrated: each layer needs the previous one's outputs, so it is
    written alone, layer by layer, never in a shared pass or in parts)."""
    return str(target.values.get("quant", "")).strip().lower() == "gptq"


def parse_targets(tables, file: Path | None = None) -> list[Target]:
    """Targets from a list of tables (dicts as above); `file`: the targets file they came from (messages name it,
    relative folders are taken from its folder). UsageError for anything the schema does not allow."""
    if not isinstance(tables, (list, tuple)) or not tables:
        raise UsageError("targets must be a list of one or more tables", file=file,
                         expected='[{"cpu": OUT, "method": ...}, {"gpu": OUT, "experts": ...}, ...]',
                         found=repr(tables)[:80])
    targets = [parse_target(table, index, file) for index, table in enumerate(tables, 1)]
    refuse_shared_folders(targets)
    return targets


def parse_target(table, index: int, file: Path | None = None) -> Target:
    """Target number `index` (1-based) from its table."""
    if not isinstance(table, dict):
        raise UsageError(f"target {index} must be a table", file=file, found=repr(table)[:80])
    kinds = [kind for kind in KINDS.names() if kind in table]
    if len(kinds) != 1:
        raise UsageError(f"target {index} needs exactly one of {' / '.join(map(repr, KINDS.names()))} (its output "
                         f"folder)", file=file, found=", ".join(map(repr, kinds)) or "neither")
    kind = kinds[0]
    out = table[kind]
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise UsageError(f"target {index}: {kind!r} must be the output folder (a string)", file=file,
                         found=repr(out)[:80])
    name = f"target {index} ({kind} {out})"
    values = {key: value for key, value in table.items() if key != kind}
    check_table(values, KINDS.get(kind).target_fields(), set(), file, name, UsageError)
    missing = [key for key in KINDS.get(kind).required() if key not in values]
    if missing:
        raise UsageError(f"{name}: {missing[0]!r} is required", file=file)
    folder = Path(out) if file is None or Path(out).is_absolute() else Path(file).parent / out
    return Target(kind, folder, values, name)


def load_targets(path) -> list[Target]:
    """The targets of a targets file: TOML with one ``[[targets]]`` table per output (nothing else)."""
    path = Path(path)
    data = read_toml(path, "targets file", UsageError)
    unknown = sorted(set(data) - {"targets"})
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r}", file=path, expected="[[targets]] tables only")
    if "targets" not in data:
        raise UsageError("no targets", file=path, expected="one or more [[targets]] tables")
    return parse_targets(data["targets"], path)


def refuse_shared_folders(targets: list[Target]) -> None:
    """UsageError when two targets would write the same folder, or one inside the other's."""
    seen: list[tuple[Path, Target]] = []
    for target in targets:
        folder = target.out.resolve()
        for other_folder, other in seen:
            if folder == other_folder or other_folder in folder.parents or folder in other_folder.parents:
                relation = "the same folder" if folder == other_folder else "nested folders"
                raise UsageError(f"{other.name} and {target.name} write {relation}",
                                 expected="every output in its own folder", found=str(folder))
        seen.append((folder, target))


def disk_needs(needs: list[tuple[Path, int]], free_at) -> list[dict]:
    """What the outputs need per filesystem: [{"path" (the folder probed), "free_bytes", "need_bytes", "outputs"
    [folders], "ok"}]. needs: (output folder, bytes it will hold); free_at(path) -> (existing folder probed, free
    bytes)."""
    by_device: dict[int, dict] = {}
    for out, nbytes in needs:
        probe, free = free_at(out)
        entry = by_device.setdefault(os.stat(probe).st_dev, {"path": probe, "free_bytes": free, "need_bytes": 0,
                                                             "outputs": []})
        entry["need_bytes"] += nbytes
        entry["outputs"].append(str(out))
    return [{**entry, "ok": entry["need_bytes"] <= entry["free_bytes"]} for entry in by_device.values()]


def check_disk(needs: list[tuple[Path, int]], free_at) -> list[dict]:
    """disk_needs' list; OutputError when the outputs that land on one filesystem need more than its free space
    together (one output alone is checked by its own plan)."""
    groups = disk_needs(needs, free_at)
    for group in groups:
        if len(group["outputs"]) > 1 and not group["ok"]:
            raise OutputError("not enough free disk space for these outputs together",
                              file=", ".join(group["outputs"]), expected=f">= {group['need_bytes']} bytes free",
                              found=f"{group['free_bytes']} bytes at {group['path']}")
    return groups

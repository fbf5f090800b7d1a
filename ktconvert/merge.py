"""``ktconvert merge OUT PART...``: one output folder from the parts of a conversion (``--layers A-B`` runs).

    load every part manifest -> check they agree (options, source config, everything a single run's manifest
    records besides its files), that their layers neither overlap nor leave a gap, that every MoE layer is held
    and that each part's files are there with their recorded size (``verify``: also their sha256, every byte read)
    -> under OUT's lock: OUT/.ktconvert-merge.json names the merge (the sha256 of the manifest it will write)
    -> hard-link each file into OUT; where OUT is on another filesystem copy it, hashing the bytes as they are
       copied, and compare with the part manifest's sha256 (VerifyError, exit 4, on a difference)
    -> ktconvert.json = the parts' manifests joined (files, tensors and source files united), written last; then
       the merge journal is removed

OUT is then byte-identical to a single run's, ktconvert.json included, whatever the split and the order of the
parts. Refusals of the parts are InputError (exit 3) naming the part folders concerned, and nothing is written
before those checks passed. An interrupted merge leaves OUT without ktconvert.json (it never looks complete) and
with its journal: the same merge run again (parts in any order) keeps the files already in place and finishes it;
run on a finished OUT it changes nothing. The part folders are left as they are (hard links share their bytes).
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import InputError, OutputError, VerifyError
from ktconvert.formats.fileio import (copy_hashed, fsync_dir, hash_file, open_dir, remove_name, temp_path_for,
                                      write_atomic)
from ktconvert.formats.out_manifest import LOCK_NAME, MANIFEST_NAME, manifest_bytes, write_manifest
from ktconvert.output import lock_folder
from ktconvert.parts import load_part
from ktconvert.safe_read import MAX_MANIFEST_BYTES, read_json

JOINED = ("files", "tensors")          # manifest tables united across parts
SOURCE_JOINED = "files"                # ... and source.files
MERGE_JOURNAL = ".ktconvert-merge.json"   # in OUT while a merge runs: {"format", "manifest_sha256"}
MERGE_FORMAT = "ktconvert-merge"


@dataclass(frozen=True)
class MergeResult:
    """What merge wrote: OUT, the parts in layer order, files linked / copied, bytes."""

    out: str
    parts: tuple[str, ...]
    files: int
    copied: int
    bytes: int

    def to_dict(self) -> dict:
        return {"out": self.out, "parts": list(self.parts), "files": self.files, "copied": self.copied,
                "bytes": self.bytes}

    def summary(self) -> str:
        how = f" ({self.copied} copied across filesystems)" if self.copied else ""
        return f"merged {len(self.parts)} parts into {self.out}: {self.files} files, {self.bytes} bytes{how}"


def merge(out, parts, *, verify: bool = False) -> MergeResult:
    """Join the part folders `parts` (any order) into `out`: a new or empty folder, an unfinished merge of the
    same parts (finished), or a finished one (left as is); see the module docstring. verify: the sha256 of every
    part file checked against its part manifest before anything is written (VerifyError, exit 4)."""
    loaded = sorted(((Path(p), load_part(p)) for p in parts), key=lambda item: min(item[1]["layers"]))
    if not loaded:
        raise InputError("no parts given", expected="one or more part folders")
    check_parts(loaded)
    manifest = joined_manifest(loaded)
    files = _file_sources(loaded)
    if verify:
        _verify_part_files(files, manifest["files"])
    out = Path(out)
    _prepare(out, [folder for folder, _ in loaded])
    fd = lock_folder(out)
    try:
        identity = hashlib.sha256(manifest_bytes(manifest)).hexdigest()
        _begin(out, identity)
        copied = sum(_place(source, out / rel, manifest["files"][rel], out) for rel, source in sorted(files.items()))
        for folder in {(out / rel).parent for rel in files}:
            fsync_dir(folder)
        write_manifest(out, manifest)
        (out / MERGE_JOURNAL).unlink(missing_ok=True)
        fsync_dir(out)
    finally:
        (out / LOCK_NAME).unlink(missing_ok=True)
        os.close(fd)
    return MergeResult(str(out), tuple(str(f) for f, _ in loaded), len(files), copied,
                       sum(int(entry["bytes"]) for entry in manifest["files"].values()))


def unfinished(out) -> bool:
    """True when folder `out` holds an unfinished merge (its journal), which running the same merge finishes."""
    return (Path(out) / MERGE_JOURNAL).is_file()


def check_parts(loaded: list[tuple[Path, dict]]) -> None:
    """InputError unless the parts are of one conversion and hold every MoE layer exactly once."""
    first_folder, first = loaded[0]
    reference = _comparable(first)
    for folder, record in loaded[1:]:
        comparable = _comparable(record)
        for key in sorted(set(reference) | set(comparable)):
            if comparable.get(key) != reference.get(key):
                raise InputError(f"parts of different conversions ({key} differs)",
                                 file=f"{folder} vs {first_folder}", expected=_short(reference.get(key)),
                                 found=_short(comparable.get(key)))
    owner: dict[int, Path] = {}
    for folder, record in loaded:
        for layer in record["layers"]:
            if layer in owner:
                raise InputError(f"parts overlap: both hold MoE layer {layer}", file=f"{owner[layer]} and {folder}",
                                 hint="give each layer range once")
            owner[layer] = folder
    all_layers = first["all_layers"]
    stray = sorted(set(owner) - set(all_layers))
    if stray:
        raise InputError("part holds layers outside the conversion", file=str(owner[stray[0]]),
                         expected=f"layers of {all_layers}", found=f"layer {stray[0]}")
    missing = [layer for layer in all_layers if layer not in owner]
    if missing:
        raise InputError(f"{len(missing)} MoE layer(s) held by no part (a part is missing)",
                         found="layers " + _ranges(missing), hint="convert them with --layers and merge again")
    if sum(record["writes_rest"] for _, record in loaded) != 1:
        raise InputError("no part (or more than one) holds the files outside the MoE layers",
                         expected="the part of the first MoE layer")


def _comparable(record: dict) -> dict:
    """What every part of one conversion records alike: options (its own range aside), the layers of the whole
    conversion, and its manifest except the joined tables."""
    manifest = {k: v for k, v in record["manifest"].items() if k not in JOINED}
    source = {k: v for k, v in manifest.pop("source", {}).items() if k != SOURCE_JOINED}
    options = {k: v for k, v in record["options"].items() if k != "part"}
    return {"options": options, "all_layers": record["all_layers"], "source": source,
            **{f"manifest.{k}": v for k, v in manifest.items()}}


def joined_manifest(loaded: list[tuple[Path, dict]]) -> dict:
    """The single run's ktconvert.json: the first part's manifest with files, tensors and source files united;
    InputError where two parts record one file differently (a source file both read must have one digest)."""
    manifest = {k: v for k, v in loaded[0][1]["manifest"].items()}
    manifest["source"] = dict(manifest["source"])
    tables = {"files": {}, "tensors": {}, "source files": {}}
    for folder, record in loaded:
        part = record["manifest"]
        for name, table in (("files", part["files"]), ("tensors", part["tensors"]),
                            ("source files", part["source"][SOURCE_JOINED])):
            for key, value in table.items():
                if key in tables[name] and tables[name][key][1] != value:
                    raise InputError(f"parts record {name} entry {key!r} differently",
                                     file=f"{tables[name][key][0]} and {folder}")
                tables[name].setdefault(key, (folder, value))
    manifest["files"] = {k: v for k, (_, v) in tables["files"].items()}
    manifest["tensors"] = {k: v for k, (_, v) in tables["tensors"].items()}
    manifest["source"][SOURCE_JOINED] = dict(sorted((k, v) for k, (_, v) in tables["source files"].items()))
    return manifest


def _file_sources(loaded: list[tuple[Path, dict]]) -> dict[str, Path]:
    """{relative path in OUT: the part's file}; InputError for a file two parts hold or one that is missing or
    not of its recorded size."""
    found: dict[str, Path] = {}
    for folder, record in loaded:
        for rel, entry in record["manifest"]["files"].items():
            path = folder / rel
            if rel in found:
                raise InputError("parts overlap: both hold the file", file=f"{found[rel].parent} and {folder}",
                                 tensor=rel)
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise InputError("part manifest names a file outside its folder", file=str(folder), tensor=rel)
            if not path.is_file() or path.stat().st_size != int(entry["bytes"]):
                raise InputError("part file missing or not of its recorded size", file=str(path),
                                 expected=f"{entry['bytes']} bytes",
                                 found=f"{path.stat().st_size} bytes" if path.is_file() else "no file")
            found[rel] = path
    return found


def _verify_part_files(files: dict[str, Path], entries: dict) -> None:
    """VerifyError naming the first part file whose sha256 is not its part manifest's (every byte read)."""
    for rel, path in sorted(files.items()):
        _check_digest(path, entries[rel], hash_file(path)[1])


def _check_digest(path: Path, entry: dict, sha256: str) -> None:
    if sha256 != entry["sha256"]:
        raise VerifyError("part file differs from its part manifest", file=str(path), expected=f"sha256 "
                          f"{entry['sha256']}", found=f"sha256 {sha256}",
                          hint="convert that part again (--force), then merge again")


def _prepare(out: Path, part_folders: list[Path]) -> None:
    """OUT must be a folder (created here) and not one of the parts."""
    if out.exists() and not out.is_dir():
        raise OutputError("output path exists and is not a directory", file=str(out))
    if out.resolve() in {p.resolve() for p in part_folders}:
        raise OutputError("OUT is one of the parts", file=str(out), hint="merge into a new folder")
    out.mkdir(parents=True, exist_ok=True)


def _begin(out: Path, identity: str) -> None:
    """Under OUT's lock: start the merge named `identity` in an empty OUT (its journal written), or go on with an
    unfinished or finished merge of the same name; OutputError for any other content."""
    journal, manifest = out / MERGE_JOURNAL, out / MANIFEST_NAME
    if journal.is_file():
        record = read_json(journal, what="merge journal", max_bytes=MAX_MANIFEST_BYTES)
        if not isinstance(record, dict) or record.get("manifest_sha256") != identity:
            raise OutputError(f"OUT holds an unfinished merge of other parts ({MERGE_JOURNAL})", file=str(out),
                              hint="run that merge again to finish it, or merge into a new folder")
        return
    if manifest.is_file() and hashlib.sha256(manifest.read_bytes()).hexdigest() == identity:
        return                                  # finished: checked again, nothing changes
    if any(p.name != LOCK_NAME for p in out.iterdir()):
        raise OutputError("output directory exists and is not empty", file=str(out),
                          hint="merge into a new or empty folder")
    write_atomic(journal, manifest_bytes({"format": MERGE_FORMAT, "manifest_sha256": identity}))


def _place(source: Path, target: Path, entry: dict, out: Path) -> bool:
    """Hard-link `source` as `target` (its folders below `out` created); copied (temp name, hashed while copied
    and compared with `entry`'s sha256, renamed) across filesystems. A regular file already there from an earlier
    run of this merge (the same file, or a copy of the recorded size: copies are renamed only once checked) is
    kept; anything else (a symlink: the link itself) is removed first. No folder below `out` and no name is ever
    followed as a symlink (``fileio.open_dir`` / ``NewFile``). True when copied."""
    folder = open_dir(target.parent, within=out)
    try:
        remove_name(temp_path_for(target), folder)           # an interrupted copy
        try:
            there = os.lstat(target.name, dir_fd=folder)
        except FileNotFoundError:
            there = None
        if there is not None and stat.S_ISREG(there.st_mode):
            linked = os.stat(source)
            if (there.st_dev, there.st_ino) == (linked.st_dev, linked.st_ino) or there.st_size == int(entry["bytes"]):
                return False
        remove_name(target, folder)
        try:
            os.link(source, target.name, dst_dir_fd=folder)
            return False
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise OutputError(f"cannot link part file ({exc.strerror})", file=str(target)) from None
    finally:
        os.close(folder)
    copy_hashed(source, target, check=lambda sha256: _check_digest(source, entry, sha256), within=out)
    return True


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _ranges(layers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    spans, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a != start else str(a))
            start = b
    return ", ".join(spans)

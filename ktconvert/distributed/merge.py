"""``ktconvert merge OUT PART...``: one output folder from the parts of a conversion (``--layers A-B`` runs).

    load every part manifest (``parts.load_part``: every field's type, plain relative output names only) -> check
    they agree (options, source config, everything a single run's manifest records besides its files), that they
    were made from one source checkpoint (``check_sources``), that their layers neither overlap nor leave a gap,
    that every MoE layer is held and that each part's files are there, regular files (no symlink) of their
    recorded size (``verify``: also every file and tensor hash, every byte read, before anything is written)
    -> under OUT's lock: OUT/.ktconvert-merge.json names the merge (the sha256 of the manifest it will write)
    -> part by part, hard-link each file into OUT, or where OUT is on another filesystem copy it; every file is
       proven against its part manifest as it is placed (``verification.merge_proof``: file and tensor sha256s, one read;
       VerifyError, exit 4, on a difference), the proofs kept in the journal so a rerun does not hash again
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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import InputError, OutputError
from ktconvert.formats.fileio import fsync_dir, open_dir, remove_name, temp_path_for, write_atomic
from ktconvert.formats.out_manifest import LOCK_NAME, MANIFEST_NAME, manifest_bytes, write_manifest
from ktconvert.verification.merge_proof import PartProof, Proofs, hash_pool
from ktconvert.run.output import lock_folder
from ktconvert.distributed.parts import load_part
from ktconvert.util.safe_read import MAX_MANIFEST_BYTES, read_json

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


def merge(out, parts, *, verify: bool = False, source: dict | None = None) -> MergeResult:
    """Join the part folders `parts` (any order) into `out`: a new or empty folder, an unfinished merge of the
    same parts (finished), or a finished one (checked again, left as is); see the module docstring. Every part
    file is proven against its part manifest as it is placed (VerifyError, exit 4). verify: also every part file
    proven before anything is written (one more read of every byte). source: the ``parts.source_sample`` the
    parts must record (the Ray driver's SRC: parts reused from an earlier run of another checkpoint are refused)."""
    loaded = sorted(((Path(p), load_part(p)) for p in parts), key=lambda item: min(item[1]["layers"]))
    if not loaded:
        raise InputError("no parts given", expected="one or more part folders")
    check_parts(loaded)
    check_sources(loaded, source)
    manifest = joined_manifest(loaded)
    files = _file_sources(loaded)
    out = Path(out)
    with hash_pool() as pool, _cancelled_on_error(pool):
        if verify:
            for folder, record in loaded:
                proof = PartProof(folder, record, pool)
                for rel in sorted(record["manifest"]["files"]):
                    proof.hash_in_place(folder, rel)
                proof.finish()
        _prepare(out, [folder for folder, _ in loaded])
        fd = lock_folder(out)
        try:
            identity = hashlib.sha256(manifest_bytes(manifest)).hexdigest()
            proofs = _begin(out, identity)
            copied = 0
            for folder, record in loaded:
                proof = PartProof(folder, record, pool, proofs)
                for rel in sorted(record["manifest"]["files"]):
                    copied += _place(files[rel], out / rel, manifest["files"][rel], out, proof)
                proof.finish()
            _finish(out, files, manifest)
        finally:
            (out / LOCK_NAME).unlink(missing_ok=True)
            os.close(fd)
    return MergeResult(str(out), tuple(str(f) for f, _ in loaded), len(files), copied,
                       sum(int(entry["bytes"]) for entry in manifest["files"].values()))


@contextmanager
def _cancelled_on_error(pool):
    """The hashes still queued in `pool` dropped when the merge fails (those running are waited for)."""
    try:
        yield
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise


def _finish(out: Path, files: dict, manifest: dict) -> None:
    """Every placed file's folder fsynced, ktconvert.json written (last), the merge journal removed."""
    for folder in {(out / rel).parent for rel in files}:
        fsync_dir(folder)
    write_manifest(out, manifest)
    (out / MERGE_JOURNAL).unlink(missing_ok=True)
    fsync_dir(out)


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
        raise InputError(f"{len(missing)} MoE layer(s) held by no part (a part is missing): layers "
                         f"{_ranges(missing)}", expected=f"parts covering layers {_ranges(all_layers)}",
                         found=f"parts holding layers {_ranges(sorted(owner))}",
                         hint=f"convert the missing ones with --layers {_ranges(missing).replace(', ', ',')} and merge "
                         "again")
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


def check_sources(loaded: list[tuple[Path, dict]], expected: dict | None = None) -> None:
    """InputError unless the parts were made from one source checkpoint: their source samples are equal (a
    sample of every source file, or the hub listing: ``parts.source_sample``), and `expected` when given, and
    each part's own source files are in it with their size. (The config's sha256 is compared with the options; a
    source file two parts read must have one sha256: ``joined_manifest``.)"""
    first_folder, first = loaded[0]
    reference = first["source_sample"]
    if expected is not None and reference != expected:
        raise InputError("part was converted from another source checkpoint than SRC", file=str(first_folder),
                         hint="convert the parts again (--force)")
    for folder, record in loaded:
        identity = record["source_sample"]
        if identity != reference:
            table = next(iter(reference)) if set(identity) == set(reference) else None
            names = sorted(set(reference.get(table, {})) | set(identity.get(table, {})))
            differs = next((n for n in names if reference[table].get(n) != identity[table].get(n)), None) \
                if table else None
            raise InputError("parts of different source checkpoints (a source file differs)",
                             file=f"{folder} vs {first_folder}", tensor=differs,
                             hint="convert every part from the same SRC")
        known = identity["files"] if "files" in identity else identity["listing"]
        for name, entry in record["manifest"]["source"][SOURCE_JOINED].items():
            sampled = known.get(name)
            if sampled is None or "files" in identity and sampled["bytes"] != entry["bytes"]:
                raise InputError("part read a source file its source sample does not hold", file=str(folder),
                                 tensor=name, hint="convert the part again")


def _file_sources(loaded: list[tuple[Path, dict]]) -> dict[str, Path]:
    """{relative path in OUT: the part's file}; InputError for a file two parts hold, one that is missing, not a
    regular file of its recorded size, or reached through a symlink inside the part (ktconvert never makes one:
    one there could make OUT hold something from outside the part)."""
    found: dict[str, Path] = {}
    for folder, record in loaded:
        for rel, entry in record["manifest"]["files"].items():
            path = folder / rel
            if rel in found:
                raise InputError("parts overlap: both hold the file", file=f"{found[rel].parent} and {folder}",
                                 tensor=rel)
            st = _lstat_inside(folder, rel)
            if st is None or st.st_size != int(entry["bytes"]):
                raise InputError("part file missing or not of its recorded size", file=str(path),
                                 expected=f"{entry['bytes']} bytes",
                                 found=f"{st.st_size} bytes" if st is not None else "no file")
            found[rel] = path
    return found


def _lstat_inside(folder: Path, rel: str) -> os.stat_result | None:
    """lstat of part file `rel` below `folder` (None when it is missing); InputError when it or a folder on the
    way is a symlink, or it is no regular file."""
    current = folder
    for depth, name in enumerate(rel.split("/"), 1):
        current = current / name
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise InputError(f"cannot read part file ({exc.strerror})", file=str(current)) from None
        if stat.S_ISLNK(st.st_mode):
            raise InputError("part file is a symlink; merge takes only regular files inside a part",
                             file=str(current), hint="replace it by the file it names, or convert the part again")
        last = depth == rel.count("/") + 1
        if not (stat.S_ISREG(st.st_mode) if last else stat.S_ISDIR(st.st_mode)):
            raise InputError("part file is not a regular file" if last else "part folder is not a folder",
                             file=str(current))
    return st


def _prepare(out: Path, part_folders: list[Path]) -> None:
    """OUT must be a folder (created here) and not one of the parts."""
    if out.exists() and not out.is_dir():
        raise OutputError("output path exists and is not a directory", file=str(out))
    if out.resolve() in {p.resolve() for p in part_folders}:
        raise OutputError("OUT is one of the parts", file=str(out), hint="merge into a new folder")
    out.mkdir(parents=True, exist_ok=True)


def _begin(out: Path, identity: str) -> Proofs:
    """Under OUT's lock: start the merge named `identity` in an empty OUT (its journal written), or go on with an
    unfinished or finished merge of the same name; OutputError for any other content. Returns the proofs of the
    journal (a finished OUT: none, and none recorded)."""
    journal, manifest = out / MERGE_JOURNAL, out / MANIFEST_NAME
    head = {"format": MERGE_FORMAT, "manifest_sha256": identity}
    if journal.is_file():
        record = read_json(journal, what="merge journal", max_bytes=MAX_MANIFEST_BYTES)
        if not isinstance(record, dict) or record.get("manifest_sha256") != identity:
            raise OutputError(f"OUT holds an unfinished merge of other parts ({MERGE_JOURNAL})", file=str(out),
                              hint="run that merge again to finish it, or merge into a new folder")
        return Proofs(journal, head, record.get("proven"))
    if manifest.is_file() and hashlib.sha256(manifest.read_bytes()).hexdigest() == identity:
        return Proofs(None, head)               # finished: checked again, nothing changes
    if any(p.name != LOCK_NAME for p in out.iterdir()):
        raise OutputError("output directory exists and is not empty", file=str(out),
                          hint="merge into a new or empty folder")
    write_atomic(journal, manifest_bytes(head))
    return Proofs(journal, head)


def _place(source: Path, target: Path, entry: dict, out: Path, proof: PartProof) -> bool:
    """Hard-link `source` as `target` (its folders below `out` created; the link itself never followed) and have
    `proof` hash it; copied (temp name, hashed while copied, renamed once it matched) across filesystems. A
    regular file already there from an earlier run of this merge is kept when `proof` proved it then (its stat
    key unchanged), is the part's own inode (hashed again), or is a copy of the recorded size that hashes to the
    recorded bytes; anything else (a symlink: the link itself) is removed first. No folder below `out` and no name
    is ever followed as a symlink (``fileio.open_dir`` / ``NewFile``). True when copied."""
    rel = target.relative_to(out).as_posix()
    folder = open_dir(target.parent, within=out)
    try:
        remove_name(temp_path_for(target), folder)           # an interrupted copy
        try:
            there = os.lstat(target.name, dir_fd=folder)
        except FileNotFoundError:
            there = None
        if there is not None and stat.S_ISREG(there.st_mode):
            if proof.known(rel, there, target):
                return False
            linked = os.lstat(source)
            if (there.st_dev, there.st_ino) == (linked.st_dev, linked.st_ino):
                proof.hash_in_place(out, rel)
                return False
            if there.st_size == int(entry["bytes"]) and proof.prove_copy(out, rel):
                return False
        remove_name(target, folder)
        try:
            os.link(source, target.name, dst_dir_fd=folder, follow_symlinks=False)
            proof.hash_in_place(out, rel)
            return False
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise OutputError(f"cannot link part file ({exc.strerror})", file=str(target)) from None
    finally:
        os.close(folder)
    proof.copy(source, rel, target, out)
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

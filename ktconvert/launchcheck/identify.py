"""``identify(weights, reads)``: what a weights folder holds (``identity.Identity``), whoever wrote it, from its
headers, names and byte sizes only; the folder as kt-kernel looks at it.

* a ``.gguf`` file or a folder of them: LLAMAFILE (identify_gguf);
* top-level ``*.safetensors`` with ``blk.*`` expert tensors: kt-kernel's merged layout (identify_kt); top-level
  ``*.safetensors`` put kt-kernel's AMX loader in merged mode, so a ``_layer_*`` tree next to them is not read;
* a ``_layer_L/_numa_T`` tree and no top-level shard: the ``.kt`` layout (identify_kt);
* HF expert tensors (every ``*.safetensors`` under the folder, as kt-kernel's native loaders walk it): the in-place
  formats (identify_hf).

With a ``ktconvert.json`` the recorded method, NUMA count and flags (``verification.launch.expected_launch``) are
compared with what the files hold. A folder with no experts, an index naming a missing shard, a truncated file,
layers in different formats: InputError (exit 3).
"""
from __future__ import annotations

import os
from pathlib import Path

from ktconvert.errors import InputError, KtConvertError
from ktconvert.formats.out_manifest import MANIFEST_NAME, load_manifest
from ktconvert.launchcheck.identify_gguf import identify_gguf, is_gguf
from ktconvert.launchcheck.identify_hf import hf_entries, identify_hf
from ktconvert.launchcheck.identify_kt import identify_merged, identify_tree, merged_entries
from ktconvert.launchcheck.identity import Identity
from ktconvert.launchcheck.readers import Reads, check_index, safetensors_files
from ktconvert.verification.launch import expected_launch


def identify(weights, reads: Reads) -> tuple[Identity, dict | None]:
    """(Identity, the folder's ktconvert.json or None); InputError for a malformed folder or one that cannot be
    read."""
    try:
        return _identify(Path(weights), reads)
    except OSError as exc:
        raise InputError(f"cannot read ({exc.strerror or exc})", file=exc.filename or str(weights)) from None


def _identify(path: Path, reads: Reads) -> tuple[Identity, dict | None]:
    if not os.path.exists(path):
        raise InputError("WEIGHTS does not exist", file=str(path))
    if is_gguf(path):
        return identify_gguf(path, reads), None
    root = path if path.is_dir() else path.parent
    notes: list[str] = []
    manifest = _manifest(root, reads, notes)
    check_index(root, reads)
    files = safetensors_files(root)
    top = [f for f in files if f.parent == root]
    headers = [reads.st_header(f) for f in files]
    merged = merged_entries(headers)
    hf, extra = hf_entries(headers)
    tree = identify_tree(root)
    if merged and (top or not tree):
        identity = identify_merged(root, merged)
        if not top:
            identity.problems.append("the blk.* shards are in subfolders only: kt-kernel's AMX loader reads merged "
                                     "shards when the folder itself holds *.safetensors, else the _layer_* tree")
        if tree is not None:
            identity.notes.append("the _layer_*/_numa_* tree is not read: the folder's *.safetensors put kt-kernel "
                                  "in merged mode")
    elif hf or extra["packed"]:
        identity = identify_hf(root, hf, extra)
        if tree is not None:
            identity.notes.append("the folder also holds a _layer_*/_numa_* tree, which the in-place methods ignore")
    elif tree is not None:
        identity = tree
        if top:
            identity.problems.append("the folder's *.safetensors hold no blk.* experts but put kt-kernel's AMX "
                                     "loader in merged mode, so the _layer_* tree is never read: move them away")
    else:
        raise InputError("no routed expert tensors in any layout kt-kernel reads (blk.* merged shards, the "
                         "_layer_* tree, HF expert tensors or GGUF)", file=str(root))
    if merged and hf:
        identity.notes.append("the folder holds both blk.* (converted) and HF expert tensors")
    identity.notes += notes
    _duplicate_names(files, root, identity)
    if manifest is not None:
        _compare_manifest(identity, manifest)
    return identity, manifest


def _manifest(root: Path, reads: Reads, notes: list[str]) -> dict | None:
    """The folder's ktconvert.json, or None (also when it cannot be read: the files are what kt-kernel reads)."""
    if not os.path.lexists(root / MANIFEST_NAME):
        return None
    try:
        manifest = load_manifest(root)
    except InputError as exc:
        notes.append(f"ktconvert.json is ignored: {exc}")
        return None
    reads.counts["json"] += (root / MANIFEST_NAME).stat().st_size
    return manifest


def _duplicate_names(files: list[Path], root: Path, identity: Identity) -> None:
    seen: dict[str, Path] = {}
    for f in files:
        if f.name in seen:
            identity.notes.append(f"{f.relative_to(root)} and {seen[f.name].relative_to(root)} share a file name: "
                                  "kt-kernel keys shards by file name and reads only one of them")
            return
        seen[f.name] = f


def _compare_manifest(identity: Identity, manifest: dict) -> None:
    """ktconvert.json's method / NUMA count / flags next to what the files hold."""
    record = {"method": manifest.get("method"), "numa": manifest.get("numa")}
    try:
        record["flags"] = expected_launch(manifest)["flags"]
    except (KtConvertError, KeyError, TypeError, ValueError) as exc:
        record["flags"] = None
        identity.notes.append(f"ktconvert.json: its launch flags cannot be derived ({exc})")
    identity.facts["ktconvert.json"] = record
    if manifest.get("kind", "cpu") != "cpu":
        identity.notes.append(f"ktconvert.json says kind {manifest.get('kind')!r}: not a kt-kernel CPU folder")
        return
    if record["method"] != identity.method:
        identity.notes.append(f"ktconvert.json records method {record['method']}, the files hold "
                              f"{identity.method}: the files are what kt-kernel reads")
    elif identity.numa is not None and record["numa"] != identity.numa:
        identity.notes.append(f"ktconvert.json records NUMA {record['numa']}, the files hold {identity.numa} parts")
    else:
        identity.how["ktconvert.json"] = f"agrees: method {record['method']}, NUMA {record['numa']}"

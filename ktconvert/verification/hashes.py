"""``verify --hashes`` (and ``publish``'s local check): every file and tensor of an output re-hashed against the
sha256 / git blob SHA-1 its ``ktconvert.json`` records (the git blob id as its format_version defines it: of the
content for every file in version 1, of the LFS pointer for files from ``fileio.LFS_THRESHOLD`` on in version 2 and
3), and every tensor against its recorded digest in the algorithm that digest names (``digests.digest_algorithm``:
BLAKE3 for "blake3:<hex>", written for safetensors tensors since format_version 3; sha256 for bare hex, as every
older manifest and a tensor that is a whole file of its own record it)."""
from __future__ import annotations

from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.formats.digests import DIGEST_ALGORITHM, SHA256, digest_algorithm
from ktconvert.formats.fileio import hash_file, hash_safetensors, hash_with_tensors
from ktconvert.formats.gguf_header import read_header
from ktconvert.formats.out_manifest import load_manifest, output_files
from ktconvert.layouts.naming import key_for_kt_path


def verify_hashes(out_dir, manifest: dict | None = None, folder=None) -> dict:
    """Re-hash every file the manifest lists (and every tensor of its safetensors shards / .kt files).

    folder: the verification.folder.OutputFolder already scanned (its parsed shard headers are reused), or None.
    Returns {"ok", "files_checked", "tensors_checked", "mismatched", "missing", "extra", "unreadable" (a FIFO or
    device where a file should be: "path: why"), "tensor_mismatched", "tensor_missing", "tensor_extra", "problems"}:
    lists of relative paths / tensor names, and one line per problem.
    """
    root = Path(out_dir)
    manifest = load_manifest(root) if manifest is None else manifest
    headers = folder.shards if folder is not None else {}
    listed, on_disk = manifest["files"], set(output_files(root))
    report = {"mismatched": [], "missing": [], "extra": sorted(on_disk - set(listed)), "tensor_mismatched": [],
              "tensor_extra": [], "unreadable": [], "files_checked": 0, "tensors_checked": 0, "problems": []}
    seen_tensors: dict[str, str] = {}
    content_git = manifest.get("format_version") == 1
    algorithms = {name: digest_algorithm(value) for name, value in manifest["tensors"].items()}
    for rel in sorted(listed):
        if rel not in on_disk:
            report["missing"].append(rel)
            continue
        _check_file(root, rel, listed[rel], headers.get(rel), report, seen_tensors, content_git, algorithms)
    _compare_tensors(manifest["tensors"], seen_tensors, report)
    report["problems"] = _hash_problems(report)
    report["ok"] = not report["problems"]
    return report


def _check_file(root: Path, rel: str, entry: dict, header, report: dict, seen_tensors: dict,
                content_git: bool, algorithms: dict) -> None:
    try:
        size, sha256, git_sha1, tensor_hashes = file_hashes(root, rel, header, content_git, algorithms)
    except InputError as exc:           # not a regular file, or changed while hashing
        report["unreadable"].append(f"{rel}: {exc.detail}")
        return
    report["files_checked"] += 1
    if (size, sha256, git_sha1) != (entry.get("bytes"), entry.get("sha256"), entry.get("git_sha1")):
        report["mismatched"].append(rel)
    seen_tensors.update(tensor_hashes)


def file_hashes(root: Path, rel: str, header=None, content_git: bool = False,
                algorithms=DIGEST_ALGORITHM) -> tuple[int, str, str, dict[str, str]]:
    """(size, sha256, git_sha1, {tensor: digest}) of one output file: a shard's tensors from its header (each in
    `algorithms`: one name or {tensor: name}, as digests.TensorHasher takes), a GGUF's from its tensor infos (sha256),
    a .kt file is one tensor (the file's sha256 is its digest); InputError when it is not a regular file.
    content_git: see fileio.hash_file."""
    if rel.endswith(".safetensors"):
        try:
            return hash_safetensors(root / rel, header, content_git, algorithms)
        except InputError:
            return (*hash_file(root / rel, content_git), {})
    if rel.endswith(".gguf"):
        try:
            tensors = read_header(root / rel)[1]
        except InputError:      # not a GGUF whose header reads: its file hash tells, its tensors are missing
            return (*hash_file(root / rel, content_git), {})
        return hash_with_tensors(root / rel, tensors, content_git, SHA256)   # as GgufLayerWriter records them
    size, sha256, git_sha1 = hash_file(root / rel, content_git)
    key = key_for_kt_path(rel)
    return size, sha256, git_sha1, ({key: sha256} if key is not None else {})


def _compare_tensors(expected: dict, seen: dict, report: dict) -> None:
    report["tensors_checked"] = len(seen)
    report["tensor_mismatched"] = sorted(n for n, h in seen.items() if n in expected and expected[n] != h)
    report["tensor_extra"] = sorted(set(seen) - set(expected))
    report["tensor_missing"] = sorted(set(expected) - set(seen))


def _hash_problems(report: dict) -> list[str]:
    lines = [f"{p}: content differs from ktconvert.json (sha256/git_sha1/bytes)" for p in report["mismatched"]]
    lines += [f"{p}: listed in ktconvert.json but missing" for p in report["missing"]]
    lines += report["unreadable"]
    lines += [f"{p}: extra file not listed in ktconvert.json" for p in report["extra"]]
    lines += [f"{n}: tensor bytes differ from ktconvert.json" for n in report["tensor_mismatched"]]
    lines += [f"{n}: tensor not listed in ktconvert.json" for n in report["tensor_extra"]]
    missing = report["tensor_missing"]
    if missing and not report["missing"]:
        lines.append(f"{missing[0]}: {len(missing)} tensor(s) listed in ktconvert.json found in no file")
    return lines

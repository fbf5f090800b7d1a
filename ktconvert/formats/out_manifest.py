"""``ktconvert.json``: what an output folder is for, where it came from, and a hash of every byte in it.

Schema (docs/architecture.md "Output manifest"): format, format_version, tool, tool_version, kind, method (kt-kernel
name, e.g. "AMXINT4"), numa, layout, quant, include_dense, flags (the kt-kernel / SGLang options the folder needs) and
sglang_args (the same as one string), model (family, model_type, layers, experts, hidden, intermediate), source
(config_sha256; bytes + sha256 per source file), files (bytes, sha256, git_sha1 per output file, keyed by relative
posix path), tensors (sha256 per expert/dense tensor, keyed by its merged-safetensors name in both layouts) and
packages (versions of the packages that affect output bytes). Written with sorted keys, indent 2 and a trailing
newline, no timestamps and no host names: the same conversion gives the same bytes.

Both hashes per file: hubs report sha256 only for LFS files and a git blob SHA-1 for the others (publish.md §2).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ktconvert.errors import InputError, OutputError

MANIFEST_NAME = "ktconvert.json"
JOURNAL_NAME = ".ktconvert-journal.json"
FORMAT = "ktconvert-manifest"
FORMAT_VERSION = 1
HASH_CHUNK = 8 << 20
BYTE_PACKAGES = ("ktconvert", "numpy", "safetensors")  # the packages whose version can change output bytes
MODEL_KEYS = ("layers", "experts", "hidden", "intermediate")


@dataclass(frozen=True)
class FileRecord:
    """One output file: path relative to the output folder (posix), size, sha256 hex, git blob SHA-1 hex."""

    path: str
    bytes: int
    sha256: str
    git_sha1: str

    def entry(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha256, "git_sha1": self.git_sha1}


class _DualHash:
    """sha256 and git blob SHA-1 (``sha1(b"blob <size>\\0" + content)``) fed together; size known up front."""

    def __init__(self, size: int):
        self.size = size
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(b"blob %d\0" % size)

    def update(self, data) -> None:
        self.sha256.update(data)
        self.git.update(data)

    def hexdigests(self) -> tuple[str, str]:
        return self.sha256.hexdigest(), self.git.hexdigest()


def hash_bytes(data) -> tuple[int, str, str]:
    """(size, sha256 hex, git blob SHA-1 hex) of a bytes-like object."""
    view = memoryview(data).cast("B")
    hasher = _DualHash(len(view))
    hasher.update(view)
    return (len(view), *hasher.hexdigests())


def _read_chunks(path: Path, size: int):
    """Yield the file's bytes in HASH_CHUNK pieces, one sequential pass; InputError if its size changes."""
    buf = bytearray(min(HASH_CHUNK, max(size, 1)))
    view = memoryview(buf)
    done = 0
    with open(path, "rb", buffering=0) as fh:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            got = fh.readinto(view)
            if not got:
                break
            done += got
            yield view[:got]
    if done != size:
        raise InputError("file changed while hashing", file=str(path), expected=f"{size} bytes", found=str(done))


def hash_file(path) -> tuple[int, str, str]:
    """(size, sha256 hex, git blob SHA-1 hex) of a file, read once sequentially in 8 MiB chunks."""
    path = Path(path)
    size = os.stat(path).st_size
    hasher = _DualHash(size)
    for chunk in _read_chunks(path, size):
        hasher.update(chunk)
    return (size, *hasher.hexdigests())


def hash_safetensors(path) -> tuple[int, str, str, dict[str, str]]:
    """(size, sha256, git_sha1, {tensor: sha256 of its bytes}) of a .safetensors file in one sequential read.

    InputError if the header does not parse (the caller can still compare the file hash via ``hash_file``).
    """
    from ktconvert.formats.safetensors_reader import parse_header

    path = Path(path)
    spans = sorted((ref.offset, ref.offset + ref.nbytes, name) for name, ref in parse_header(path).tensors.items())
    size = os.stat(path).st_size
    hasher, tensor_hashes = _DualHash(size), {}
    pos, i, current = 0, 0, hashlib.sha256()
    for chunk in _read_chunks(path, size):
        hasher.update(chunk)
        end = pos + len(chunk)
        while i < len(spans) and spans[i][0] <= end:
            begin, stop, name = spans[i]
            current.update(chunk[max(begin, pos) - pos:min(stop, end) - pos])
            if stop > end:
                break
            tensor_hashes[name], current, i = current.hexdigest(), hashlib.sha256(), i + 1
        pos = end
    for begin, stop, name in spans[i:]:  # only empty tensors at the very end can remain
        tensor_hashes[name] = hashlib.sha256(b"").hexdigest()
    return (size, *hasher.hexdigests(), tensor_hashes)


def record_for(out_dir, rel_path: str) -> FileRecord:
    """FileRecord of an existing file `rel_path` (posix, relative to out_dir), hashed from disk."""
    size, sha256, git_sha1 = hash_file(Path(out_dir) / rel_path)
    return FileRecord(rel_path, size, sha256, git_sha1)


def source_fingerprint(root, files: Iterable) -> dict:
    """{"config_sha256": hex or None, "files": {relative posix path: {"bytes", "sha256"}}} of a source checkpoint.

    root: the source folder (or single file); files: the weight files read. Reads every file once (sha256 of the
    whole source: minutes for a large model).
    """
    root = Path(root)
    base = root if root.is_dir() else root.parent
    config = base / "config.json"
    entries = {}
    for path in sorted(Path(f) for f in files):
        try:
            rel = path.resolve().relative_to(base.resolve()).as_posix()
        except ValueError:
            rel = path.name
        size, sha256, _ = hash_file(path)
        entries[rel] = {"bytes": size, "sha256": sha256}
    return {"config_sha256": hash_file(config)[1] if config.is_file() else None, "files": entries}


def kt_flags(kt_method: str, numa: int) -> dict:
    """The kt-kernel / SGLang options a folder needs; the weight path "." means the folder holding ktconvert.json."""
    return {"kt-method": kt_method, "kt-weight-path": ".", "kt-threadpool-count": int(numa)}


def sglang_args(manifest: dict, weight_path: str | None = None) -> str:
    """``--kt-method M --kt-weight-path P --kt-threadpool-count T`` (P = weight_path, else the manifest's "."),
    and ``--init-expert-location P/FILE --kt-expert-placement-strategy frequency`` when the output holds expert
    activation counts (manifest key ``expert_activation``)."""
    flags = dict(manifest["flags"])
    if weight_path is not None:
        flags["kt-weight-path"] = str(weight_path)
    args = " ".join(f"--{k} {flags[k]}" for k in ("kt-method", "kt-weight-path", "kt-threadpool-count"))
    return args + placement_args(manifest, flags["kt-weight-path"])


def placement_args(manifest: dict, folder) -> str:
    """`` --init-expert-location FOLDER/FILE --kt-expert-placement-strategy frequency`` for an output whose
    manifest records expert activation counts, else ""."""
    name = manifest.get("expert_activation")
    return " " + placement_flags(f"{folder}/{name}") if name else ""


def placement_flags(counts_path) -> str:
    """SGLang-KT's flags for GPU expert placement by the activation counts in `counts_path` (a .pt file); the
    GPU expert budget (--kt-gpu-experts-ratio R or --kt-num-gpu-experts N) is given besides."""
    return f"--init-expert-location {counts_path} --kt-expert-placement-strategy frequency"


def package_versions(names: Iterable[str] = BYTE_PACKAGES) -> dict[str, str]:
    """{package: installed version} via importlib.metadata ("unknown" when not installed as a distribution)."""
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def build_manifest(*, method: str, numa: int, layout: str, model: dict, source: dict, files, tensors: dict,
                   quant: str = "rtn", kind: str = "cpu", include_dense: bool = False,
                   packages: dict | None = None, expert_activation: str | None = None) -> dict:
    """The ktconvert.json dict. method: kt-kernel method name ("AMXINT4"); files: FileRecords or
    {path: {"bytes", "sha256", "git_sha1"}}; tensors: {name: sha256}; model must hold layers, experts, hidden,
    intermediate (family and model_type recommended); expert_activation: the output's expert activation counts
    file (relative path), recorded and added to the SGLang flags."""
    from ktconvert import __version__

    missing = [k for k in MODEL_KEYS if k not in model]
    if missing:
        raise OutputError("model summary incomplete", file=MANIFEST_NAME, expected=", ".join(MODEL_KEYS),
                          found="missing " + ", ".join(missing))
    if not isinstance(files, dict):
        files = {rec.path: rec for rec in files}
    file_entries = {str(p): (r.entry() if isinstance(r, FileRecord) else dict(r)) for p, r in files.items()}
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tool": "ktconvert", "tool_version": __version__,
        "kind": kind, "method": method, "numa": int(numa), "layout": layout, "quant": quant,
        "include_dense": bool(include_dense), "flags": kt_flags(method, numa),
        "model": {**model, "layers": sorted(int(x) for x in model["layers"])},
        "source": source, "files": file_entries, "tensors": dict(tensors),
        "packages": package_versions() if packages is None else dict(packages),
    }
    if expert_activation:
        manifest["expert_activation"] = expert_activation
    manifest["sglang_args"] = sglang_args(manifest)
    return manifest


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_atomic(path: Path, data, durable: bool = True) -> None:
    """Write bytes-like `data` to `path` via ``.NAME.partial`` in the same folder, then rename.

    durable: fsync the file before and its folder after the rename (False: the caller fsyncs later, in bulk).
    """
    from ktconvert.formats.st_writer import fsync_dir, temp_path_for

    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write file ({exc.strerror})", file=str(path)) from None
    if durable:
        fsync_dir(path.parent)


def write_manifest(out_dir, manifest: dict) -> Path:
    """Write ``out_dir/ktconvert.json`` atomically; returns its path."""
    path = Path(out_dir) / MANIFEST_NAME
    write_atomic(path, manifest_bytes(manifest))
    return path


def load_manifest(out_dir) -> dict:
    """Parse and sanity-check ``out_dir/ktconvert.json``; InputError naming the file on any problem."""
    path = Path(out_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("no ktconvert manifest (not a ktconvert output, or the conversion did not finish)",
                         file=str(path)) from None
    except (OSError, ValueError) as exc:
        raise InputError(f"manifest unreadable ({exc})", file=str(path)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError("not a ktconvert manifest", file=str(path), expected=f'"format": "{FORMAT}"',
                         found=repr(manifest.get("format") if isinstance(manifest, dict) else manifest)[:60])
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InputError("unsupported manifest format_version", file=str(path), expected=str(FORMAT_VERSION),
                         found=repr(manifest.get("format_version")), hint="upgrade ktconvert")
    for key, kind in (("files", dict), ("tensors", dict), ("model", dict), ("numa", int), ("layout", str)):
        if not isinstance(manifest.get(key), kind):
            raise InputError(f"manifest field {key!r} missing or not a {kind.__name__}", file=str(path))
    return manifest


def output_files(out_dir) -> list[str]:
    """Every file under out_dir as a sorted relative posix path, except the manifest and the resume journal."""
    root = Path(out_dir)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel not in (MANIFEST_NAME, JOURNAL_NAME):
                found.append(rel)
    return sorted(found)


def verify_hashes(out_dir, manifest: dict | None = None) -> dict:
    """Re-hash every file the manifest lists (and every tensor of its safetensors shards / .kt files).

    Returns {"ok", "files_checked", "tensors_checked", "mismatched", "missing", "extra", "tensor_mismatched",
    "tensor_missing", "tensor_extra", "problems"}: lists of relative paths / tensor names, and one line per problem.
    """
    root = Path(out_dir)
    manifest = load_manifest(root) if manifest is None else manifest
    listed, on_disk = manifest["files"], set(output_files(root))
    report = {"mismatched": [], "missing": [], "extra": sorted(on_disk - set(listed)), "tensor_mismatched": [],
              "tensor_extra": [], "files_checked": 0, "tensors_checked": 0, "problems": []}
    seen_tensors: dict[str, str] = {}
    for rel in sorted(listed):
        if rel not in on_disk:
            report["missing"].append(rel)
            continue
        _check_file(root, rel, listed[rel], report, seen_tensors)
    _compare_tensors(manifest["tensors"], seen_tensors, report)
    report["problems"] = _hash_problems(report)
    report["ok"] = not report["problems"]
    return report


def _check_file(root: Path, rel: str, entry: dict, report: dict, seen_tensors: dict) -> None:
    from ktconvert.formats.kt_sink import key_for_kt_path

    tensor_hashes = {}
    if rel.endswith(".safetensors"):
        try:
            size, sha256, git_sha1, tensor_hashes = hash_safetensors(root / rel)
        except InputError:
            size, sha256, git_sha1 = hash_file(root / rel)
    else:
        size, sha256, git_sha1 = hash_file(root / rel)
        key = key_for_kt_path(rel)
        if key is not None:
            tensor_hashes = {key: sha256}
    report["files_checked"] += 1
    if (size, sha256, git_sha1) != (entry.get("bytes"), entry.get("sha256"), entry.get("git_sha1")):
        report["mismatched"].append(rel)
    seen_tensors.update(tensor_hashes)


def _compare_tensors(expected: dict, seen: dict, report: dict) -> None:
    report["tensors_checked"] = len(seen)
    report["tensor_mismatched"] = sorted(n for n, h in seen.items() if n in expected and expected[n] != h)
    report["tensor_extra"] = sorted(set(seen) - set(expected))
    report["tensor_missing"] = sorted(set(expected) - set(seen))


def _hash_problems(report: dict) -> list[str]:
    lines = [f"{p}: content differs from ktconvert.json (sha256/git_sha1/bytes)" for p in report["mismatched"]]
    lines += [f"{p}: listed in ktconvert.json but missing" for p in report["missing"]]
    lines += [f"{p}: extra file not listed in ktconvert.json" for p in report["extra"]]
    lines += [f"{n}: tensor bytes differ from ktconvert.json" for n in report["tensor_mismatched"]]
    lines += [f"{n}: tensor not listed in ktconvert.json" for n in report["tensor_extra"]]
    missing = report["tensor_missing"]
    if missing and not report["missing"]:
        lines.append(f"{missing[0]}: {len(missing)} tensor(s) listed in ktconvert.json found in no file")
    return lines

"""One-file bundles of an output folder: a tar stream (manifest first) compressed with zstd (`.tar.zst`).

`bundle(out, dest)` streams `ktconvert.json` and then every file it lists (sorted) through `tarfile` stream mode into a
`zstandard` stream writer; members carry fixed metadata (mtime 0, uid/gid 0, mode 0644, no user names, PAX format) and
the zstd frame has a content checksum, so the same folder gives the same bytes. File bytes are hashed while they
stream and compared with the manifest: a corrupted folder never becomes a bundle. `verify_bundle(path)` checks every
member's size, sha256 and git blob SHA-1 against the embedded manifest while streaming, without extracting.
`unbundle(path, dest)` restores into a temporary folder beside `dest`, refusing unsafe member names, verifying as it
writes, and renames it into place only when every file matched. Memory: one read chunk.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from ktconvert.errors import InputError, OutputError, VerifyError

MANIFEST_NAME = "ktconvert.json"
CHUNK = 4 << 20
DEFAULT_LEVEL = 3


class _HashingReader(io.RawIOBase):
    """File-like wrapper counting size and feeding sha256 + git blob SHA-1 as tarfile reads through it."""

    def __init__(self, fh, size: int):
        self.fh = fh
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(b"blob %d\0" % size)
        self.nbytes = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.sha256.update(data)
        self.git.update(data)
        self.nbytes += len(data)
        return data

    def entry(self) -> dict:
        return {"bytes": self.nbytes, "sha256": self.sha256.hexdigest(), "git_sha1": self.git.hexdigest()}


def _same(entry: dict, seen: dict) -> bool:
    return all(entry.get(k) == seen[k] for k in ("bytes", "sha256", "git_sha1") if entry.get(k) is not None)


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o644, 0, 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def bundle(out, dest, level: int = DEFAULT_LEVEL, progress=None) -> dict:
    """Write folder `out` (with its ktconvert.json) to `dest` (.tar.zst). Returns {"path", "files", "bytes_in",
    "bytes_out", "ratio"} (ratio = bytes_out / bytes_in). VerifyError if a file differs from the manifest."""
    import zstandard

    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.progress import Progress

    progress = progress or Progress()
    out, dest = Path(out), Path(dest)
    manifest = load_manifest(out)
    manifest_raw = (out / MANIFEST_NAME).read_bytes()
    files = manifest["files"]
    total = len(manifest_raw) + sum(int(e["bytes"]) for e in files.values())
    tmp = dest.with_name(f".{dest.name}.partial")
    progress.start(total, len(files) + 1, f"bundle {dest.name}")
    try:
        with open(tmp, "wb") as raw:
            cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=0)
            with cctx.stream_writer(raw, closefd=False) as zstream:
                with tarfile.open(fileobj=zstream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    tar.addfile(_tarinfo(MANIFEST_NAME, len(manifest_raw)), io.BytesIO(manifest_raw))
                    progress.advance(len(manifest_raw), 1, MANIFEST_NAME)
                    for rel in sorted(files):
                        _add_checked(tar, out, rel, files[rel])
                        progress.advance(int(files[rel]["bytes"]), 1, rel)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        progress.close()
    size = dest.stat().st_size
    return {"path": str(dest), "files": len(files) + 1, "bytes_in": total, "bytes_out": size,
            "ratio": round(size / total, 4) if total else 1.0}


def _add_checked(tar: tarfile.TarFile, out: Path, rel: str, entry: dict) -> None:
    path = out / rel
    try:
        size = path.stat().st_size
        fh = open(path, "rb")
    except OSError as exc:
        raise VerifyError(f"cannot read file listed in {MANIFEST_NAME} ({exc.strerror})", file=str(path)) from None
    with fh:
        reader = _HashingReader(fh, size)
        tar.addfile(_tarinfo(rel, size), reader)
    if not _same(entry, reader.entry()):
        raise VerifyError(f"file differs from {MANIFEST_NAME}; not bundled", file=str(path),
                          expected=entry.get("sha256"), found=reader.entry()["sha256"])


def _open_stream(path: Path):
    import zstandard

    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise InputError(f"cannot open bundle ({exc.strerror})", file=str(path)) from None
    return fh, zstandard.ZstdDecompressor().stream_reader(fh, read_size=CHUNK)


def _safe_name(name: str, bundle_path: Path) -> str:
    """Reject absolute names, '..', empty parts and backslashes; returns the normalised posix path."""
    pure = PurePosixPath(name)
    if not name or "\\" in name or pure.is_absolute() or any(p in ("..", "") for p in name.split("/")):
        raise InputError("unsafe member name in bundle (path traversal)", file=str(bundle_path), tensor=name)
    return pure.as_posix()


def _walk(path: Path, on_member, progress=None) -> dict:
    """Stream the bundle: parse the leading manifest, hand each other member to `on_member(rel, fileobj, size)` which
    returns its {"bytes","sha256","git_sha1"}, and compare with the manifest. Returns the report dict."""
    import zstandard

    report = {"ok": False, "path": str(path), "checked": 0, "missing": [], "extra": [], "mismatched": [],
              "problems": []}
    fh, stream = _open_stream(path)
    seen: set[str] = set()
    manifest = None
    try:
        with fh, stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                name = _safe_name(member.name, path)
                if not member.isfile():
                    raise InputError("bundle member is not a regular file", file=str(path), tensor=name,
                                     found=f"tar type {member.type!r}")
                if manifest is None:
                    manifest = _read_manifest(tar, member, path)
                    if progress is not None:
                        progress.start(sum(int(e["bytes"]) for e in manifest["files"].values()),
                                       len(manifest["files"]), f"check {path.name}")
                    continue
                entry = manifest["files"].get(name)
                if entry is None or name in seen:
                    report["extra"].append(name)
                    continue
                seen.add(name)
                got = on_member(name, tar.extractfile(member), member.size)
                report["checked"] += 1
                if not _same(entry, got):
                    report["mismatched"].append(name)
                if progress is not None:
                    progress.advance(member.size, 1, name)
    except (zstandard.ZstdError, tarfile.TarError, EOFError) as exc:
        report["problems"].append(f"bundle stream is corrupt: {type(exc).__name__}: {exc}")
    if manifest is None and not report["problems"]:
        report["problems"].append(f"bundle holds no {MANIFEST_NAME}")
    if manifest is not None:
        report["missing"] = sorted(set(manifest["files"]) - seen)
        report["files_root"] = _files_root(manifest["files"])
    report["problems"] += [f"{p}: content differs from {MANIFEST_NAME}" for p in report["mismatched"]]
    report["problems"] += [f"{p}: listed in {MANIFEST_NAME} but not in the bundle" for p in report["missing"]]
    report["problems"] += [f"{p}: not listed in {MANIFEST_NAME}" for p in report["extra"]]
    report["ok"] = not report["problems"]
    return report


def _files_root(files: dict) -> str:
    from ktconvert.ops.hub import files_digest

    return files_digest(files)


def _read_manifest(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> dict:
    if member.name != MANIFEST_NAME:
        raise InputError(f"bundle does not start with {MANIFEST_NAME}", file=str(path), found=member.name)
    try:
        manifest = json.loads(tar.extractfile(member).read())
    except ValueError as exc:
        raise InputError(f"{MANIFEST_NAME} in bundle is not JSON ({exc})", file=str(path)) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise InputError(f"{MANIFEST_NAME} in bundle has no files table", file=str(path))
    return manifest


def _hash_stream(fileobj, size: int, sink=None) -> dict:
    reader = _HashingReader(fileobj, size)
    while True:
        chunk = reader.read(CHUNK)
        if not chunk:
            break
        if sink is not None:
            sink.write(chunk)
    return reader.entry()


def verify_bundle(path, progress=None) -> dict:
    """Check every member of bundle `path` against its embedded ktconvert.json while streaming (nothing extracted).

    Returns {"ok", "path", "checked", "missing", "extra", "mismatched", "problems", "files_root"}; a damaged zstd
    frame or tar stream is reported in "problems" (ok False)."""
    path = Path(path)
    try:
        return _walk(path, lambda name, fobj, size: _hash_stream(fobj, size), progress)
    finally:
        if progress is not None:
            progress.close()


def unbundle(path, dest, progress=None) -> dict:
    """Restore bundle `path` into new folder `dest` (must not exist or be empty), verifying every file.

    Writes into a temporary folder beside `dest` and renames it into place only when the whole bundle verified;
    VerifyError (nothing left behind) otherwise. Returns verify_bundle's report + "dest"."""
    path, dest = Path(path), Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise OutputError("destination exists and is not empty", file=str(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    def write_member(name: str, fobj, size: int) -> dict:
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            return _hash_stream(fobj, size, out)

    try:
        report = _walk(path, write_member, progress)
        if not report["ok"]:
            raise VerifyError(f"bundle does not verify: {report['problems'][0]}", file=str(path))
        _restore_manifest(path, tmp)
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if progress is not None:
            progress.close()
    return {**report, "dest": str(dest)}


def _restore_manifest(path: Path, tmp: Path) -> None:
    """Write the bundle's ktconvert.json (its first member) byte for byte into the restored folder."""
    fh, stream = _open_stream(path)
    with fh, stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        member = tar.next()
        (tmp / MANIFEST_NAME).write_bytes(tar.extractfile(member).read())

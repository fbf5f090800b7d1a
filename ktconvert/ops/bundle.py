"""One-file bundles of an output folder: a tar stream (manifest first) compressed with zstd (`.tar.zst`).

`bundle(out, dest)` streams `ktconvert.json` and then every file it lists (sorted) through `tarfile` stream mode into a
`zstandard` stream writer; members carry fixed metadata (mtime 0, uid/gid 0, mode 0644, no user names, PAX format) and
the zstd frame has a content checksum, so the same folder gives the same bytes. File bytes are hashed while they
stream and compared with the manifest: a corrupted folder never becomes a bundle. An existing `dest` (a symlink
included) is refused unless `force`; the bundle is written as `.NAME.partial` beside it and renamed over it, never
written through a symlink (``fileio.NewFile``). `verify_bundle(path)` checks every
member's size, sha256 and git blob SHA-1 against the embedded manifest while streaming, without extracting.
`unbundle(path, dest)` restores into a temporary folder beside `dest`, refusing unsafe member names, verifying as it
writes, and renames it into place only when every file matched. Memory: one read chunk.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import stat
import tarfile
from pathlib import Path

from ktconvert.errors import KtConvertError, OutputError, VerifyError
from ktconvert.formats.fileio import FileHasher, NewFile, create_new, open_dir
from ktconvert.ops.hub import files_digest
from ktconvert.util.safe_read import MAX_MANIFEST_BYTES, open_regular, parse_json, unsafe_name

MANIFEST_NAME = "ktconvert.json"
CHUNK = 4 << 20
DEFAULT_LEVEL = 3
_HEX64 = re.compile(r"[0-9a-f]{64}")


class _HashingReader(io.RawIOBase):
    """File-like wrapper counting size and feeding sha256 + git blob SHA-1 as tarfile reads through it (the git blob
    id as the manifest's format_version defines it: content_git for version 1, fileio.FileHasher)."""

    def __init__(self, fh, size: int, content_git: bool = False):
        self.fh = fh
        self.hasher = FileHasher(size, content_git)
        self.nbytes = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.hasher.update(data)
        self.nbytes += len(data)
        return data

    def entry(self) -> dict:
        sha256, git_sha1 = self.hasher.hexdigests()
        return {"bytes": self.nbytes, "sha256": sha256, "git_sha1": git_sha1}


def _same(entry: dict, seen: dict) -> bool:
    return all(entry.get(k) == seen[k] for k in ("bytes", "sha256", "git_sha1") if entry.get(k) is not None)


def _difference(entry: dict, seen: dict) -> dict:
    """{"expected", "found"} of the first of bytes / sha256 / git_sha1 in which `seen` differs from manifest entry
    `entry` (a value of another type shown as its repr: the two never read the same)."""
    key = next(k for k in ("bytes", "sha256", "git_sha1") if entry.get(k) is not None and entry[k] != seen[k])
    want = entry[key] if type(entry[key]) is type(seen[key]) else repr(entry[key])
    return {"expected": f"{key} {want}", "found": f"{key} {seen[key]}"}


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o644, 0, 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def bundle(out, dest, level: int = DEFAULT_LEVEL, progress=None, force: bool = False) -> dict:
    """Write folder `out` (with its ktconvert.json) to `dest` (.tar.zst). Returns {"path", "files", "bytes_in",
    "bytes_out", "ratio"} (ratio = bytes_out / bytes_in). VerifyError if a file differs from the manifest;
    OutputError when `dest` exists (anything there, a symlink too) and not `force`, or is a folder."""
    import zstandard

    from ktconvert.formats.out_manifest import load_manifest, self_hash_problem
    from ktconvert.util.progress import Progress

    progress = progress or Progress()
    out, dest = Path(out), Path(dest)
    if os.path.isdir(dest) and not os.path.islink(dest):
        raise OutputError("bundle destination is a folder", file=str(dest), hint="name the .tar.zst file to write")
    if os.path.lexists(dest) and not force:
        raise OutputError("bundle destination exists", file=str(dest), hint="pass --force to replace it")
    manifest = load_manifest(out)
    edited = self_hash_problem(manifest)
    if edited is not None:
        raise VerifyError(f"not bundled: {edited}", file=str(out))
    manifest_raw = (out / MANIFEST_NAME).read_bytes()
    files = manifest["files"]
    total = len(manifest_raw) + sum(int(e["bytes"]) for e in files.values())
    progress.start(total, len(files) + 1, f"bundle {dest.name}", unit="files")
    new = None
    try:
        new = NewFile(dest)                     # .NAME.partial, never through a symlink
        with os.fdopen(new.fd, "wb", closefd=False) as raw:
            cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=0)
            with cctx.stream_writer(raw, closefd=False) as zstream:
                with tarfile.open(fileobj=zstream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    tar.addfile(_tarinfo(MANIFEST_NAME, len(manifest_raw)), io.BytesIO(manifest_raw))
                    progress.advance(len(manifest_raw), 1, MANIFEST_NAME)
                    for rel in sorted(files):
                        _add_checked(tar, out, rel, files[rel], manifest["format_version"] == 1)
                        progress.advance(int(files[rel]["bytes"]), 1, rel)
            raw.flush()
        size = os.fstat(new.fd).st_size
        new.commit()                            # replaces what stands at dest (a symlink itself, not its target)
    except BaseException as exc:
        if new is not None:
            new.discard()
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write bundle ({exc.strerror})", file=str(dest)) from None
        raise
    finally:
        progress.close()
    return {"path": str(dest), "files": len(files) + 1, "bytes_in": total, "bytes_out": size,
            "ratio": round(size / total, 4) if total else 1.0}


def _add_checked(tar: tarfile.TarFile, out: Path, rel: str, entry: dict, content_git: bool) -> None:
    path = out / rel
    fd = open_regular(path, f"file listed in {MANIFEST_NAME}", error=VerifyError)
    size = os.fstat(fd).st_size
    with os.fdopen(fd, "rb") as fh:
        reader = _HashingReader(fh, size, content_git)
        tar.addfile(_tarinfo(rel, size), reader)
    if not _same(entry, reader.entry()):
        raise VerifyError(f"file differs from {MANIFEST_NAME}; not bundled", file=str(path),
                          **_difference(entry, reader.entry()))


def _open_stream(path: Path):
    import zstandard

    fh = os.fdopen(open_regular(path, "bundle"), "rb")     # a FIFO named *.tar.zst would block open()
    return fh, zstandard.ZstdDecompressor().stream_reader(fh, read_size=CHUNK)


def _check_member_name(name: str, bundle_path: Path, what: str = "member name in bundle") -> str:
    """A member name must be a plain relative path (no absolute path, '..', backslash, NUL, over-long part)."""
    reason = unsafe_name(name)
    if reason:
        raise VerifyError(f"unsafe {what} (path traversal or unusable name: {reason})", file=str(bundle_path),
                          tensor=repr(name)[1:-1])
    return name


def _check_manifest(manifest, path: Path) -> None:
    """The bundle's first member is a ktconvert.json: a known format and format_version, its self hash (where it
    records one) matching its content; VerifyError otherwise."""
    from ktconvert.formats.out_manifest import FORMAT, READ_VERSIONS, self_hash_problem

    got = manifest if isinstance(manifest, dict) else {}
    version = got.get("format_version")
    if got.get("format") != FORMAT or type(version) is not int or version not in READ_VERSIONS:
        raise VerifyError(f"{MANIFEST_NAME} in bundle is not a ktconvert manifest", file=str(path),
                          expected=f'"format": "{FORMAT}", "format_version" ' + " or ".join(map(str, READ_VERSIONS)),
                          found=(f'"format": {got.get("format")!r:.40}, "format_version": {version!r:.20}'
                                 if isinstance(manifest, dict) else f"a JSON {type(manifest).__name__}"))
    problem = self_hash_problem(manifest)
    if problem is not None:
        raise VerifyError(f"in bundle: {problem}", file=str(path))


def _check_files_table(manifest, path: Path) -> dict:
    """The manifest's files table {name: {"bytes", "sha256"[, "git_sha1"]}}: at least one file, every name plain
    and relative, no name both a file and a folder of another, sizes non-negative integers, sha256 present."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise VerifyError(f"{MANIFEST_NAME} in bundle has no files table", file=str(path))
    if not files:
        raise VerifyError(f"{MANIFEST_NAME} in bundle lists no file; nothing to verify", file=str(path))
    for name, entry in files.items():
        _check_member_name(name, path, f"file name in {MANIFEST_NAME}")
        if name == MANIFEST_NAME:
            raise VerifyError(f"{MANIFEST_NAME} in bundle lists itself", file=str(path))
        ok = (isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
              and isinstance(entry.get("sha256"), str) and _HEX64.fullmatch(entry["sha256"])
              and (entry.get("git_sha1") is None or isinstance(entry["git_sha1"], str)))
        if not ok:
            raise VerifyError(f"{MANIFEST_NAME} in bundle: bad entry", file=str(path), tensor=name,
                              expected='{"bytes": int >= 0, "sha256": 64 hex digits, "git_sha1": 40 hex digits}',
                              found=repr(entry)[:80])
    folders = {"/".join(parts[:i]) for parts in (n.split("/") for n in files) for i in range(1, len(parts))}
    clash = sorted(folders & set(files))
    if clash:
        inside = min(n for n in files if n.startswith(clash[0] + "/"))
        raise VerifyError(f"{MANIFEST_NAME} in bundle lists {clash[0]} as a file and as the folder of {inside}",
                          file=str(path), tensor=inside)
    return files


def _walk(path: Path, on_member, progress=None, strict: bool = False) -> tuple[dict, bytes | None]:
    """Stream the bundle: parse the leading manifest, hand each listed member to `on_member(rel, fileobj, size)`
    which returns its {"bytes","sha256","git_sha1"} (the git blob id as the manifest's format_version defines it:
    on_member's content_git argument), and compare with the manifest. A member whose tar size differs
    from the manifest is never handed over. strict: raise VerifyError at the first problem (nothing more is read).
    Returns (report dict, the manifest's bytes or None)."""
    import zstandard

    report = {"ok": False, "path": str(path), "checked": 0, "missing": [], "extra": [], "mismatched": [],
              "problems": []}
    fh, stream = _open_stream(path)
    seen: set[str] = set()
    files, raw = None, None
    try:
        with fh, stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                name = _check_member_name(member.name, path)
                if not member.isfile():
                    raise VerifyError("bundle member is not a regular file", file=str(path), tensor=name,
                                      found=f"tar type {member.type!r}")
                if files is None:
                    raw = _read_manifest(tar, member, path)
                    manifest = parse_json(raw, what=f"{MANIFEST_NAME} in bundle", file=path,
                                          max_bytes=MAX_MANIFEST_BYTES, error=VerifyError)
                    _check_manifest(manifest, path)
                    files = _check_files_table(manifest, path)
                    content_git = manifest.get("format_version") == 1
                    if progress is not None:
                        progress.start(sum(e["bytes"] for e in files.values()), len(files), f"check {path.name}",
                                       unit="files")
                    continue
                entry = files.get(name)
                problem = _member_problem(name, entry, member.size, seen)
                if problem is not None:
                    if strict:
                        raise VerifyError(f"bundle does not verify: {problem[1]}; nothing of it written",
                                          file=str(path), tensor=name, **problem[2])
                    report[problem[0]].append(name)
                    continue
                seen.add(name)
                got = on_member(name, tar.extractfile(member), entry["bytes"], content_git)
                report["checked"] += 1
                if not _same(entry, got):
                    if strict:
                        raise VerifyError(f"bundle does not verify: content differs from {MANIFEST_NAME}",
                                          file=str(path), tensor=name, **_difference(entry, got))
                    report["mismatched"].append(name)
                if progress is not None:
                    progress.advance(member.size, 1, name)
    except (zstandard.ZstdError, tarfile.TarError, EOFError) as exc:
        report["problems"].append(f"bundle stream is corrupt: {type(exc).__name__}: {exc}")
    if files is None and not report["problems"]:
        report["problems"].append(f"bundle holds no {MANIFEST_NAME}")
    if files is not None:
        report["missing"] = sorted(set(files) - seen - set(report["mismatched"]))
        report["files_root"] = files_digest(files)
    report["problems"] += [f"{p}: content or size differs from {MANIFEST_NAME}" for p in report["mismatched"]]
    report["problems"] += [f"{p}: listed in {MANIFEST_NAME} but not in the bundle" for p in report["missing"]]
    report["problems"] += [f"{p}: not listed in {MANIFEST_NAME} (or stored twice)" for p in report["extra"]]
    report["ok"] = not report["problems"]
    return report, raw


def _member_problem(name: str, entry: dict | None, size: int, seen: set) -> tuple[str, str, dict] | None:
    """(report list, message, error fields) when member `name` of tar size `size` must not be extracted."""
    if entry is None or name in seen:
        return "extra", f"member not listed in {MANIFEST_NAME} (or stored twice)", {}
    if size != entry["bytes"]:
        return "mismatched", f"member size differs from {MANIFEST_NAME}", {"expected": f"{entry['bytes']} bytes",
                                                                           "found": f"{size} bytes"}
    return None


def _read_manifest(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> bytes:
    """The first member's bytes, which must be ktconvert.json of at most MAX_MANIFEST_BYTES (checked unread)."""
    if member.name != MANIFEST_NAME:
        raise VerifyError(f"bundle does not start with {MANIFEST_NAME}", file=str(path), found=member.name)
    if member.size > MAX_MANIFEST_BYTES:
        raise VerifyError(f"{MANIFEST_NAME} in bundle is larger than {MAX_MANIFEST_BYTES} bytes", file=str(path),
                          found=f"{member.size} bytes")
    return tar.extractfile(member).read(MAX_MANIFEST_BYTES + 1)


def bundled_manifest(path) -> bytes | None:
    """The ktconvert.json bytes bundle `path` starts with (its other members unread); None when `path` is missing,
    a symlink, not a regular file or not a readable bundle."""
    import zstandard

    path = Path(path)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fh, stream = _open_stream(path)
        with fh, stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            member = tar.next()
            return _read_manifest(tar, member, path) if member is not None and member.isfile() else None
    except (OSError, KtConvertError, zstandard.ZstdError, tarfile.TarError, EOFError):
        return None


def _hash_stream(fileobj, size: int, sink=None, content_git: bool = False) -> dict:
    """Hash (and copy to `sink`) at most `size` bytes of `fileobj`."""
    reader = _HashingReader(fileobj, size, content_git)
    while reader.nbytes < size:
        chunk = reader.read(min(CHUNK, size - reader.nbytes))
        if not chunk:
            break
        if sink is not None:
            sink.write(chunk)
    return reader.entry()


def verify_bundle(path, progress=None) -> dict:
    """Check every member of bundle `path` against its embedded ktconvert.json while streaming (nothing extracted).

    Returns {"ok", "path", "checked", "missing", "extra", "mismatched", "problems", "files_root"}; a damaged zstd
    frame or tar stream, and a manifest that is missing, too large, too deep, lists no file or lists an unsafe
    name, are reported in "problems" (ok False): every fault inside a bundle is a failed verification (exit 4).
    InputError only when `path` is not a readable regular file."""
    path = Path(path)
    try:
        return _walk(path, lambda name, fobj, size, content_git: _hash_stream(fobj, size, None, content_git),
                     progress)[0]
    except VerifyError as exc:
        return {"ok": False, "path": str(path), "checked": 0, "missing": [], "extra": [], "mismatched": [],
                "problems": [str(exc)]}
    finally:
        if progress is not None:
            progress.close()


def unbundle(path, dest, progress=None) -> dict:
    """Restore bundle `path` into new folder `dest` (must not exist or be empty, and not be a symlink), verifying
    every file.

    Writes into a temporary folder beside `dest` (a stale one, or a symlink in its place, is removed first, never
    followed) and renames it into place only when the whole bundle verified. The first problem stops it: a member
    whose size differs from the manifest is refused before a byte of it is written, and no file grows past the
    size the manifest states. VerifyError for any fault inside the bundle, InputError when `path` is not a
    readable regular file (nothing left behind either way). Returns verify_bundle's report + "dest"."""
    path, dest = Path(path), Path(dest)
    if dest.is_symlink():
        raise OutputError("destination is a symlink; refusing to write through it", file=str(dest))
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise OutputError("destination exists and is not empty", file=str(dest))
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot make the destination's folder ({exc.strerror})", file=str(dest)) from None
    tmp = dest.with_name(f".{dest.name}.partial")
    _fresh_dir(tmp)

    def write_member(name: str, fobj, size: int, content_git: bool) -> dict:
        target = tmp / name
        try:
            folder = open_dir(target.parent, within=tmp)    # its folders made, none followed as a symlink
            try:
                fd = create_new(target, dir_fd=folder)
            finally:
                os.close(folder)
            with os.fdopen(fd, "wb") as out:
                return _hash_stream(fobj, size, out, content_git)
        except OSError as exc:
            raise OutputError(f"cannot write bundle member ({exc.strerror})", file=str(dest), tensor=name) from None

    try:
        report, raw = _walk(path, write_member, progress, strict=True)
        if not report["ok"]:
            raise VerifyError(f"bundle does not verify: {report['problems'][0]}", file=str(path))
        try:
            with os.fdopen(create_new(tmp / MANIFEST_NAME), "wb") as fh:
                fh.write(raw)
        except OSError as exc:
            raise OutputError(f"cannot write bundle member ({exc.strerror})", file=str(dest),
                              tensor=MANIFEST_NAME) from None
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot move the restored folder into place ({exc.strerror})", file=str(dest)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if progress is not None:
            progress.close()
    return {**report, "dest": str(dest)}


def _fresh_dir(tmp: Path) -> None:
    """An empty new folder at `tmp`; whatever was there (a stale folder, a file, a symlink) is removed, not
    followed."""
    try:
        if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):
            tmp.unlink()
        elif tmp.exists():
            shutil.rmtree(tmp)
        os.mkdir(tmp)
    except OSError as exc:
        raise OutputError(f"cannot make the temporary folder ({exc.strerror})", file=str(tmp)) from None

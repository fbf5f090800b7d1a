"""Files on disk, the leaf every writer and checker builds on: hashing, atomic writes, fsync, temporary names.

* ``FileRecord``: one output file (relative posix path, size, sha256, git blob SHA-1). ``LayerResult``: what a
  finished layer (or any shard) wrote: its FileRecords and {tensor key: sha256 of its bytes}.
* Hashes: ``hash_bytes`` / ``hash_file`` / ``FileHasher`` give (size, sha256 hex, git blob id hex) in one pass.
  Hubs report sha256 for LFS files and a git blob SHA-1 for the others (publish.md §2), and an LFS file's git
  blob is its LFS pointer (``lfs_pointer``): so the git blob SHA-1 is computed over the content only for files
  below ``LFS_THRESHOLD`` and derived from size + sha256 for the others (``git_blob_id``; ``content_git=True``
  computes the content's for every size, as manifests of format_version 1 record it).
  ``hash_safetensors`` adds the sha256 of every tensor of a .safetensors file in the same sequential read;
  ``copy_hashed`` copies a file and hashes the bytes it copies (one read).
* ``write_atomic(path, data)``: written as ``.NAME.partial`` in the same folder, renamed when complete
  (``temp_path_for``), fsynced with its folder (``fsync_dir``) unless the caller fsyncs in bulk.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ktconvert import profile
from ktconvert.errors import InputError, OutputError
from ktconvert.formats.safetensors_reader import ShardHeader, parse_header
from ktconvert.safe_read import check_regular, open_regular

HASH_CHUNK = 8 << 20
LFS_THRESHOLD = 10 << 20  # files this large are LFS files on the hubs (HF refuses larger regular files)


@dataclass(frozen=True)
class FileRecord:
    """One output file: path relative to the output folder (posix), size, sha256 hex, git blob SHA-1 hex."""

    path: str
    bytes: int
    sha256: str
    git_sha1: str

    def entry(self) -> dict:
        """The manifest's per-file entry: {"bytes", "sha256", "git_sha1"}."""
        return {"bytes": self.bytes, "sha256": self.sha256, "git_sha1": self.git_sha1}


class LayerResult(NamedTuple):
    """What a finished layer (or the dense shard) wrote: its files and {tensor key: sha256}."""

    files: list[FileRecord]
    tensors: dict[str, str]


def lfs_pointer(size: int, sha256: str) -> bytes:
    """The git-lfs pointer file that stands in git for an LFS file of `size` bytes and content sha256 `sha256`."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def git_blob_id(size: int, sha256: str, content_git_sha1: str | None = None) -> str:
    """The git blob SHA-1 a hub lists for a file: of its LFS pointer when size >= LFS_THRESHOLD, else of its content
    (`content_git_sha1`, which must be given for such a file)."""
    if size >= LFS_THRESHOLD:
        pointer = lfs_pointer(size, sha256)
        return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
    if content_git_sha1 is None:
        raise ValueError(f"a file of {size} bytes needs its content's git blob SHA-1")
    return content_git_sha1


class FileHasher:
    """sha256 of a file's bytes fed in order, and its git blob id (``git_blob_id``): the content's git blob SHA-1
    (``sha1(b"blob <size>\\0" + content)``) is computed alongside only below LFS_THRESHOLD, or for every size with
    content_git=True (then ``hexdigests`` returns it whatever the size). size: the file's, known up front."""

    def __init__(self, size: int, content_git: bool = False):
        self.size, self.content_git = size, content_git
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(b"blob %d\0" % size) if content_git or size < LFS_THRESHOLD else None

    def update(self, data) -> None:
        with profile.span("hash.file", len(data)):
            self.sha256.update(data)
        if self.git is not None:
            with profile.span("hash.git", len(data)):
                self.git.update(data)

    def hexdigests(self) -> tuple[str, str]:
        """(sha256 hex, git blob id hex)."""
        sha256 = self.sha256.hexdigest()
        if self.content_git:
            return sha256, self.git.hexdigest()
        return sha256, git_blob_id(self.size, sha256, self.git.hexdigest() if self.git is not None else None)


def hash_bytes(data, content_git: bool = False) -> tuple[int, str, str]:
    """(size, sha256 hex, git blob id hex) of a bytes-like object."""
    view = memoryview(data).cast("B")
    hasher = FileHasher(len(view), content_git)
    hasher.update(view)
    return (len(view), *hasher.hexdigests())


def _read_chunks(path: Path, size: int, kind: str = "read.output"):
    """Yield the file's bytes in HASH_CHUNK pieces, one sequential pass (profiled as `kind`); InputError if its
    size changes or it is not a regular file (a FIFO would block the read forever)."""
    buf = bytearray(min(HASH_CHUNK, max(size, 1)))
    view = memoryview(buf)
    done = 0
    with os.fdopen(open_regular(path, "file"), "rb", buffering=0) as fh:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            with profile.span(kind, min(len(view), max(size - done, 0))):
                got = fh.readinto(view)
            if not got:
                break
            done += got
            yield view[:got]
    if done != size:
        raise InputError("file changed while hashing", file=str(path), expected=f"{size} bytes", found=str(done))


def hash_file(path, content_git: bool = False, kind: str = "read.output") -> tuple[int, str, str]:
    """(size, sha256 hex, git blob id hex) of a regular file (InputError otherwise), read once sequentially in
    8 MiB chunks (content_git: the content's git blob SHA-1 whatever the size; kind: the profile's name for the
    read, "read" for a source file)."""
    path = Path(path)
    size = check_regular(path, "file").st_size
    hasher = FileHasher(size, content_git)
    for chunk in _read_chunks(path, size, kind):
        hasher.update(chunk)
    return (size, *hasher.hexdigests())


def copy_hashed(source, target) -> tuple[int, str, str]:
    """Copy regular file `source` (InputError otherwise) to the new file `target`, fsynced, in one sequential read
    whose bytes are also hashed: (size, sha256 hex, git blob id hex) of what was copied. OutputError (target
    removed) when it cannot be written."""
    source, target = Path(source), Path(target)
    size = check_regular(source, "file").st_size
    hasher = FileHasher(size)
    try:
        with open(target, "wb", buffering=0) as fh, ThreadPoolExecutor(1) as pool:
            for chunk in _read_chunks(source, size):
                hashed = pool.submit(hasher.update, chunk)      # hashlib releases the GIL: hash while writing
                with profile.span("write", len(chunk)):
                    fh.write(chunk)
                hashed.result()                                 # before the next read reuses the buffer
            with profile.span("fsync"):
                os.fsync(fh.fileno())
    except OSError as exc:
        target.unlink(missing_ok=True)
        raise OutputError(f"cannot write file ({exc.strerror})", file=str(target)) from None
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return (size, *hasher.hexdigests())


def hash_safetensors(path, header: ShardHeader | None = None,
                     content_git: bool = False) -> tuple[int, str, str, dict[str, str]]:
    """(size, sha256, git blob id, {tensor: sha256 of its bytes}) of a .safetensors file in one sequential read.

    header: the file's already parsed header (else parsed here). InputError if the header does not parse (the
    caller can still compare the file hash via ``hash_file``). content_git: as for hash_file.
    """
    path = Path(path)
    header = parse_header(path) if header is None else header
    spans = sorted((ref.offset, ref.offset + ref.nbytes, name) for name, ref in header.tensors.items())
    size = check_regular(path, "file").st_size
    hasher, tensor_hashes = FileHasher(size, content_git), {}
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
    for _begin, _stop, name in spans[i:]:  # only empty tensors at the very end can remain
        tensor_hashes[name] = hashlib.sha256(b"").hexdigest()
    return (size, *hasher.hexdigests(), tensor_hashes)


def record_for(out_dir, rel_path: str) -> FileRecord:
    """FileRecord of an existing file `rel_path` (posix, relative to out_dir), hashed from disk."""
    size, sha256, git_sha1 = hash_file(Path(out_dir) / rel_path)
    return FileRecord(rel_path, size, sha256, git_sha1)


def write_record(out_dir, rel_path: str, data, durable: bool = True) -> FileRecord:
    """``write_atomic`` of bytes-like `data` to `rel_path` (posix, relative to out_dir); its FileRecord hashed from
    `data`, not read back."""
    write_atomic(Path(out_dir) / rel_path, data, durable)
    return FileRecord(rel_path, *hash_bytes(data))


def temp_path_for(path: Path) -> Path:
    """``dir/.NAME.partial``: hidden and not ending in ``.safetensors``, so no ``*.safetensors`` glob matches it."""
    return path.with_name(f".{path.name}.partial")


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename inside it is durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with profile.span("fsync"):
            os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data, durable: bool = True) -> None:
    """Write bytes-like `data` to `path` via ``.NAME.partial`` in the same folder, then rename.

    durable: fsync the file before and its folder after the rename (False: the caller fsyncs later, in bulk).
    """
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as fh:
            with profile.span("write", memoryview(data).nbytes):
                fh.write(data)
            if durable:
                fh.flush()
                with profile.span("fsync"):
                    os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write file ({exc.strerror})", file=str(path)) from None
    if durable:
        fsync_dir(path.parent)

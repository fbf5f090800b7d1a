"""Files on disk, the leaf every writer and checker builds on: hashing, atomic writes, fsync, temporary names.

* ``FileRecord``: one output file (relative posix path, size, sha256, git blob SHA-1). ``LayerResult``: what a
  finished layer (or any shard) wrote: its FileRecords and {tensor key: digest of its bytes}.
* Integrity digests of tensors and source files (BLAKE3 or sha256, the form naming the algorithm): ``digests``.
* Hashes: ``hash_bytes`` / ``hash_file`` / ``FileHasher`` give (size, sha256 hex, git blob id hex) in one pass.
  The sha256 is the native library's where it is built (``ktconvert.native.sha256``: files that threads hash at
  the same moment share a core, two streams interleaved; ``update_together`` feeds several on one thread), else
  hashlib's: the same digests either way.
  Hubs report sha256 for LFS files and a git blob SHA-1 for the others (publish.md §2), and an LFS file's git
  blob is its LFS pointer (``lfs_pointer``): so the git blob SHA-1 is computed over the content only for files
  below ``LFS_THRESHOLD`` and derived from size + sha256 for the others (``git_blob_id``; ``content_git=True``
  computes the content's for every size, as manifests of format_version 1 record it).
  ``hash_safetensors`` adds the digest of every tensor of a .safetensors file in the same sequential read;
  ``copy_hashed`` copies a file and hashes the bytes it copies (one read; every write's count checked: ``write_all``).
* ``write_atomic(path, data)``: written as ``.NAME.partial`` in the same folder, renamed when complete
  (``temp_path_for``), fsynced with its folder (``fsync_dir``) unless the caller fsyncs in bulk.
* No write ever goes through a symlink (someone able to create files in a shared OUT could otherwise make a
  root-run ktconvert clobber any file): every writer creates its files with ``NewFile`` (a temporary name made
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` after whatever stood there was removed, a link itself and never its target; every
  step taken relative to the folder's descriptor, ``open_dir``; renamed over the final name, which replaces a link
  standing there instead of writing through it), ``create_new`` for a file that is not renamed, and ``open_lock``
  for OUT's lock file (a symlink there is refused). A refusal is an OutputError naming the path.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple

from ktconvert.util import profile
from ktconvert.errors import InputError, OutputError
from ktconvert.native import sha256 as native_sha256
from ktconvert.formats.digests import DIGEST_ALGORITHM, TensorHasher, new_hash
from ktconvert.formats.safetensors_reader import ShardHeader, parse_header
from ktconvert.util.safe_read import check_regular, open_regular

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
        self.sha256 = native_sha256.new()
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


def update_together(hashers: list[FileHasher], pieces: list) -> None:
    """``update`` of each FileHasher by the bytes-like piece at the same index, their sha256s interleaved on this
    thread where they are the native hasher's (``sha256.sha256_multi``)."""
    sizes = [memoryview(piece).nbytes for piece in pieces]
    with profile.span("hash.file", sum(sizes)):
        if len(hashers) > 1 and all(isinstance(h.sha256, native_sha256.Sha256) for h in hashers):
            native_sha256.sha256_multi([h.sha256 for h in hashers], pieces)
        else:
            for h, piece in zip(hashers, pieces):
                h.sha256.update(piece)
    for h, piece, size in zip(hashers, pieces, sizes):
        if h.git is not None:
            with profile.span("hash.git", size):
                h.git.update(piece)


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


def digest_file(path, algorithm: str = DIGEST_ALGORITHM, kind: str = "read") -> tuple[int, str]:
    """(size, hex digest of `algorithm`) of a regular file (InputError otherwise), read once sequentially (kind: the
    profile's name for the read; the hashing is profiled as "hash.source")."""
    size, digests = digest_file_in(path, (algorithm,), kind)
    return size, digests[algorithm]


def digest_file_in(path, algorithms, kind: str = "read") -> tuple[int, dict[str, str]]:
    """(size, {algorithm: hex digest}) of a regular file in one sequential read, as digest_file."""
    path = Path(path)
    size = check_regular(path, "file").st_size
    hashes = {algorithm: new_hash(algorithm) for algorithm in algorithms}
    for chunk in _read_chunks(path, size, kind):
        with profile.span("hash.source", len(chunk) * len(hashes)):
            for h in hashes.values():
                h.update(chunk)
    return size, {algorithm: h.hexdigest() for algorithm, h in hashes.items()}


def copy_hashed(source, target, check=None, within=None, observe=None) -> tuple[int, str, str]:
    """Copy regular file `source` (InputError otherwise) to `target` by way of its temporary name (``NewFile``:
    never through a symlink; `within`: as NewFile's), fsynced, in one sequential read whose bytes are also hashed:
    (size, sha256 hex, git blob id hex) of what was copied. observe(chunk), when given, is fed every chunk after
    the hash (e.g. ``TensorHasher.update``). Every write's count is checked (a short write is written on; one that
    writes nothing is ENOSPC) and so is the copy's size before the rename. check(sha256, git blob id), when given,
    runs before the rename and may raise (the temporary is then removed, `target` untouched). OutputError when it
    cannot be written (a full disk: nothing left under `target`'s name)."""
    source, target = Path(source), Path(target)
    size = check_regular(source, "file").st_size
    hasher = FileHasher(size)
    feed = hasher.update if observe is None else (lambda chunk: (hasher.update(chunk), observe(chunk)))
    new = NewFile(target, within=within)
    try:
        with ThreadPoolExecutor(1) as pool:
            for chunk in _read_chunks(source, size):
                hashed = pool.submit(feed, chunk)               # hashlib releases the GIL: hash while writing
                with profile.span("write", len(chunk)):
                    write_all(new.fd, chunk)
                hashed.result()                                 # before the next read reuses the buffer
        written = os.fstat(new.fd).st_size
        if written != size:
            raise OSError(errno.EIO, f"copy holds {written} of {size} bytes")
        digests = hasher.hexdigests()
        if check is not None:
            check(*digests)
        new.commit()
    except OSError as exc:
        new.discard()
        raise OutputError(f"cannot write file ({exc.strerror})", file=str(target)) from None
    except BaseException:
        new.discard()
        raise
    return (size, *digests)


def write_all(fd: int, data) -> None:
    """os.write every byte of `data` to `fd`, writing on after a short write; OSError(ENOSPC) when a write writes
    nothing (the disk is full)."""
    view = memoryview(data).cast("B")
    while view:
        done = os.write(fd, view)
        if done <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[done:]


def hash_safetensors(path, header: ShardHeader | None = None, content_git: bool = False,
                     algorithms: str | Mapping[str, str] = DIGEST_ALGORITHM) -> tuple[int, str, str, dict[str, str]]:
    """(size, sha256, git blob id, {tensor: digest of its bytes}) of a .safetensors file in one sequential read.

    header: the file's already parsed header (else parsed here). InputError if the header does not parse (the
    caller can still compare the file hash via ``hash_file``). content_git: as for hash_file. algorithms: of the
    tensor digests, as TensorHasher's.
    """
    path = Path(path)
    header = parse_header(path) if header is None else header
    return hash_with_tensors(path, header.tensors, content_git, algorithms)


def hash_with_tensors(path, tensors: Mapping, content_git: bool = False,
                      algorithms: str | Mapping[str, str] = DIGEST_ALGORITHM) -> tuple[int, str, str, dict[str, str]]:
    """(size, sha256, git blob id, {tensor: digest of its bytes}) of a file holding `tensors` ({name: TensorRef},
    absolute offsets) in one sequential read; content_git and algorithms as for hash_safetensors."""
    path = Path(path)
    size = check_regular(path, "file").st_size
    hasher, per_tensor = FileHasher(size, content_git), TensorHasher(tensors, algorithms)
    for chunk in _read_chunks(path, size):
        hasher.update(chunk)
        per_tensor.update(chunk)
    return (size, *hasher.hexdigests(), per_tensor.digests())


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


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
REFUSED = "refusing to write through it"


def open_dir(path, within=None) -> int:
    """A read-only descriptor of folder `path`, to create, rename and remove names in (``dir_fd=``): whatever the
    path names later, the steps taken through the descriptor stay in this folder. The path's own symlinks are
    followed (OUT may be a link its owner made), unless `within` is given: `path` then lies inside folder `within`
    and each folder below `within` is opened without following a symlink, created when missing (OutputError naming
    one that is a symlink or no folder)."""
    if within is None:
        try:
            return os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        except OSError as exc:
            raise OutputError(f"cannot open folder ({exc.strerror})", file=str(path)) from None
    fd, current = open_dir(within), Path(within)
    try:
        for part in Path(path).relative_to(within).parts:
            current = current / part
            try:
                os.mkdir(part, dir_fd=fd)       # never follows: a symlink standing there is left for the open
            except FileExistsError:
                pass
            try:
                inner = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OutputError(f"folder is a symlink or not a folder; {REFUSED}", file=str(current),
                                      hint="remove it (ktconvert never makes one)") from None
                raise OutputError(f"cannot open folder ({exc.strerror})", file=str(current)) from None
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_name(path, dir_fd: int | None = None) -> None:
    """Remove whatever stands at `path` (its name inside folder `dir_fd` when given): a file, or a symlink itself,
    never what it points to; nothing there is fine. OutputError when it is a folder or cannot be removed."""
    try:
        os.unlink(Path(path).name if dir_fd is not None else path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.EPERM):
            try:
                is_dir = stat.S_ISDIR(os.lstat(Path(path).name if dir_fd is not None else path,
                                               dir_fd=dir_fd).st_mode)
            except OSError:
                is_dir = False
            if is_dir:
                raise OutputError("a folder stands at a file's name", file=str(path), hint="remove it") from None
        raise OutputError(f"cannot remove what stands at a file's name ({exc.strerror})", file=str(path),
                          hint="remove it") from None


def remove_tree(path) -> None:
    """Remove whatever stands at `path`: a folder with everything in it (``shutil.rmtree``, which follows no
    symlink inside), a file, or a symlink (the link itself, never its target); nothing there is fine."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return
    if is_dir:
        shutil.rmtree(path)
    else:
        os.unlink(path)


def create_new(path, flags: int = os.O_WRONLY, mode: int = 0o644, dir_fd: int | None = None) -> int:
    """A descriptor of the new, empty file `path` (its name inside folder `dir_fd` when given): whatever stood
    there is removed first (``remove_name``: a symlink itself, never its target), then the file is created
    ``O_CREAT|O_EXCL|O_NOFOLLOW``, so nothing put there meanwhile can redirect the write: OutputError naming it
    (like any failure to create it)."""
    name = Path(path).name if dir_fd is not None else path
    remove_name(path, dir_fd)
    try:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
    except FileExistsError:
        raise OutputError(f"a file or symlink appeared at this name while it was being created; {REFUSED}",
                          file=str(path), hint="something else writes this folder: stop it") from None
    except OSError as exc:
        raise OutputError(f"cannot create file ({exc.strerror})", file=str(path)) from None


def open_lock(path) -> int:
    """A read-write descriptor of lock file `path`, created when missing, never through a symlink: OutputError
    naming it when it is a symlink, not a regular file, or a hard link of another file (the lock is truncated to the
    holder's pid). Other OSErrors of the open are raised as they are."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise OutputError(f"lock file is a symlink; {REFUSED}", file=str(path),
                          hint="remove it (ktconvert never makes one)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:       # 0: its holder just removed it (the caller retries)
        os.close(fd)
        raise OutputError(f"lock file is not a regular file of its own; {REFUSED}", file=str(path),
                          found="a hard link" if stat.S_ISREG(st.st_mode) else "not a regular file",
                          hint="remove it (ktconvert never makes one)")
    return fd


class NewFile:
    """File `path` being created by way of the temporary name `temp` (default ``temp_path_for(path)``, in the same
    folder), never through a symlink: the folder is opened once (``open_dir(path.parent, within)``) and every step is
    taken relative to its descriptor; the temporary is ``create_new``'s; ``commit`` renames it over `path` (a symlink
    standing there is replaced itself, never followed), ``discard`` removes it (`path` untouched)::

        new = NewFile(path, os.O_RDWR)     # new.fd: the temporary, open with these flags
        ... write new.fd ...; new.commit()   # or new.discard() on failure
    """

    def __init__(self, path, flags: int = os.O_WRONLY, temp=None, within=None, mode: int = 0o644):
        self.path = Path(path)
        self.temp = temp_path_for(self.path) if temp is None else Path(temp)
        if self.temp.parent != self.path.parent:
            raise ValueError(f"temporary {self.temp} is not beside {self.path}")
        self.dir_fd: int | None = open_dir(self.path.parent, within)
        try:
            self.fd: int | None = create_new(self.temp, flags, mode, dir_fd=self.dir_fd)
        except BaseException:
            os.close(self.dir_fd)
            raise

    def commit(self, durable: bool = True, synced: bool = False) -> None:
        """Close the temporary and rename it over `path`. durable: fsync the file (unless `synced`: the caller
        did) before, the folder after. OSError as raised (the temporary removed)."""
        try:
            if durable and not synced:
                with profile.span("fsync"):
                    os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
            os.replace(self.temp.name, self.path.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            self.discard()
            raise
        try:
            if durable:
                with profile.span("fsync"):
                    os.fsync(self.dir_fd)
        except OSError:
            pass
        finally:
            os.close(self.dir_fd)
            self.dir_fd = None

    def discard(self) -> None:
        """Close and remove the temporary (idempotent; `path` is never touched)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.dir_fd is not None:
            try:
                os.unlink(self.temp.name, dir_fd=self.dir_fd)
            except OSError:
                pass
            os.close(self.dir_fd)
            self.dir_fd = None


def write_atomic(path: Path, data, durable: bool = True, temp=None, within=None) -> None:
    """Write bytes-like `data` to `path` via ``.NAME.partial`` (or `temp`) in the same folder, then rename
    (``NewFile``: never through a symlink; `within`: as there).

    durable: fsync the file before and its folder after the rename (False: the caller fsyncs later, in bulk).
    """
    path = Path(path)
    try:
        new = NewFile(path, temp=temp, within=within)      # creating the temporary can fail too (disk full)
    except OSError as exc:
        raise OutputError(f"cannot write file ({exc.strerror})", file=str(path)) from None
    try:
        with os.fdopen(new.fd, "wb", closefd=False) as fh:
            with profile.span("write", memoryview(data).nbytes):
                fh.write(data)
        new.commit(durable)
    except OSError as exc:
        new.discard()
        raise OutputError(f"cannot write file ({exc.strerror})", file=str(path)) from None
    except BaseException:
        new.discard()
        raise

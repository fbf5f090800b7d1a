"""Reading a checkpoint once, front to back: every byte of every source file is hashed exactly once, and the
expert matrices are handed out as the read reaches them.

This is how the source fingerprint (a digest per source file) costs no extra read: the conversion reads each file
sequentially, in offset order, instead of layer by layer. The digest is BLAKE3 (``digests.DIGEST_ALGORITHM``, about
half of sha256's core-seconds), or the sha256 a Hugging Face cache blob name gives without reading the file
(``known_sha256``; trusted as the cache's owner's own record of what the hub served: ``--verify-source-hash``
re-hashes it at conversion, ``verify --source --hashes`` at any time). The output does not depend on the order
(every output tensor has a fixed place), so processing in file order is free; memory stays at one matrix plus a
read chunk.
"""
from __future__ import annotations

import hashlib
import os
import queue
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.util import profile
from ktconvert.errors import InputError
from ktconvert.formats.digests import DIGEST_ALGORITHM, SHA256, new_hash
from ktconvert.util.safe_read import open_regular

CHUNK = 8 << 20   # bytes read at a time for data no job needs (non-expert tensors, headers)
HASH_QUEUE_DEPTH = 4   # buffers a file's reader may queue for its hashing thread
HASH_BUDGET = 32 << 20   # bytes queued for all hashing threads of the process together
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class MatrixJob:
    """One contiguous byte range of a source file that yields expert matrices.

    file/offset/nbytes: where the primary data lies. layer/expert: whose matrices. projs: the projections the
    range decodes to — ("gate",), ("up",), ("down",), or ("gate", "up") for a fused gate_up slice. tensor / index0:
    the stored tensor the range lies in and its expert slice (None: the whole tensor), for the read order and for
    messages. key: the source's own handle, opaque to everything but that source's decode().
    """

    file: Path
    offset: int
    nbytes: int
    layer: int
    expert: int
    projs: tuple[str, ...]
    tensor: str = ""
    index0: int | None = None
    key: object = field(default=())


@dataclass(frozen=True)
class FileDigest:
    """A source file read to its end: size and digest (hex of `algorithm`: "blake3", or "sha256" when a Hugging Face
    cache blob name gave it), and what tells a resumed run cheaply whether the file is still that one
    (``source_identity``): the sha256 of its first HEAD_BYTES and its stat identity."""

    bytes: int
    hexdigest: str
    algorithm: str = DIGEST_ALGORITHM
    head_sha256: str = ""
    identity: tuple = ()

    def entry(self) -> dict:
        """The manifest's (and the journal's) source file entry: {"bytes": size, algorithm: hex}."""
        return {"bytes": self.bytes, self.algorithm: self.hexdigest}


ENTRY_ALGORITHMS = (DIGEST_ALGORITHM, SHA256)   # the digest keys a source file entry may hold


def entry_algorithms(entry) -> list[str]:
    """The algorithms of the digests a source file entry {"bytes", "blake3" and/or "sha256": hex} records
    (``FileDigest.entry`` writes one; manifests before format_version 3 record "sha256"); every one is checked."""
    return [a for a in ENTRY_ALGORITHMS if isinstance(entry, dict) and a in entry]


def entry_algorithm(entry) -> str | None:
    """The first of ``entry_algorithms`` (BLAKE3 before sha256), None when the entry records no digest."""
    return next(iter(entry_algorithms(entry)), None)


HEAD_BYTES = 1 << 20   # the start of a file hashed apart: a safetensors header and the first tensor bytes


def head_sha256(fd: int, size: int) -> str:
    """sha256 of the first min(size, HEAD_BYTES) bytes of open file `fd`."""
    return hashlib.sha256(os.pread(fd, min(size, HEAD_BYTES), 0)).hexdigest()


def stat_identity(st: os.stat_result) -> tuple:
    """(device, inode, size, mtime ns, ctime ns): equal only for the same file not written since (a write or a
    metadata change moves ctime, which no program can set back)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ByteBudget:
    """At most `limit` bytes held at once by all callers together (one request larger than the limit is let
    through alone)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.cond = threading.Condition()

    def acquire(self, nbytes: int, wait_kind: str = "wait.read_budget") -> None:
        with self.cond:
            if self.held and self.held + nbytes > self.limit:
                with profile.span(wait_kind):
                    self.cond.wait_for(lambda: not self.held or self.held + nbytes <= self.limit)
            self.held += nbytes

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()


_QUEUED_FOR_HASHING = ByteBudget(HASH_BUDGET)


class _BackgroundHash:
    """A hash of `algorithm` fed from a bounded queue on its own thread (hashlib and blake3 release the GIL), so
    hashing the source overlaps reading and converting it: at most `depth` buffers queued, and at most HASH_BUDGET
    bytes queued by all files together. Buffers handed to update() must not be modified afterwards."""

    def __init__(self, algorithm: str, depth: int = HASH_QUEUE_DEPTH):
        self._hash = new_hash(algorithm)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name=f"ktconvert-{algorithm}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            with profile.span("hash.source", len(data)):
                self._hash.update(data)
            _QUEUED_FOR_HASHING.release(len(data))

    def update(self, data) -> None:
        _QUEUED_FOR_HASHING.acquire(len(data), "wait.hash.source")
        with profile.span("wait.hash.source"):
            self._queue.put(data)

    def hexdigest(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._hash.hexdigest()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def known_sha256(path, size: int | None = None) -> str | None:
    """The sha256 of `path` that its place tells without reading it, None unless every check holds: `path` is a
    symlink in a Hugging Face cache snapshot (``REPO/snapshots/REV/NAME``, folders below REV allowed) to a regular
    file ``REPO/blobs/BLOB`` of the same REPO whose name is 64 lowercase hex digits (huggingface_hub stores an LFS
    file under its sha256, the hub's ETag for it; other files under their 40-digit git blob id, never taken) and,
    when `size` is given (the hub's recorded size), of that size.

    Trust: the cache is the user's own, and the name is what the hub said the content is; a blob damaged on disk
    keeps its name, so ``--verify-source-hash`` (re-hash at conversion) and ``verify --source --hashes`` (re-hash
    later) are the checks of the content itself. A symlink planted elsewhere than a cache's own snapshot, into
    another repo's blobs, to a non-regular file or to a name that is no sha256 is not taken (the file is hashed)."""
    path = Path(path)
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name != "blobs" or not _SHA256_NAME.fullmatch(target.name):
        return None
    folder = Path(os.path.realpath(path.parent))
    snapshots = next((p for p in (folder, *folder.parents) if p.name == "snapshots"), None)
    if snapshots is None or folder == snapshots or target.parent != snapshots.parent / "blobs":
        return None
    try:
        st = os.stat(target)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        return None
    return target.name


def source_algorithm(known: str | None) -> str:
    """The one rule for a source file's digest: the algorithm a conversion records for a file whose sha256 is
    `known` without reading it (``known_sha256``: then that sha256) or not (then BLAKE3, from one read)."""
    return SHA256 if known is not None else DIGEST_ALGORITHM


class HashingFileReader:
    """Reads one file strictly front to back. `read_range` returns the requested bytes and hashes everything up
    to their end (gaps included); `finish` hashes the tail and returns the file's size and digest (BLAKE3).

    known: the file's sha256 when known without reading it (``known_sha256``): the digest is that sha256, nothing is
    hashed and gaps are skipped, unless verify, which hashes sha256 as usual and raises InputError at finish when the
    two differ."""

    def __init__(self, path: Path, known: str | None = None, verify: bool = False):
        self.path = Path(path)
        self._fd = open_regular(self.path, f"source file {self.path.name}")   # may have changed since it was checked
        self._opened = stat_identity(os.fstat(self._fd))
        self._size = self._opened[2]
        self._pos = 0
        self._known = known
        self.algorithm = source_algorithm(known)
        self._hash = _BackgroundHash(self.algorithm) if known is None or verify else None

    def __enter__(self) -> "HashingFileReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def skip_to(self, offset: int) -> None:
        """Move the stream to `offset` (the bytes before it hashed, read only for that)."""
        self._advance_to(offset)

    def _advance_to(self, offset: int) -> None:
        if self._hash is None:
            self._pos = max(self._pos, offset)
            return
        while self._pos < offset:
            n = min(CHUNK, offset - self._pos)
            self._hash.update(self._pread(self._pos, n))
            self._pos += n

    def _pread(self, offset: int, nbytes: int) -> bytes:
        with profile.span("read", nbytes):
            data = os.pread(self._fd, nbytes, offset)
        if len(data) != nbytes:
            raise InputError("file changed or truncated while reading", file=self.path,
                             expected=f"{nbytes} bytes at offset {offset}", found=f"{len(data)} bytes")
        return data

    def read_range(self, offset: int, nbytes: int) -> np.ndarray:
        """uint8 [nbytes] of the file at `offset`; offsets must not go backwards."""
        if offset < self._pos:
            raise ValueError(f"{self.path}: read at {offset} is behind the stream position {self._pos}")
        self._advance_to(offset)
        buf = np.empty(nbytes, dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        with profile.span("read", nbytes):
            while done < nbytes:
                got = os.preadv(self._fd, [view[done:]], offset + done)
                if got <= 0:
                    raise InputError("file changed or truncated while reading", file=self.path,
                                     expected=f"{nbytes} bytes at offset {offset}", found=f"{done} bytes")
                done += got
        if self._hash is not None:
            self._hash.update(buf)
        self._pos = offset + nbytes
        return buf

    def finish(self) -> FileDigest:
        self._advance_to(self._size)
        hexdigest = self._known
        if self._hash is not None:
            with profile.span("wait.hash.source"):
                hexdigest = self._hash.hexdigest()
        if self._known is not None and hexdigest != self._known:
            raise InputError("source file does not match its Hugging Face cache blob name (sha256)", file=self.path,
                             expected=self._known, found=hexdigest,
                             hint="the cache is damaged: download the file again")
        st = os.fstat(self._fd)
        if st.st_size != self._size:
            raise InputError("file size changed while converting", file=self.path, expected=self._size,
                             found=st.st_size)
        head = head_sha256(self._fd, self._size)
        os.close(self._fd)
        self._fd = -1
        same = stat_identity(st) == self._opened        # else written while read: no identity to trust later
        return FileDigest(self._size, hexdigest, self.algorithm, head, self._opened if same else ())

    def close(self) -> None:
        if self._hash is not None:
            self._hash.stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def jobs_by_file(jobs: list[MatrixJob]) -> dict[Path, list[MatrixJob]]:
    """Group jobs per file, each list in offset order; overlapping ranges are a source bug."""
    grouped: dict[Path, list[MatrixJob]] = {}
    for job in jobs:
        grouped.setdefault(job.file, []).append(job)
    for path, items in grouped.items():
        items.sort(key=lambda j: j.offset)
        for a, b in zip(items, items[1:]):
            if b.offset < a.offset + a.nbytes:
                raise InputError("overlapping tensor data", file=path, tensor=b.tensor or None)
    return grouped

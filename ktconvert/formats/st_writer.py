"""Streaming safetensors writer: header first, each tensor written at its offset, temp name → atomic rename.

The bytes equal what ``safetensors.numpy.save_file`` / ``safetensors.torch.save_file`` (safetensors 0.8.0) write for
the same tensors. The library's rules (safetensors/src/tensor.rs ``prepare`` and ``impl Serialize for Metadata``,
confirmed by experiment against the installed wheel):

* Data order: tensors sorted by dtype **descending** in the library's ``Dtype`` enum order (which is increasing
  alignment: BOOL < U8 < I8 < F8_* < I16 < U16 < F16 < BF16 < I32 < U32 < F32 < C64 < F64 < I64 < U64), then by
  name ascending (byte-wise UTF-8, = Python's code-point order). Offsets are packed, no padding between tensors.
* Header: compact JSON (no spaces), ``"__metadata__"`` first when metadata is given (an empty dict still writes
  ``"__metadata__":{}``; ``None`` omits it), then every tensor in data order as
  ``{"dtype":..,"shape":[..],"data_offsets":[begin,end]}``. Non-ASCII is written raw (UTF-8), control characters
  escaped as in ``json.dumps``. The JSON is right-padded with spaces to a multiple of 8; the 8-byte little-endian
  length counts the padding.
* The library writes ``__metadata__`` from a Rust ``HashMap``, so its order for two or more keys is not
  deterministic; this writer sorts metadata keys (identical bytes whenever the library's output is deterministic).

Each tensor's digest is BLAKE3 (``digests.digest``: the file's sha256 covers the same bytes for the hubs, the tensor
digest only needs to be a cryptographic hash ``verify`` recomputes, and BLAKE3 costs about half of sha256's
core-seconds). Memory: the writer holds the header, one tensor's hash state and at most ``ordered_hash.PARK_BYTES``
of tensors that arrived ahead of the file hash; tensors go to disk with ``pwrite`` as given.
"""
from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from ktconvert.util import profile
from ktconvert.errors import OutputError
from ktconvert.formats.digests import digest
from ktconvert.formats.fileio import FileRecord, LayerResult, NewFile, temp_path_for
from ktconvert.formats.ordered_hash import OrderedFileHash

# safetensors Dtype enum order (increasing alignment). Data are sorted by this rank, descending.
DTYPE_RANK: dict[str, int] = {name: i for i, name in enumerate([
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"])}

# dtype name -> numpy dtype of the array write() expects (raw bits for BF16 / F8).
NUMPY_DTYPES: dict[str, str] = {
    "BOOL": "|b1", "U8": "|u1", "I8": "|i1", "F8_E5M2": "|u1", "F8_E4M3": "|u1", "F8_E8M0": "|u1",
    "F8_E4M3FNUZ": "|u1", "F8_E5M2FNUZ": "|u1", "I16": "<i2", "U16": "<u2", "F16": "<f2", "BF16": "<u2",
    "I32": "<i4", "U32": "<u4", "F32": "<f4", "C64": "<c8", "F64": "<f8", "I64": "<i8", "U64": "<u8",
}
_BIT_PATTERN_DTYPES = {"BF16", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
MAX_HEADER_BYTES = 100_000_000   # the library refuses larger headers
_WRITE_CHUNK = 1 << 30           # Linux writes at most ~2 GiB per call



def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes of a tensor of safetensors dtype `dtype` and `shape` (byte-sized dtypes only)."""
    if dtype not in NUMPY_DTYPES:
        raise OutputError("unsupported safetensors dtype for writing", expected=", ".join(NUMPY_DTYPES),
                          found=repr(dtype))
    return math.prod(shape) * np.dtype(NUMPY_DTYPES[dtype]).itemsize


def build_header(specs: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(8-byte length + padded JSON header, {name: (absolute begin, absolute end)}) for `specs` in library order."""
    ordered = sorted(specs, key=lambda s: (-DTYPE_RANK[s[1]], s[0]))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(metadata[k]) for k in sorted(metadata)}
    offset, spans = 0, {}
    for name, dtype, shape in ordered:
        end = offset + tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, end]}
        spans[name] = (offset, end)
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise OutputError("safetensors header too large", expected=f"<= {MAX_HEADER_BYTES} bytes",
                          found=f"{len(text)} bytes for {len(specs)} tensors")
    start = 8 + len(text)
    return len(text).to_bytes(8, "little") + text, {n: (b + start, e + start) for n, (b, e) in spans.items()}


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + _WRITE_CHUNK], offset + done)



class StreamingSafetensorsWriter:
    """Write one .safetensors file tensor by tensor, in any order, without holding it in memory.

    path:     final file name; data go to ``temp_path_for(path)`` until ``close()`` renames it into place
              (``fileio.NewFile``: never through a symlink standing at either name).
    specs:    [(name, dtype, shape)], dtype a safetensors name ("I8", "F32", "BF16", ...); every tensor must be
              written exactly once with ``write(name, array)``.
    metadata: the ``__metadata__`` map (str -> str) or None (no ``__metadata__`` entry).
    fsync_and_hash: False for scratch files in a folder that is renamed into place as a whole when complete (tiny
              models): no fsync and no hashing, same bytes; ``sha256`` / ``git_sha1`` stay None and
              ``tensor_sha256`` maps each written name to "".
    park_bytes: copies of early tensors the file hash may hold (``OrderedFileHash``; None: its default). 0 for a
              file whose tensors are known to arrive far out of its order, where copies would only cost memory.

    After ``close()``: ``size``, ``sha256``, ``git_sha1`` (of the whole file, fed from the bytes as they were
    written: ``ordered_hash.OrderedFileHash``; ``read_back`` bytes of it re-read) and ``tensor_sha256`` ({name:
    digest}, the name kept from when it was a sha256: ``digests.digest``'s "blake3:<hex>").
    ``write`` may be called from several threads at once.
    """

    def __init__(self, path, specs, metadata: dict[str, str] | None = None, fsync_and_hash: bool = True,
                 park_bytes: int | None = None):
        self.path = Path(path)
        self.park_bytes = park_bytes
        self.fsync_and_hash = fsync_and_hash
        self.temp_path = temp_path_for(self.path)
        specs = [(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in specs]
        names = [n for n, _, _ in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise OutputError("duplicate tensor names in one shard", file=self.path.name, tensor=dup[0],
                              found=f"{len(dup)} duplicated")
        self._dtypes = {n: (d, s) for n, d, s in specs}
        header, self._spans = build_header(specs, metadata)
        self.size = len(header) + sum(e - b for b, e in self._spans.values())
        self.tensor_sha256: dict[str, str] = {}
        self.sha256: str | None = None
        self.git_sha1: str | None = None
        self.read_back = 0      # bytes the file hash had to read back (pieces that arrived far out of file order)
        self._fd: int | None = None
        self._new: NewFile | None = None
        self._hash: OrderedFileHash | None = None
        self._open(header)

    def _open(self, header: bytes) -> None:
        self._new = NewFile(self.path, os.O_RDWR)         # OutputError naming the temporary when refused
        self._fd = self._new.fd
        try:
            _pwrite_all(self._fd, memoryview(header), 0)
            os.ftruncate(self._fd, self.size)
            _preallocate(self._fd, self.size)
            if self.fsync_and_hash:
                self._hash = OrderedFileHash(self._fd, self.size, self.park_bytes)
                self._hash.wrote(0, header)
        except OSError as exc:
            self.abort()
            raise OutputError(f"cannot create output file ({exc.strerror})", file=str(self.temp_path),
                              expected=f"{self.size} bytes of space") from None

    def write(self, name: str, array: np.ndarray) -> str:
        """Write tensor `name` at its offset; returns the digest (``digests.digest``) of the bytes given."""
        if self._fd is None:
            raise OutputError("writer is closed", file=self.path.name, tensor=name)
        if name not in self._spans:
            raise OutputError("tensor not declared for this shard", file=self.path.name, tensor=name)
        if name in self.tensor_sha256:
            raise OutputError("tensor written twice", file=self.path.name, tensor=name)
        data = self._checked_bytes(name, array)
        begin, _ = self._spans[name]
        try:
            with profile.span("write", len(data)):
                _pwrite_all(self._fd, data, begin)
        except OSError as exc:
            raise OutputError(f"write failed ({exc.strerror})", file=str(self.temp_path), tensor=name) from None
        with profile.span("hash.tensor", len(data)):
            tensor_digest = digest(data) if self.fsync_and_hash else ""
        if self._hash is not None:
            self._hash.wrote(begin, data)
        self.tensor_sha256[name] = tensor_digest
        return tensor_digest

    def _checked_bytes(self, name: str, array: np.ndarray) -> memoryview:
        dtype, shape = self._dtypes[name]
        array = np.asarray(array)
        want = np.dtype(NUMPY_DTYPES[dtype])
        got = array.dtype
        bits_ok = dtype in _BIT_PATTERN_DTYPES and got.kind in "iu" and got.itemsize == want.itemsize
        if got != want and not bits_ok:
            raise OutputError("wrong array dtype", file=self.path.name, tensor=name,
                              expected=f"{dtype} (numpy {want})", found=str(array.dtype))
        if tuple(array.shape) != shape:
            raise OutputError("wrong tensor shape", file=self.path.name, tensor=name,
                              expected=str(list(shape)), found=str(list(array.shape)))
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        begin, end = self._spans[name]
        if flat.nbytes != end - begin:
            raise OutputError("wrong byte count", file=self.path.name, tensor=name,
                              expected=str(end - begin), found=str(flat.nbytes))
        return memoryview(flat)

    def missing(self) -> list[str]:
        """Declared tensors not written yet, sorted."""
        return sorted(set(self._spans) - set(self.tensor_sha256))

    def close(self) -> None:
        """Check completeness, take the file's hashes (fed while the bytes went out: ordered_hash), fsync, drop its
        pages from the page cache, rename into place, fsync the dir (no fsync, hashing or dropping without
        fsync_and_hash)."""
        if self._fd is None:
            raise OutputError("writer already closed or aborted", file=self.path.name)
        missing = self.missing()
        if missing:
            self.abort()
            raise OutputError(f"shard incomplete: {len(missing)} tensor(s) never written", file=self.path.name,
                              tensor=missing[0], found=", ".join(missing[:3]) + (" ..." if len(missing) > 3 else ""))
        try:
            size = os.fstat(self._fd).st_size
            if size != self.size:
                self.abort()
                raise OutputError("file size changed while writing", file=str(self.temp_path),
                                  expected=str(self.size), found=str(size))
            if self._hash is not None:
                self.sha256, self.git_sha1 = self._hash.hexdigests()
                self.read_back = self._hash.read_back
                with profile.span("fsync", self.size):
                    os.fsync(self._fd)
                _drop_cached(self._fd)
            self._fd = None
            self._new.commit(durable=self.fsync_and_hash, synced=True)   # the folder fsynced when durable
        except OSError as exc:
            self.abort()
            raise OutputError(f"cannot finish output file ({exc.strerror})", file=str(self.path)) from None

    def record(self, name: str | None = None) -> FileRecord:
        """The closed file's FileRecord, listed as `name` (its path relative to the output folder; default: the
        file's own name)."""
        return FileRecord(name or self.path.name, self.size, self.sha256, self.git_sha1)

    def layer_result(self, name: str | None = None) -> LayerResult:
        """LayerResult of a layer written as this one closed file: its record and the digest of every tensor."""
        return LayerResult([self.record(name)], dict(self.tensor_sha256))

    def abort(self) -> None:
        """Close and delete the temporary file (the final name is never touched)."""
        self._fd = None
        if self._new is not None:
            self._new.discard()

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._fd is not None:
            self.close()


def _drop_cached(fd: int) -> None:
    """Let the kernel drop the file's pages from the page cache (clean: fsync'd): a conversion writing far more than
    the machine's memory then does not push everything else out, nor pay for reclaiming its own old pages while
    it writes new ones (3-output convert of a 3.6 GB model with 15 of 23 GB cached: write core-s 2.2 -> 1.3)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks up front so a full disk fails here, not half-way through a shard."""
    if size == 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return
        raise

"""Hashing a file while it is written, when its pieces go out at known offsets in any order.

sha256 and the git blob SHA-1 need the bytes in file order, but a shard's tensors arrive in the order the source
is read and the workers finish. ``OrderedFileHash`` feeds the hashers from the bytes as they are written whenever a
piece continues the hashed prefix (then any parked pieces that follow it); a piece that arrives ahead is parked as
a copy while the copies held stay within ``PARK_BYTES``, and otherwise only its place is remembered and its
bytes are read back from the file (just written, so from the page cache) when the prefix reaches it, in
``fileio.HASH_CHUNK`` slices (profile: ``read.output``). Memory: at most PARK_BYTES of copies plus one read chunk
per file. The digests never depend on the arrival order; ``read_back`` says how many bytes had to be re-read.
"""
from __future__ import annotations

import os
import threading

from ktconvert.util import profile
from ktconvert.errors import OutputError
from ktconvert.formats import fileio

PARK_BYTES = 16 << 20   # copies of early pieces one file may hold


class OrderedFileHash:
    """sha256 + git blob id (``fileio.FileHasher``) of the `size`-byte file open as `fd`, fed as pieces are written.

    Call ``wrote(offset, data)`` after each piece (bytes-like, already on its way to the file) from any thread;
    pieces must not overlap and must cover the file once all are written. ``hexdigests()`` then returns
    (sha256 hex, git blob id hex)."""

    def __init__(self, fd: int, size: int, park_bytes: int | None = None):
        self._fd, self.size = fd, size
        self.park_bytes = PARK_BYTES if park_bytes is None else park_bytes
        self._hasher = fileio.FileHasher(size)
        self._frontier = 0      # end of the prefix fed to the hashers or being fed by the feeding thread
        self._parked: dict[int, tuple[int, bytes | None]] = {}   # begin -> (end, copy or None: read back)
        self._held = 0
        self._feeding = False
        self._lock = threading.Lock()
        self.read_back = 0

    def wrote(self, offset: int, data) -> None:
        """Piece `data` (bytes-like) now lies at `offset` of the file."""
        view = memoryview(data).cast("B")
        if not len(view):
            return
        with self._lock:
            if self._feeding or offset != self._frontier:
                self._park(offset, view)
                return
            self._feeding = True
        self._feed_chain(offset, offset + len(view), view)

    def _park(self, offset: int, view: memoryview) -> None:
        end = offset + len(view)
        keep = self._held + len(view) <= self.park_bytes
        self._parked[offset] = (end, bytes(view) if keep else None)
        self._held += len(view) if keep else 0

    def _feed_chain(self, begin: int, end: int, data) -> None:
        """Feed [begin, end) (data, or None: read it back), then every parked piece that continues the prefix."""
        try:
            while True:
                self._feed(begin, end, data)
                with self._lock:
                    self._frontier = end
                    if end not in self._parked:
                        self._feeding = False
                        return
                    begin, (end, data) = end, self._parked.pop(end)
                    self._held -= len(data) if data is not None else 0
        except BaseException:
            with self._lock:
                self._feeding = False
            raise

    def _feed(self, begin: int, end: int, data) -> None:
        if data is not None:
            self._hasher.update(data)
            return
        buf = bytearray(min(fileio.HASH_CHUNK, end - begin))
        pos = begin
        while pos < end:
            n = min(len(buf), end - pos)
            with profile.span("read.output", n):
                got = os.preadv(self._fd, [memoryview(buf)[:n]], pos)
            if got != n:
                raise OutputError("output file shorter than written while hashing it", expected=f"{n} bytes at {pos}",
                                  found=f"{got} bytes")
            self._hasher.update(memoryview(buf)[:n])
            pos += n
        self.read_back += end - begin

    def hexdigests(self) -> tuple[str, str]:
        """(sha256 hex, git blob id hex) once every byte was written; OutputError if a piece is missing."""
        with self._lock:
            frontier, parked = self._frontier, sorted(self._parked)
        if frontier != self.size:
            raise OutputError("output bytes never written", expected=f"{self.size} bytes",
                              found=f"a gap at offset {frontier}" + (f" (next piece at {parked[0]})" if parked else ""))
        return self._hasher.hexdigests()

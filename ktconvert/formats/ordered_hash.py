"""Hashing a file while it is written, when its pieces go out at known offsets in any order.

sha256 and the git blob SHA-1 need the bytes in file order, but a shard's tensors arrive in the order the source
is read and the workers finish. ``OrderedFileHash`` feeds the hashers from the bytes as they are written whenever a
piece continues the hashed prefix (then any parked pieces that follow it); a piece that arrives ahead is parked as
a copy while the copies held stay within ``PARK_BYTES``, and otherwise only its place is remembered and its
bytes are read back from the file (just written, so from the page cache) when the prefix reaches it, in
``fileio.HASH_CHUNK`` slices (profile: ``read.output``). Memory: at most PARK_BYTES of copies plus one read chunk
per file. The digests never depend on the arrival order; ``read_back`` says how many bytes had to be re-read.

The hash lane: one SHA-256 stream is latency-bound, two interleaved on one core run at nearly twice the speed
(``ktconvert.native.sha256``). While two or more files of ``LANE_MIN_BYTES`` or more are hashed as written at once
in this process (``convert`` writing several outputs' shards of a layer, or several layers at a time) and the
native SHA-NI hasher runs here, their hashes go to one lane thread instead: ``wrote`` only records where the
written prefix ends (no copy; of a piece ahead of it only its place), and the lane hashes the written bytes from
the page cache, mapped (``mmap``, no copy) ``LANE_CHUNK`` at a time, two files interleaved. It starts once two
files hold ``LANE_BATCH`` unhashed bytes (``LANE_PAIR_MIN`` each at least), one holds ``LANE_SOLO_LAG`` (hashed
alone), or a file is finishing (``hexdigests`` waits for it, profiled as ``wait.hash.file``). Memory: two mapped
chunks (a copy of one chunk per file where the filesystem cannot map it); the bytes it reads are the page cache's,
which the writers drop only after ``hexdigests``. A forked child starts with a lane of its own (the parent's
threads do not exist there). A file alone in the process, a smaller file, and every file where SHA-NI does not run
are hashed as before; the digests are the same either way.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref

from ktconvert.util import profile
from ktconvert.errors import OutputError
from ktconvert.formats import fileio
from ktconvert.native import sha256 as native_sha256

PARK_BYTES = 16 << 20   # copies of early pieces one file may hold
# The lane pairs two files once they hold LANE_BATCH unhashed bytes, LANE_PAIR_MIN each at least: large, so that a
# file written in file order keeps a reserve to pair with one whose bytes become hashable all at once (a shard whose
# first piece comes last). It hashes a file alone only when it is finishing or holds LANE_SOLO_LAG.
LANE_BATCH = 256 << 20
LANE_PAIR_MIN = 64 << 20
LANE_SOLO_LAG = 256 << 20
LANE_CHUNK = 8 << 20    # bytes of one file the lane maps and hashes per step
LANE_MIN_BYTES = 32 << 20   # smaller files are always hashed as written (pairing them saves little)
LANE_THREADS = max(1, (os.cpu_count() or 1) // 4)   # lane threads at most (one per two files being hashed)


class OrderedFileHash:
    """sha256 + git blob id (``fileio.FileHasher``) of the `size`-byte file open as `fd`, fed as pieces are written.

    Call ``wrote(offset, data)`` after each piece (bytes-like, already on its way to the file) from any thread;
    pieces must not overlap and must cover the file once all are written. ``hexdigests()`` then returns
    (sha256 hex, git blob id hex). ``read_back``: bytes re-read to hash them; ``lane_bytes``: bytes the hash lane
    hashed from the page cache (see the module)."""

    def __init__(self, fd: int, size: int, park_bytes: int | None = None):
        self._fd, self.size = fd, size
        self.park_bytes = PARK_BYTES if park_bytes is None else park_bytes
        self._hasher = fileio.FileHasher(size)
        self._frontier = 0      # end of the prefix fed to the hashers or being fed (in the lane: the written prefix)
        self._parked: dict[int, tuple[int, bytes | None]] = {}   # begin -> (end, copy or None: read back)
        self._held = 0
        self._feeding = False
        self._lock = threading.Lock()
        self.read_back = 0
        self.lane_bytes = 0     # bytes the lane hashed from the page cache (mapped, not copied)
        self._lane: _LaneFile | None = None
        self._lane_fit = size >= LANE_MIN_BYTES and _readable(fd)     # the lane maps the file: it must be readable
        if self._lane_fit:
            _LANE.opened(self)

    def wrote(self, offset: int, data) -> None:
        """Piece `data` (bytes-like) now lies at `offset` of the file."""
        view = memoryview(data).cast("B")
        if not len(view):
            return
        with self._lock:
            if self._lane is None and not self._feeding and self._lane_fit and _LANE.shared():
                try:
                    self._join_lane()
                except OSError:             # no descriptor left to dup: hashed as written, as before
                    self._lane_fit = False
            if self._lane is not None:
                self._wrote_lane(offset, offset + len(view))
                return
            if self._feeding or offset != self._frontier:
                self._park(offset, view)
                return
            self._feeding = True
        self._feed_chain(offset, offset + len(view), view)

    def _join_lane(self) -> None:
        """From now on the lane hashes this file from the hashed prefix on (self._lock held, nothing being fed):
        parked copies are dropped (their bytes are in the file), their places kept."""
        self._lane = _LANE.join(self)
        self._parked = {begin: (end, None) for begin, (end, _copy) in self._parked.items()}
        self._held = 0
        self._wrote_lane(self._frontier, self._frontier)

    def _wrote_lane(self, begin: int, end: int) -> None:
        """[begin, end) is written: extend the written prefix through it and the parked places that follow, and
        tell the lane (self._lock held)."""
        if begin != self._frontier:
            self._parked[begin] = (end, None)
            return
        while end in self._parked:
            end = self._parked.pop(end)[0]
        self._frontier = end
        _LANE.written(self._lane, end)

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
            frontier, parked, lane = self._frontier, sorted(self._parked), self._lane
        if frontier != self.size:
            raise OutputError("output bytes never written", expected=f"{self.size} bytes",
                              found=f"a gap at offset {frontier}" + (f" (next piece at {parked[0]})" if parked else ""))
        if lane is not None:
            _LANE.finish(lane)
            self.lane_bytes = lane.hashed - lane.start
        _LANE.closed(self)
        return self._hasher.hexdigests()


class _LaneFile:
    """A file the lane hashes: its hasher, its own descriptor (a dup: the writer may close its own), the written
    prefix end and the hashed one (both guarded by the lane's lock)."""

    def __init__(self, owner: OrderedFileHash):
        self.hasher, self.size = owner._hasher, owner.size
        self.fd = os.dup(owner._fd)
        self.close_fd = weakref.finalize(self, os.close, self.fd)
        self.start = self.hashed = self.written = owner._frontier
        self.finishing = False
        self.busy = False       # a lane thread is hashing a step of it
        self.error: BaseException | None = None

    def pending(self) -> int:
        """Unhashed written bytes a lane thread may take now."""
        return self.written - self.hashed if self.error is None and not self.busy else 0


class _HashLane:
    """The process's hash lane (see the module): which OrderedFileHashes are open, and the threads hashing the files
    that joined it, two files at a time each (one thread per two files, LANE_THREADS at most)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._open: weakref.WeakSet = weakref.WeakSet()     # files being hashed as written (abandoned ones drop out)
        self._files: list[_LaneFile] = []                    # files in the lane, not yet hashed to the end
        self._threads: list[threading.Thread] = []

    def opened(self, owner: OrderedFileHash) -> None:
        with self._cond:
            self._open.add(owner)

    def closed(self, owner: OrderedFileHash) -> None:
        with self._cond:
            self._open.discard(owner)

    def shared(self) -> bool:
        """Whether files should join the lane now: two or more of LANE_MIN_BYTES are open and the native SHA-NI
        hasher runs."""
        return len(self._open) > 1 and native_sha256.runs_sha_ni()

    def join(self, owner: OrderedFileHash) -> _LaneFile:
        lane_file = _LaneFile(owner)
        weakref.finalize(owner, self._abandon, lane_file)   # a writer dropped unfinished: let go of its file
        with self._cond:
            self._files.append(lane_file)
            if len(self._threads) < min(LANE_THREADS, (len(self._files) + 1) // 2):
                thread = threading.Thread(target=self._run, name="ktconvert-hash-lane", daemon=True)
                thread.start()
                self._threads.append(thread)
        return lane_file

    def written(self, lane_file: _LaneFile, end: int) -> None:
        with self._cond:
            lane_file.written = end
            if self._ready():
                self._cond.notify_all()         # lane threads and finishing callers wait on the same condition

    def _abandon(self, lane_file: _LaneFile) -> None:
        with self._cond:
            if lane_file.hashed < lane_file.size and lane_file.error is None:
                lane_file.error = OutputError("file abandoned before it was complete")
            if lane_file.busy:
                return                  # the thread hashing it drops it after its step
            self._files = [f for f in self._files if f is not lane_file]
        lane_file.close_fd()

    def finish(self, lane_file: _LaneFile) -> None:
        """Wait until the lane hashed every byte of `lane_file` (all written); OutputError if it could not."""
        with profile.span("wait.hash.file"):
            with self._cond:
                lane_file.finishing = True
                self._cond.notify_all()
                while lane_file.hashed < lane_file.size and lane_file.error is None:
                    self._cond.wait()
        lane_file.close_fd()
        if lane_file.error is not None:
            raise OutputError(f"cannot hash the output file as written ({lane_file.error})")

    def _ready(self) -> bool:
        """Whether to take a step: a file is finishing, two files hold enough to pair, or one holds LANE_SOLO_LAG."""
        if any(f.finishing and f.pending() for f in self._files):
            return True
        pending = sorted((f.pending() for f in self._files), reverse=True) + [0, 0]
        return pending[1] >= LANE_PAIR_MIN and pending[0] + pending[1] >= LANE_BATCH or pending[0] >= LANE_SOLO_LAG

    def _pick(self) -> list[tuple[_LaneFile, int, int]]:
        """(file, begin, bytes) of the next step: the file finishing or holding the most unhashed bytes, and the
        next such one beside it, as many bytes of each as both hold (at most LANE_CHUNK)."""
        files = sorted((f for f in self._files if f.pending()), key=lambda f: (f.finishing, f.pending()),
                       reverse=True)[:2]
        n = min([LANE_CHUNK] + [f.pending() for f in files])
        if len(files) == 2 and files[1].pending() < 64:
            files, n = files[:1], min(LANE_CHUNK, files[0].pending())
        for f in files:
            f.busy = True
        return [(f, f.hashed, n) for f in files]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready():
                    self._cond.wait()
                step = self._pick()
            try:
                _hash_mapped(step)
                error = None
            except BaseException as exc:      # noqa: BLE001 -- handed to the file's hexdigests
                error = exc
            with self._cond:
                for lane_file, _begin, n in step:
                    lane_file.hashed += n
                    lane_file.busy = False
                    lane_file.error = lane_file.error or error
                dropped = [f for f in self._files if f.error is not None]
                self._files = [f for f in self._files if f.hashed < f.size and f.error is None]
                self._cond.notify_all()
            for lane_file in dropped:   # its caller is told by finish, or nobody waits (abandoned)
                lane_file.close_fd()


def _readable(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY
    except OSError:
        return False


def _hash_mapped(step: list[tuple[_LaneFile, int, int]]) -> None:
    """Feed each file's hasher its bytes [begin, begin + n), mapped from the file (page cache), the files' sha256s
    interleaved."""
    maps, views = [], []
    try:
        for lane_file, begin, n in step:
            start = begin - begin % mmap.ALLOCATIONGRANULARITY
            try:
                mapped = mmap.mmap(lane_file.fd, begin + n - start, access=mmap.ACCESS_READ, offset=start)
            except OSError:         # a filesystem that cannot map the file: the bytes read back (a copy)
                views.append(memoryview(_pread_all(lane_file.fd, n, begin)))
                continue
            maps.append(mapped)
            views.append(memoryview(mapped)[begin - start:])
        fileio.update_together([lane_file.hasher for lane_file, _b, _n in step], views)
    finally:
        for view in views:
            view.release()
        for mapped in maps:
            mapped.close()


def _pread_all(fd: int, n: int, offset: int) -> bytearray:
    """The file's `n` bytes at `offset` (OSError if it holds fewer: they were written, so it must)."""
    out = bytearray(n)
    view, done = memoryview(out), 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise OSError(f"{n - done} written bytes missing at offset {offset + done}")
        done += got
    return out


def _new_lane() -> None:
    """A fresh lane for this process (at import, and in a forked child, which has none of the parent's threads)."""
    global _LANE
    _LANE = _HashLane()


_LANE: _HashLane
_new_lane()
os.register_at_fork(after_in_child=_new_lane)

"""The native multi-stream SHA-256 (native/sha256_multi.c, ktconvert.native.sha256) against hashlib.

Every digest is compared with ``hashlib.sha256`` over the same bytes (and the FIPS 180-2 test vectors pin both), for
every implementation this host runs (``portable``; ``sha-ni`` where the CPU has the SHA extensions): every length
0..4096, random splits of updates, a 64 MiB input in odd-sized pieces, many streams of different lengths in one
``sha256_multi`` call, and many threads hashing at once through the shared lane that pairs their streams.
"""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest

from ktconvert.formats import fileio
from ktconvert.native import sha256

pytestmark = pytest.mark.skipif(not sha256.available(), reason="native library not built")
IMPLS = sha256.usable_impls() or ["portable"]


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


# FIPS 180-2 appendix B: "abc", the 448-bit message, one million "a".
VECTORS = [(b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
           (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"),
           (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0")]


@pytest.mark.parametrize("impl", IMPLS)
def test_fips_vectors(impl):
    for message, expected in VECTORS:
        assert sha256.Sha256(message, impl=impl).hexdigest() == expected
        assert _sha(message) == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_every_length_to_4096(impl):
    data = _data(4096, seed=1)
    for n in range(4097):
        assert sha256.Sha256(data[:n], impl=impl).hexdigest() == _sha(data[:n]), n


@pytest.mark.parametrize("impl", IMPLS)
def test_random_splits_and_copy(impl):
    rng = random.Random(2)
    for trial in range(60):
        data = _data(rng.randrange(0, 20000), seed=trial)
        h = sha256.Sha256(impl=impl)
        pos, forks = 0, []
        while pos < len(data):
            step = rng.choice([1, 3, 63, 64, 65, 127, 128, rng.randrange(1, 9000)])
            h.update(memoryview(data)[pos:pos + step])
            pos += step
            if rng.random() < 0.2:
                forks.append((min(pos, len(data)), h.copy()))
        assert h.hexdigest() == h.hexdigest() == _sha(data)
        assert h.digest() == hashlib.sha256(data).digest()
        for at, fork in forks:                  # a copy goes on alone, unaffected by the original
            assert fork.hexdigest() == _sha(data[:at])
            fork.update(b"tail")
            assert fork.hexdigest() == _sha(data[:at] + b"tail")
        assert h.hexdigest() == _sha(data)


def test_hashlib_interface():
    h = sha256.Sha256()
    assert (h.name, h.digest_size, h.block_size) == ("sha256", 32, 64)
    h.update(b"ab")
    h.update(bytearray(b"c"))
    h.update(np.frombuffer(b"de", dtype=np.uint8))
    h.update(memoryview(np.arange(4, dtype=np.uint16)))         # any contiguous buffer, as its bytes
    expected = b"abcde" + np.arange(4, dtype=np.uint16).tobytes()
    assert h.hexdigest() == _sha(expected)
    with pytest.raises(TypeError):
        h.update(memoryview(np.arange(8, dtype=np.uint8))[::2])  # not contiguous: refused, as hashlib does
    with pytest.raises(TypeError):
        h.update("text")


@pytest.mark.parametrize("impl", IMPLS)
def test_large_input_in_odd_pieces(impl):
    data = _data(64 << 20, seed=3)
    rng = random.Random(4)
    h, view, pos = sha256.Sha256(impl=impl), memoryview(data), 0
    while pos < len(data):
        step = rng.randrange(1, 3 << 20) | 1
        h.update(view[pos:pos + step])
        pos += step
    assert h.hexdigest() == _sha(data)


@pytest.mark.parametrize("impl", IMPLS)
def test_many_streams_in_one_multi_call(impl):
    rng = random.Random(5)
    lengths = [0, 1, 63, 64, 65, 1000, 4096, 64 * 1024 + 7] + [rng.randrange(0, 300_000) for _ in range(29)]
    pieces = [_data(n, seed=10 + i) for i, n in enumerate(lengths)]
    states = [sha256.Sha256(impl=impl) for _ in lengths]
    for h, head in zip(states[::3], pieces):                  # some streams start with a partial block pending
        h.update(head[:17])
    sha256.sha256_multi(states, pieces, impl=impl)
    seconds = [_data(rng.randrange(0, 70_000), seed=100 + i) for i in range(len(lengths))]
    sha256.sha256_multi(states, seconds, impl=impl)           # a second call continues every stream
    for i, h in enumerate(states):
        head = pieces[i // 3][:17] if i % 3 == 0 and i // 3 < len(pieces) else b""
        assert h.hexdigest() == _sha(head + pieces[i] + seconds[i]), i
    with pytest.raises(ValueError):
        sha256.sha256_multi(states[:2], pieces[:1])


def test_threads_through_the_shared_lane():
    """Many threads hash at once (pieces big enough for the lane, others below it, some streams one piece long); every
    digest is hashlib's, whichever threads' streams were paired."""
    data = [_data(random.Random(i).randrange(1 << 20, 6 << 20), seed=200 + i) for i in range(8)]
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(data))

    def work(i: int) -> None:
        try:
            rng, h, view, pos = random.Random(i), sha256.Sha256(), memoryview(data[i]), 0
            start.wait()
            while pos < len(view):
                step = len(view) if i == 0 else rng.choice([rng.randrange(1, 8192), rng.randrange(1, 1 << 20)])
                h.update(view[pos:pos + step])
                pos += step
            results[i] = h.hexdigest()
        except BaseException as exc:    # noqa: BLE001 -- reported by the main thread
            errors.append(exc)

    for _ in range(3):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(data))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a hashing thread hangs"
        assert not errors
        assert results == {i: _sha(d) for i, d in enumerate(data)}


def test_file_hasher_gives_hashlib_digests():
    data = _data(fileio.LFS_THRESHOLD + 4097, seed=6)
    size, digest, git = fileio.hash_bytes(data)
    pointer = fileio.lfs_pointer(size, _sha(data))
    assert (size, digest) == (len(data), _sha(data))
    assert git == hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
    small = data[:5000]
    assert fileio.hash_bytes(small) == (5000, _sha(small), hashlib.sha1(b"blob 5000\0" + small).hexdigest())


# ---------------------------------------------------------------- choosing the implementation

def _run_python(code: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KTCONVERT_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=60).stdout.strip()


_PROBE = ("from ktconvert.native import sha256\n"
          "print(sha256.implementation(), type(sha256.new()).__module__, sha256.new(b'abc').hexdigest())\n")
_ABC = VECTORS[0][1]


def test_default_is_sha_ni_where_the_cpu_has_it():
    if os.environ.get("KTCONVERT_DISABLE_CPU_FEATURES") or os.environ.get("KTCONVERT_FORCE_IMPL"):
        pytest.skip("the child runs without this process's KTCONVERT_* settings")
    expected = "sha-ni ktconvert.native.sha256" if "sha-ni" in IMPLS else "portable _hashlib"
    assert _run_python(_PROBE) == f"{expected} {_ABC}"


@pytest.mark.parametrize("env", [{"KTCONVERT_FORCE_IMPL": "scalar"}, {"KTCONVERT_DISABLE_CPU_FEATURES": "sha"}])
def test_forced_portable(env):
    """The portable C is what the scalar implementation runs; files are then hashed by hashlib (OpenSSL's vector code
    is faster than portable C)."""
    assert _run_python(_PROBE, **env) == f"portable _hashlib {_ABC}"


def test_unsupported_or_unknown_impl_raises():
    from ktconvert.errors import NativeError

    with pytest.raises(NativeError):
        sha256.Sha256(impl="sse9")
    if "sha-ni" not in IMPLS:
        with pytest.raises(NativeError):
            sha256.Sha256(impl="sha-ni")
    code = ("from ktconvert.native import sha256\n"
            "try:\n    sha256.Sha256(impl='sha-ni')\nexcept Exception as exc:\n    print(type(exc).__name__)\n")
    assert _run_python(code, KTCONVERT_DISABLE_CPU_FEATURES="sha") == "NativeError"


# ---------------------------------------------------------------- the hash lane of files written side by side

def _write_files(tmp_path, sizes, rng, ordered_hash, threads=4, skip_last_of=None):
    """Files of `sizes`, each with an OrderedFileHash, written by `threads` threads in a random order of pieces of
    random sizes (pwrite, then wrote; the last piece of file `skip_last_of` never); returns (hashes, contents, fds,
    pieces)."""
    from concurrent.futures import ThreadPoolExecutor

    contents, fds, hashes, pieces = [], [], [], []
    for i, size in enumerate(sizes):
        contents.append(_data(size, seed=300 + i))
        fd = os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, size)
        fds.append(fd)
        hashes.append(ordered_hash.OrderedFileHash(fd, size))
        pos = 0
        while pos < size:
            step = min(size - pos, rng.randrange(1, 400_000))
            pieces.append((i, pos, step))
            pos += step
    if skip_last_of is not None:
        pieces.remove(max(p for p in pieces if p[0] == skip_last_of))
    rng.shuffle(pieces)
    pieces.sort(key=lambda p: (p[1] > 0 and rng.random() < 0.7, rng.random()))   # mostly in order, some ahead

    def put(piece):
        i, pos, step = piece
        view = memoryview(contents[i])[pos:pos + step]
        os.pwrite(fds[i], view, pos)
        hashes[i].wrote(pos, view)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, pieces))
    return hashes, contents, fds, pieces


@pytest.fixture
def small_lane(monkeypatch):
    from ktconvert.formats import ordered_hash

    monkeypatch.setattr(ordered_hash, "LANE_MIN_BYTES", 0)
    monkeypatch.setattr(ordered_hash, "LANE_BATCH", 300_001)
    monkeypatch.setattr(ordered_hash, "LANE_PAIR_MIN", 100_000)
    monkeypatch.setattr(ordered_hash, "LANE_SOLO_LAG", 1_000_000)
    monkeypatch.setattr(ordered_hash, "LANE_THREADS", 2)
    monkeypatch.setattr(ordered_hash, "LANE_CHUNK", 100_003)     # steps that start inside a page and a block
    return ordered_hash


def test_lane_hashes_files_written_side_by_side(tmp_path, small_lane):
    """Files written at once go through the lane where SHA-NI runs (every byte hashed from the page cache, none
    copied or read back), else as written; the digests are hashlib's either way, whichever thread asks for them."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    gc.collect()                                   # files of other tests left open count as open files
    for trial in range(3):
        sizes = [0, 1, 5_000_000, 2_000_003, 3_333_333, 4_100_000][trial % 2:]
        hashes, contents, fds, _ = _write_files(tmp_path, sizes, random.Random(trial), small_lane)
        with ThreadPoolExecutor(len(hashes)) as pool:                # all finishing at once
            digests = list(pool.map(lambda h: h.hexdigests(), hashes))
        for h, data, fd, got in zip(hashes, contents, fds, digests):
            assert got == fileio.hash_bytes(data)[1:]
            assert h.hexdigests()[0] == _sha(data)
            if sha256.runs_sha_ni() and len(data) > 1:
                assert (h.lane_bytes, h.read_back) == (len(data), 0)
            os.close(fd)
    alone = _write_files(tmp_path, [3_000_000], random.Random(9), small_lane)
    assert alone[0][0].hexdigests()[0] == _sha(alone[1][0]) and alone[0][0].lane_bytes == 0
    os.close(alone[2][0])


def test_lane_takes_over_a_file_hashed_as_written(tmp_path, small_lane):
    """A file hashed as written (pieces parked as copies) joins the lane when a second file opens."""
    first = _data(2_000_000, seed=400)
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, len(first))
    h = small_lane.OrderedFileHash(fd, len(first))
    for pos in (0, 1_000_000, 300_000):                        # in order, ahead (parked), in order
        end = {0: 300_000, 1_000_000: 2_000_000, 300_000: 1_000_000}[pos]
        os.pwrite(fd, first[pos:end], pos)
        h.wrote(pos, memoryview(first)[pos:end])
        if pos == 0:
            other = _write_files(tmp_path, [1_500_000], random.Random(1), small_lane, threads=2)
    assert h.hexdigests()[0] == _sha(first)
    assert h.lane_bytes == (len(first) - 300_000 if sha256.runs_sha_ni() else 0)    # the lane took over at 300_000
    assert other[0][0].hexdigests()[0] == _sha(other[1][0])
    os.close(fd)
    os.close(other[2][0])


def test_lane_reports_a_gap_without_hanging(tmp_path, small_lane):
    from ktconvert.errors import OutputError

    hashes, contents, fds, _ = _write_files(tmp_path, [1_000_000, 2_000_000], random.Random(3), small_lane,
                                            skip_last_of=1)
    assert hashes[0].hexdigests()[0] == _sha(contents[0])
    with pytest.raises(OutputError, match="never written"):
        hashes[1].hexdigests()
    for fd in fds:
        os.close(fd)


def test_lane_lets_go_of_abandoned_files(tmp_path, small_lane):
    """A writer dropped before its file is complete (an aborted conversion) leaves nothing in the lane: its file is
    dropped and the lane's own descriptor of it closed (the disk space of the removed temporary is freed)."""
    import gc

    hashes, _, fds, _ = _write_files(tmp_path, [1_000_000, 2_000_000], random.Random(4), small_lane,
                                     skip_last_of=1)
    lanes = [h._lane for h in hashes if h._lane is not None]
    assert len(lanes) == (2 if sha256.runs_sha_ni() else 0)
    assert hashes[0].hexdigests()[0] == _sha(_data(1_000_000, seed=300))
    del hashes
    gc.collect()
    for lane_file in lanes:
        assert lane_file not in small_lane._LANE._files
        assert not lane_file.close_fd.alive                     # its os.close ran
    for fd in fds:
        os.close(fd)


def test_write_only_file_stays_out_of_the_lane(tmp_path, small_lane):
    """A file open write-only cannot be mapped: it is hashed as written, even beside files in the lane."""
    data = _data(600_000, seed=500)
    fd = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, len(data))
    h = small_lane.OrderedFileHash(fd, len(data))
    others = _write_files(tmp_path, [700_000, 800_000], random.Random(6), small_lane)
    for pos in range(0, len(data), 70_000):
        os.pwrite(fd, data[pos:pos + 70_000], pos)
        h.wrote(pos, memoryview(data)[pos:pos + 70_000])
    assert h.hexdigests()[0] == _sha(data) and h.lane_bytes == 0 and h._lane is None
    for other, content in zip(others[0], others[1]):
        assert other.hexdigests()[0] == _sha(content)
    for fd_ in [fd, *others[2]]:
        os.close(fd_)


def test_lane_reads_back_where_the_file_cannot_be_mapped(tmp_path, small_lane, monkeypatch):
    """On a filesystem whose files cannot be mapped (mmap raises), the lane reads the written bytes back instead:
    the digests are hashlib's."""
    import mmap

    def refuse(*_args, **_kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    hashes, contents, fds, _ = _write_files(tmp_path, [1_200_000, 2_300_001], random.Random(7), small_lane)
    for h, data, fd in zip(hashes, contents, fds):
        assert h.hexdigests()[0] == _sha(data)
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_forked_child_hashes_with_a_lane_of_its_own(tmp_path, small_lane):
    """A child forked after the parent's lane threads started (multiprocessing's default on Linux) does not wait on
    threads it does not have: its files written side by side get hashlib's digests."""
    warm = _write_files(tmp_path, [1_000_000, 1_100_000], random.Random(8), small_lane)
    for h, fd in zip(warm[0], warm[2]):
        h.hexdigests()
        os.close(fd)
    child_dir = tmp_path / "child"
    child_dir.mkdir()
    pid = os.fork()
    if pid == 0:                                   # the child: exit status 0 only when every digest is right
        ok = False
        try:
            hashes, contents, fds, _ = _write_files(child_dir, [1_000_000, 1_300_000], random.Random(9),
                                                    small_lane, threads=2)
            ok = all(h.hexdigests()[0] == _sha(data) for h, data in zip(hashes, contents))
        finally:
            os._exit(0 if ok else 1)
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung hashing its files")


def test_env_names_what_hashes_output_files():
    """`ktconvert env` says which hasher output files get here: the native one exactly where SHA-NI runs."""
    from ktconvert.util.envinfo import env_info

    has_sha_ni = "sha_ni" in open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else None
    got = env_info()["file_sha256"]
    assert got == ("native sha-ni, two streams per core" if sha256.runs_sha_ni() else "hashlib")
    forced = any(os.environ.get(k) for k in ("KTCONVERT_DISABLE_CPU_FEATURES", "KTCONVERT_FORCE_IMPL",
                                              "KTCONVERT_NO_NATIVE"))
    if has_sha_ni is not None and sha256.available() and not forced:
        assert sha256.runs_sha_ni() == has_sha_ni

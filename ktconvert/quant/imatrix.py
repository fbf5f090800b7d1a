"""llama.cpp importance matrices (``llama-imatrix`` output, ``llama-quantize --imatrix FILE``): reading both file
formats into the per-column values llama-quantize hands its quantizers, and the slice of one expert.

* GGUF (what llama-imatrix writes by default): per weight tensor NAME an F32 ``NAME.in_sum2`` [n_mat, n_per_row]
  (sums of squared activations) and an F32 ``NAME.counts`` [n_mat, 1]; keys ``imatrix.datasets``,
  ``imatrix.chunk_count``, ``imatrix.chunk_size`` (llama-quantize refuses a GGUF imatrix without all three). Values:
  ``in_sum2 / count`` per matrix, count = lround(counts) as float32; 1 for a matrix with count 0 (an expert no
  token reached).
* legacy ``.dat``: int32 entry count; per entry int32 name length, the name, int32 ncall, int32 value count, float32
  values; optionally int32 chunk count, int32 length and the dataset name. Values: ``values / ncall`` (as is when
  ncall <= 0).

(llama.cpp common/imatrix-loader.cpp and tools/quantize/quantize.cpp load_imatrix.) Entries are named as the GGUF
tensors they weigh, ``blk.L.ffn_{gate,up,down}_exps.weight`` for the routed experts: one value per column per
expert, [n_expert * n_per_row], expert e's slice ``[e * n_per_row, (e + 1) * n_per_row)`` (llama-quant.cpp: the
imatrix must hold ne[0] * ne[2] values; each expert's rows use their own slice). The file is read with gguf-py
(GGUF) or numpy (legacy); every problem is a UsageError naming the file (and the tensor), so the command line
exits 2 before anything is written. ``--calibration`` computes such a GGUF file itself (``gptq.imatrix``), read
back here like any other.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from ktconvert.errors import UsageError

GGUF_MAGIC = b"GGUF"
KEYS = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
SUM2, COUNTS = ".in_sum2", ".counts"
IMATRIX_NAME = "calibration.imatrix"   # the matrix `--calibration` computes, in OUT (ktconvert.gptq.imatrix)


@dataclass
class Imatrix:
    """An importance matrix as llama-quantize uses it. ``sums`` {tensor name: float32 [n_mat, n] (memory-mapped for
    a GGUF file)} and ``counts`` {name: float32 [n_mat]}, the divisor of each row, 0 for "use 1"; a value is
    ``sums / counts`` (``values``, ``expert``): derived per tensor when asked, so a large file costs no memory."""

    path: str
    sha256: str
    format: str                                   # "gguf" or "legacy"
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0

    def values(self, name: str) -> np.ndarray:
        """float32 [n_mat * n]: llama-quantize's values of entry `name`."""
        return _divide(self.sums[name], self.counts[name]).reshape(-1)

    def check(self, tensors: dict[str, tuple[int, int]]) -> None:
        """UsageError naming the file and the first tensor of `tensors` ({name: (n_expert, n_per_row)}) that has no
        entry or one of another size. (llama-quantize quantizes a tensor it finds no entry for without one; a
        partial matrix here is refused: an output would mix calibrated and uncalibrated experts unnoticed.)"""
        for name, (n_expert, n_per_row) in tensors.items():
            sums = self.sums.get(name)
            if sums is None:
                raise UsageError("no importance matrix entry for the tensor", file=self.path, tensor=name,
                                 expected=f"{n_expert} x {n_per_row} values (an imatrix of this model)",
                                 found="none")
            if sums.size != n_expert * n_per_row:
                raise UsageError("importance matrix entry has the wrong size", file=self.path, tensor=name,
                                 expected=f"{n_expert} x {n_per_row} = {n_expert * n_per_row} values",
                                 found=f"{sums.size}")

    def expert(self, name: str, expert: int, n_per_row: int) -> np.ndarray:
        """float32 [n_per_row]: expert `expert`'s importances for the columns of tensor `name` (the values
        [expert * n_per_row, (expert + 1) * n_per_row); check() first)."""
        sums, counts = self.sums[name], self.counts[name]
        per_count = sums.size // counts.size
        start = expert * n_per_row
        row = start // per_count
        if start % per_count + n_per_row <= per_count:     # within one count's row: divide only the slice
            flat = sums.reshape(counts.size, per_count)[row, start % per_count:start % per_count + n_per_row]
            return _divide(flat[None, :], counts[row:row + 1]).reshape(-1)
        return self.values(name)[start:start + n_per_row]


def _divide(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """sums [n_mat, n] / counts [n_mat] in float32 (C's float division), 1 where the count is 0."""
    rows = np.asarray(sums, dtype=np.float32).reshape(counts.size, -1)
    c = counts.astype(np.float32)[:, None]
    return np.where(c > 0, rows / np.where(c > 0, c, np.float32(1)), np.float32(1)).astype(np.float32)


def load(path) -> Imatrix:
    """The importance matrix in `path` (GGUF or legacy .dat, told by the magic), values as llama-quantize derives
    them; UsageError naming the file for anything it cannot use (as llama-quantize, a non-finite value too). Read
    once per file version (options are resolved more than once per run)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        raise UsageError(f"cannot read the importance matrix ({exc.strerror})", file=str(path)) from None
    return _load(str(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int) -> Imatrix:
    sha = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            f.seek(0)
            for block in iter(lambda: f.read(1 << 24), b""):
                sha.update(block)
    except OSError as exc:
        raise UsageError(f"cannot read the importance matrix ({exc.strerror})", file=path) from None
    if magic == GGUF_MAGIC:
        imx = Imatrix(path, sha.hexdigest(), "gguf")
        _read_gguf(Path(path), imx)
    else:
        imx = Imatrix(path, sha.hexdigest(), "legacy")
        _read_legacy(Path(path).read_bytes(), imx)
    for name, sums in imx.sums.items():
        if not np.isfinite(sums).all() or not np.isfinite(imx.counts[name]).all():
            raise UsageError("non-finite value in the importance matrix", file=path, tensor=name,
                             expected="finite values")
    return imx


def _read_gguf(path: Path, imx: Imatrix) -> None:
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:     # gguf-py raises ValueError / struct errors of several kinds for a broken file
        raise UsageError(f"not a readable GGUF importance matrix ({exc})", file=str(path)) from None
    missing = [k for k in KEYS if reader.get_field(k) is None]
    if missing:
        raise UsageError("GGUF importance matrix without its metadata", file=str(path),
                         expected=", ".join(KEYS) + " (a llama-imatrix file)", found="no " + ", ".join(missing))
    datasets = reader.get_field(KEYS[0])
    imx.datasets = [bytes(datasets.parts[i]).decode("utf-8", "replace") for i in datasets.data]
    imx.chunk_count = int(reader.get_field(KEYS[1]).contents())
    pairs: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        for suffix in (SUM2, COUNTS):
            if t.name.endswith(suffix):
                pairs.setdefault(t.name[:-len(suffix)], {})[suffix] = t
    if not pairs:
        raise UsageError("GGUF importance matrix holds no entries", file=str(path),
                         expected="NAME.in_sum2 and NAME.counts tensors")
    for name, pair in sorted(pairs.items()):
        if len(pair) != 2:
            raise UsageError("importance matrix entry without its sums or counts", file=str(path), tensor=name,
                             expected=f"{name}{SUM2} and {name}{COUNTS}")
        sums_t, counts_t = pair[SUM2], pair[COUNTS]
        if sums_t.tensor_type != GGMLQuantizationType.F32 or counts_t.tensor_type != GGMLQuantizationType.F32:
            raise UsageError("importance matrix sums and counts must be F32", file=str(path), tensor=name,
                             found=f"{sums_t.tensor_type.name}, {counts_t.tensor_type.name}")
        sums = np.asarray(sums_t.data).reshape(-1)           # memory-mapped float32
        counts = np.asarray(counts_t.data, dtype=np.float32).reshape(-1)
        if counts.size == 0 or sums.size % counts.size:
            raise UsageError("importance matrix sums are not a whole number of rows per count", file=str(path),
                             tensor=name, expected=f"a multiple of {counts.size} values", found=str(sums.size))
        # lround (half away from zero) to an integer count, then that integer as a float; <= 0: values 1
        whole = np.sign(counts) * np.floor(np.abs(counts.astype(np.float64)) + 0.5)
        count = whole.astype(np.int64).astype(np.float32)
        imx.sums[name] = sums.reshape(counts.size, -1)
        imx.counts[name] = np.where(count > 0, count, np.float32(0))


def _read_legacy(data: bytes, imx: Imatrix) -> None:
    def fail(what: str, name: str | None = None):
        return UsageError(f"not an importance matrix (GGUF or legacy .dat): {what}", file=imx.path, tensor=name)

    pos = 0

    def take(fmt: str, name: str | None = None):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise fail("file ends early", name)
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise fail(f"entry count {n_entries}")
    for _ in range(n_entries):
        (length,) = take("<i")
        if length < 0 or pos + length > len(data):
            raise fail(f"name length {length}")
        name = data[pos:pos + length].split(b"\0", 1)[0].decode("utf-8", "replace")
        pos += length
        ncall, nval = take("<ii", name)
        if nval < 1:
            raise fail(f"value count {nval}", name)
        if pos + 4 * nval > len(data):
            raise fail("file ends early", name)
        sums = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        imx.sums[name] = sums.reshape(1, -1)
        imx.counts[name] = np.array([ncall if ncall > 0 else 1], dtype=np.float32)   # <= 0: the sums as they are
    if pos + 4 <= len(data):
        (imx.chunk_count,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            if 0 < length <= len(data) - pos:
                imx.datasets = [data[pos:pos + length].decode("utf-8", "replace")]

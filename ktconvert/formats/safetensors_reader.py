"""Lazy, strict reader of HF safetensors checkpoints: headers parsed by hand, tensors read by byte range.

Why not `safetensors.safe_open`: its numpy framework has no BF16/F8 dtypes, and it does not expose file ranges
(style.md §2.1). Every header is validated before any tensor byte is read, at least as strictly as safetensors
itself: unique names, string metadata values, tensors that tile the data area exactly (the first at offset 0, no
gap, no overlap, no trailing byte). A read allocates exactly the tensor (or the one slice) it returns and holds no
map of the file afterwards. Only regular files are opened (safe_read); index entries must be plain relative names
inside the checkpoint (a shard may itself be a symlink, as in HF's cache); all JSON is bounded in size and depth.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.base import TensorRef
from ktconvert.layouts.naming import INDEX_NAME
from ktconvert.util.safe_read import check_regular, open_regular, parse_json, read_json, unsafe_name

SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
# tensors in one file: Kimi-K2's ~210k (int4 pack-quantized: packed, scale and shape per expert matrix) in a single
# file still fit; parsing costs ~20-40 us and ~1 KB per entry (10^6 entries: ~40 s, 1.1 GB), so more is refused
MAX_TENSORS = 1 << 18
_PREAD_CHUNK = 1 << 30  # Linux returns at most ~2 GiB per read call

# safetensors dtype name -> (bytes per element, numpy dtype the raw bits are returned as)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "|b1"),
    "U8": (1, "|u1"),
    "I8": (1, "|i1"),
    "F8_E4M3": (1, "|u1"),
    "F8_E5M2": (1, "|u1"),
    "F8_E8M0": (1, "|u1"),
    "U16": (2, "<u2"),
    "I16": (2, "<i2"),
    "F16": (2, "<f2"),
    "BF16": (2, "<u2"),
    "U32": (4, "<u4"),
    "I32": (4, "<i4"),
    "F32": (4, "<f4"),
    "U64": (8, "<u8"),
    "I64": (8, "<i8"),
    "F64": (8, "<f8"),
}


@dataclass
class ShardHeader:
    """One parsed .safetensors file: its tensors (absolute offsets), __metadata__ and header size in bytes."""

    path: Path
    tensors: dict[str, TensorRef]
    metadata: dict
    header_bytes: int  # 8 + JSON length
    file_bytes: int


def _bad(path: Path, msg: str, tensor: str | None = None, **kw) -> InputError:
    return InputError(msg, file=path.name, tensor=tensor, **kw)


def _read_header_json(path: Path, read, size: int) -> tuple[dict, int]:
    """Return (parsed JSON header, header length n) of a shard of `size` bytes; read(offset, count) -> bytes."""
    if size < 8:
        raise _bad(path, "not a safetensors file: shorter than the 8-byte header length", found=f"{size} bytes")
    head = read(0, min(size, 1 << 16))
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise _bad(path, "safetensors header truncated or unreadable",
                   expected=f"8 + {n} header bytes within the file", found=f"file of {size} bytes")
    raw = head[8:8 + n] if 8 + n <= len(head) else read(8, n)
    objects = raw.count(b"{")      # every tensor entry is one JSON object: counted before anything is parsed
    if objects > MAX_TENSORS + 2:  # + the header itself and __metadata__
        raise _too_many(path, f"{objects - 1} entries (JSON objects) in a header of {n} bytes")
    header = parse_json(raw, what="safetensors header", file=path.name, max_bytes=MAX_HEADER_BYTES,
                        object_pairs_hook=_unique_keys)
    if not isinstance(header, dict):
        raise _bad(path, "safetensors header is not a JSON object", found=type(header).__name__)
    if len(header) > MAX_TENSORS + 1:
        raise _too_many(path, f"{len(header)} entries")
    if isinstance(header.get(_DUPLICATE), str):
        raise _bad(path, "tensor name appears twice in the header", header[_DUPLICATE])
    return header, n


def _too_many(path: Path, found: str) -> InputError:
    return _bad(path, "safetensors header lists more tensors than ktconvert reads from one file",
                expected=f"at most {MAX_TENSORS} tensors", found=found, hint="split the checkpoint into shards")


_DUPLICATE = "\0duplicate"   # key under which _unique_keys reports a repeated name (NUL: no tensor is called that)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a dict, with the first repeated key recorded under _DUPLICATE (safetensors refuses
    repeated fields; a repeated tensor name would silently keep only the last entry)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        out[_DUPLICATE] = next(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def _tensor_ref(path: Path, name: str, entry, data_start: int, data_len: int) -> TensorRef:
    """Validate one header entry ({dtype, shape, data_offsets}) and return its TensorRef (absolute offset).

    Written as plain loops: a DeepSeek-V3 checkpoint has ~90k entries, all checked on every open."""
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError):
        raise _bad(path, "header entry lacks dtype/shape/data_offsets", name, found=repr(entry)[:80]) from None
    spec = DTYPES.get(dtype) if type(dtype) is str else None
    if spec is None:
        raise _bad(path, "unsupported dtype", name, expected="one of " + ", ".join(DTYPES), found=repr(dtype))
    nbytes = spec[0]
    if type(shape) is not list:
        raise _bad(path, "bad shape", name, expected="list of non-negative ints", found=repr(shape))
    for d in shape:
        if type(d) is not int or d < 0:
            raise _bad(path, "bad shape", name, expected="list of non-negative ints", found=repr(shape))
        nbytes *= d
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, "bad data_offsets", name, expected="[begin, end] with 0 <= begin <= end",
                   found=repr(offsets))
    begin, end = offsets
    if end - begin != nbytes:
        raise _bad(path, "data_offsets span does not match shape x dtype size", name,
                   expected=f"{nbytes} bytes for {dtype} {list(shape)}", found=f"{end - begin} bytes")
    if end > data_len:
        raise _bad(path, "tensor data lies past the end of the file (truncated?)", name,
                   expected=f"data end {data_start + end}", found=f"file of {data_start + data_len} bytes")
    return TensorRef(file=path, name=name, dtype=dtype, shape=tuple(shape), offset=data_start + begin, nbytes=nbytes)


def _check_tiling(path: Path, refs: list[TensorRef], data_start: int, data_len: int) -> None:
    """Tensors in (begin, end) order must cover the data area exactly, as safetensors requires: the first at 0,
    each where the previous one ends (no gap, no overlap), the last at the end of the file."""
    end = data_start
    for ref in sorted(refs, key=lambda r: (r.offset, r.nbytes)):
        if ref.offset != end:
            what = "tensor data overlaps the previous tensor" if ref.offset < end else (
                "gap before the first tensor" if end == data_start else "gap between tensors")
            raise _bad(path, what, ref.name, expected=f"data offset {end - data_start}",
                       found=str(ref.offset - data_start))
        end = ref.offset + ref.nbytes
    if end != data_start + data_len:
        raise _bad(path, "bytes after the last tensor (trailing data not described by the header)",
                   expected=f"file of {end} bytes", found=f"{data_start + data_len} bytes")


def parse_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and validate one .safetensors header strictly; reads only the header bytes."""
    path = Path(path)
    fd = open_regular(path, f"shard {path.name}")
    try:
        size = os.fstat(fd).st_size
        header, n = _read_header_json(path, lambda offset, count: os.pread(fd, count, offset), size)
    finally:
        os.close(fd)
    return _shard_header(path, header, n, size)


def parse_remote_header(path: str | os.PathLike, head: bytes, size: int) -> ShardHeader:
    """The ShardHeader of a shard not on disk (yet) at `path`, as strictly as parse_header: `head` its first bytes
    (the 8-byte length and the JSON header at least), `size` the whole file's bytes."""
    path = Path(path)

    def read(offset: int, count: int) -> bytes:
        if offset + count > len(head):
            raise _bad(path, "remote safetensors header shorter than its length field",
                       expected=f"{offset + count} bytes", found=f"{len(head)}")
        return head[offset:offset + count]

    header, n = _read_header_json(path, read, size)
    return _shard_header(path, header, n, size)


def _shard_header(path: Path, header: dict, n: int, size: int) -> ShardHeader:
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _bad(path, "__metadata__ is not a JSON object", found=type(metadata).__name__)
    bad = next((k for k, v in metadata.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise _bad(path, f"__metadata__ value of {bad!r} is not a string", found=repr(metadata[bad])[:60])
    data_start = 8 + n
    refs = {name: _tensor_ref(path, name, entry, data_start, size - data_start) for name, entry in header.items()}
    _check_tiling(path, list(refs.values()), data_start, size - data_start)
    return ShardHeader(path=path, tensors=refs, metadata=metadata, header_bytes=data_start, file_bytes=size)


def _load_json(path: Path, what: str) -> dict:
    value = read_json(path, what=what)
    if not isinstance(value, dict):
        raise _bad(path, f"{what} is not a JSON object", found=type(value).__name__)
    return value


def _index_weight_map(index_path: Path) -> dict[str, str]:
    """The index's weight_map; every shard name a plain relative name (no absolute path, "..", backslash, ...)."""
    weight_map = _load_json(index_path, "index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _bad(index_path, "index has no weight_map of tensor name -> shard file name")
    for tensor, shard in weight_map.items():
        reason = unsafe_name(shard)
        if reason:
            raise _bad(index_path, f"index names a shard outside the checkpoint ({reason})", tensor,
                       expected="a file name relative to the checkpoint folder", found=repr(shard))
    return weight_map


def _exists(path: Path) -> bool:
    """True if `path` names anything (a dangling symlink included); what it is, the reader checks on opening."""
    return os.path.lexists(path)


def _shard_files(root: Path, remote=None) -> tuple[list[Path], Path | None, dict[str, str] | None]:
    """(shard paths in order, index path or None, weight_map or None) for a directory or a single file; a shard
    missing on disk is allowed where `remote` (see Checkpoint.open) has its header."""
    if not root.is_dir():
        check_regular(root, "checkpoint file")
        return [root], None, None
    index_path = root / INDEX_NAME
    if _exists(index_path):
        weight_map = _index_weight_map(index_path)
        names = sorted(set(weight_map.values()))
        missing = [s for s in names if not _exists(root / s) and s not in getattr(remote, "headers", {})]
        if missing:
            tensor = min(t for t, s in weight_map.items() if s == missing[0])
            raise _bad(index_path, f"index names a missing shard {missing[0]}", tensor,
                       found=f"{len(missing)} missing: {', '.join(missing[:3])}")
        return [root / s for s in names], index_path, weight_map
    if _exists(root / SINGLE_NAME):
        return [root / SINGLE_NAME], None, None
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise _bad(root, "no .safetensors files and no " + INDEX_NAME)
    return shards, None, None


@dataclass
class Checkpoint:
    """An HF checkpoint with every header parsed and validated; no tensor data read.

    tensors: name -> TensorRef (absolute byte offsets); shards: one ShardHeader per file, in index order;
    config: config.json as a dict ({} when absent); root: the directory (or the single file's directory).
    """

    root: Path
    config: dict
    tensors: dict[str, TensorRef]
    shards: list[ShardHeader]
    index_file: Path | None = None
    config_file: Path | None = None
    extra: dict = field(default_factory=dict)
    remote: object = None     # the shards not on disk yet (see open)

    @classmethod
    def open(cls, path: str | os.PathLike, remote=None) -> "Checkpoint":
        """Open a checkpoint directory (model.safetensors, or shards + index) or one .safetensors file.

        remote: shards the index names that are not on disk yet (a hub source downloaded in part:
        ops.hub_shards.RemoteShards): ``remote.headers`` {shard name: (its first bytes, its size)} stands for
        their headers, and ``remote.fetch(name)`` downloads one into place before a tensor of it is read."""
        path = Path(path)
        if not path.exists():
            raise InputError("checkpoint not found", file=str(path))
        files, index_path, weight_map = _shard_files(path, remote)
        heads = getattr(remote, "headers", {})
        shards = [parse_remote_header(f, *heads[_rel(f, path)]) if not _exists(f) and _rel(f, path) in heads
                  else parse_header(f) for f in files]
        tensors = _merge_shards(shards)
        if weight_map is not None:
            by_name = {s.path.relative_to(path).as_posix(): s for s in shards}
            _check_index_against_shards(index_path, weight_map, tensors, by_name)
        root = path if path.is_dir() else path.parent
        config_file = root / "config.json"
        has_config = _exists(config_file)
        config = _load_json(config_file, "config.json") if has_config else {}
        return cls(root=root, config=config, tensors=tensors, shards=shards, index_file=index_path,
                   config_file=config_file if has_config else None, remote=remote)

    def files(self) -> list[Path]:
        """Shard paths, index order."""
        return [s.path for s in self.shards]

    def ref(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            raise InputError("tensor not in checkpoint", file=self.root.name, tensor=name) from None

    def ensure_local(self, files) -> None:
        """Download those of `files` (shard paths) that are remote shards not on disk yet."""
        for path in files:
            if self.remote is not None and not _exists(path) and _rel(path, self.root) in self.remote.headers:
                self.remote.fetch(_rel(path, self.root))

    def read(self, name: str) -> np.ndarray:
        """The whole tensor `name` with its shape; raw bits for BF16 (uint16) and F8 (uint8) types."""
        ref = self.ref(name)
        self.ensure_local([ref.file])
        return _pread_array(ref, ref.offset, ref.nbytes, ref.shape)

    def read_slice(self, name: str, index0: int) -> np.ndarray:
        """Slice [index0] along dim 0 of a >= 2-D tensor (one expert of a fused [E, ...] tensor); reads only it."""
        ref = self.ref(name)
        if len(ref.shape) < 2 or not 0 <= index0 < ref.shape[0]:
            raise InputError("bad slice of tensor", file=ref.file.name, tensor=name,
                             expected=f"index in [0, {ref.shape[0] if ref.shape else 0}) of a >= 2-D tensor",
                             found=f"index {index0} of shape {list(ref.shape)}")
        step = ref.nbytes // ref.shape[0]
        self.ensure_local([ref.file])
        return _pread_array(ref, ref.offset + index0 * step, step, ref.shape[1:])

    read_rows = read_slice  # the name architecture.md uses

    def total_bytes(self) -> int:
        return sum(s.file_bytes for s in self.shards)


def _rel(path: Path, root: Path) -> str:
    """`path` as the index names it: relative to the checkpoint folder `root`, posix."""
    return Path(path).relative_to(root).as_posix() if Path(root).is_dir() else Path(path).name


def _merge_shards(shards: list[ShardHeader]) -> dict[str, TensorRef]:
    tensors: dict[str, TensorRef] = {}
    for shard in shards:
        for name, ref in shard.tensors.items():
            if name in tensors:
                raise _bad(shard.path, f"duplicate tensor name, also in {tensors[name].file.name}", name)
            tensors[name] = ref
    return tensors


def _check_index_against_shards(index_path: Path, weight_map: dict[str, str], tensors: dict[str, TensorRef],
                                by_name: dict[str, ShardHeader]) -> None:
    for name, shard in weight_map.items():
        header = by_name.get(shard)
        if header is None or name not in header.tensors:
            ref = tensors.get(name)
            where = "no shard" if ref is None else ref.file.name
            raise _bad(index_path, f"index maps tensor to {shard}, which lacks it (found in {where})", name)


def _pread_array(ref: TensorRef, offset: int, nbytes: int, shape: tuple[int, ...]) -> np.ndarray:
    """Read nbytes at offset of ref.file straight into a new array of ref's numpy dtype and `shape`. The shard is
    opened as a regular file again (it may have been replaced since its header was checked); InputError naming it
    and the tensor when it is gone, is no longer a regular file, is shorter or cannot be read."""
    out = np.empty(shape, dtype=np.dtype(DTYPES[ref.dtype][1]))
    view = memoryview(out.reshape(-1).view(np.uint8))
    fd = open_regular(ref.file, f"shard {ref.file.name} (changed since its header was read?)")
    try:
        done = 0
        while done < nbytes:
            try:
                got = os.preadv(fd, [view[done:done + _PREAD_CHUNK]], offset + done)
            except OSError as exc:
                raise InputError(f"cannot read ({exc.strerror})", file=ref.file.name, tensor=ref.name) from None
            if got <= 0:
                raise InputError("file shorter than its header says (changed while reading?)",
                                 file=ref.file.name, tensor=ref.name,
                                 expected=f"{nbytes} bytes at {offset}", found=f"{done}")
            done += got
    finally:
        os.close(fd)
    return out

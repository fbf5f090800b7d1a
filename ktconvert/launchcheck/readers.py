"""What ``ktconvert check`` reads of a weights folder, and a count of every byte it reads.

By default only headers: of each ``*.safetensors`` exactly its 8-byte length and its JSON header (validated as
strictly as ``formats.safetensors_reader`` does: a tensor past the end of the file is a truncated file, exit 3),
the small JSON files (config.json, the index, ktconvert.json), a GGUF file's metadata and tensor infos, and
``stat`` of ``.kt`` files (no bytes). ``Reads.data`` reads tensor bytes for ``--deep`` and counts them too.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats import gguf_header
from ktconvert.formats.safetensors_reader import DTYPES, MAX_HEADER_BYTES, ShardHeader, parse_remote_header
from ktconvert.layouts.naming import INDEX_NAME
from ktconvert.util.safe_read import open_regular, read_json, unsafe_name


@dataclass
class Reads:
    """Bytes read so far, by what: {"headers", "json", "data"}."""

    counts: dict = field(default_factory=lambda: {"headers": 0, "json": 0, "data": 0})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def st_header(self, path: Path) -> ShardHeader:
        """The validated header of one .safetensors file, reading 8 + its header length bytes."""
        fd = open_regular(path, f"shard {path.name}")
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0) if size >= 8 else b""
            if len(head) < 8:
                raise InputError("not a safetensors file: shorter than the 8-byte header length", file=path.name,
                                 found=f"{size} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise InputError("safetensors header truncated or unreadable", file=path.name,
                                 expected=f"8 + {n} header bytes within the file", found=f"file of {size} bytes")
            body = os.pread(fd, n, 8)
        finally:
            os.close(fd)
        self.counts["headers"] += 8 + len(body)
        # parse_remote_header looks at up to the first 64 KiB; only the 8 + n header bytes are ever used
        pad = bytes(max(0, min(size, 1 << 16) - 8 - len(body)))
        return parse_remote_header(path, head + body + pad, size)

    def json(self, path: Path, what: str):
        value = read_json(path, what=what)
        self.counts["json"] += path.stat().st_size
        return value

    def gguf(self, path: Path) -> tuple[dict, dict]:
        """(scalar metadata, tensors) of one GGUF file; counts the bytes before its tensor data."""
        meta, tensors = gguf_header.read_header(path)
        start = min((ref.offset for ref in tensors.values()), default=path.stat().st_size)
        self.counts["headers"] += start
        return meta, tensors

    def data(self, path: Path, offset: int, nbytes: int, dtype: str = "U8", shape=None) -> np.ndarray:
        """nbytes at offset of `path` as an array of the safetensors dtype (raw bits for BF16 / F8)."""
        fd = open_regular(path, f"file {path.name}")
        try:
            raw = os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)
        self.counts["data"] += len(raw)
        if len(raw) != nbytes:
            raise InputError("file shorter than its header says (truncated?)", file=path.name,
                             expected=f"{nbytes} bytes at {offset}", found=f"{len(raw)}")
        array = np.frombuffer(raw, dtype=np.dtype(DTYPES[dtype][1]))
        return array if shape is None else array.reshape(shape)


def safetensors_files(root: Path) -> list[Path]:
    """Every ``*.safetensors`` under root, recursively and sorted, as kt-kernel's loaders walk the folder."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".safetensors")]
    return found


def check_index(root: Path, reads: Reads) -> None:
    """A model.safetensors.index.json that names a shard the folder lacks: InputError naming it (exit 3)."""
    index = root / INDEX_NAME
    if not os.path.lexists(index):
        return
    data = reads.json(index, INDEX_NAME)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise InputError("index has no weight_map of tensor name -> shard file name", file=index.name)
    shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
    bad = [s for s in shards if unsafe_name(s)]
    if bad:
        raise InputError("index names a shard outside the folder", file=index.name, found=repr(bad[0]))
    missing = [s for s in shards if not os.path.lexists(root / s)]
    if missing:
        raise InputError(f"index names a missing shard {missing[0]}", file=index.name,
                         found=f"{len(missing)} of {len(shards)} missing: {', '.join(missing[:3])}")

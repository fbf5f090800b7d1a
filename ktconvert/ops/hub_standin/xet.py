"""Reading back files that huggingface_hub uploaded to the hub stand-in through Xet (its default transport).

The stand-in hands the client a `local://DIR` CAS; hf_xet then stores the file contents there as xorbs and
describes each file in MDB shard files (`*.mdb`), while the commit names the file only by sha256 and size. To
hold the bytes, the stand-in finds the file's Xet hash for that sha256 in the shards and lets hf_xet itself
reconstruct the file from (a hard-linked mirror of) the local CAS; the result is kept only when its sha256 is the
one committed.

Shard layout read here (xet-core MDB v2, as hf_xet 1.x writes it; all integers little-endian): a 48-byte header
(32-byte tag starting "HFRepoMetaData", u64 version, u64 footer size), then the file-info section: per file a
48-byte record (32-byte file hash, u32 flags, u32 n entries, 8 unused), n 48-byte segment records (32-byte xorb
hash, u32 flags, u32 unpacked bytes, u32 chunk start, u32 chunk end), n 48-byte verification records when flag bit
31 is set, one 48-byte metadata record (32-byte sha256 + 16 unused) when bit 30 is set; a record whose hash is 32
0xFF bytes ends the section. Hashes are four u64 words; their hex form prints each word big-endian.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from pathlib import Path

_MAGIC = b"HFRepoMetaData"
_RECORD = 48
_WITH_VERIFICATION = 1 << 31
_WITH_METADATA = 1 << 30
_END = b"\xff" * 32


def _hash_hex(raw: bytes) -> str:
    """hex of a 32-byte Xet hash as hf_xet prints it (each of the four u64 words byte-reversed)."""
    return b"".join(raw[i:i + 8][::-1] for i in range(0, 32, 8)).hex()


def shard_files(data: bytes) -> dict[str, tuple[str, int]]:
    """{sha256 hex: (Xet file hash hex, size)} for the files described in one MDB shard ({} if not a shard)."""
    if not data.startswith(_MAGIC) or len(data) < _RECORD:
        return {}
    out, offset = {}, _RECORD
    try:
        while offset + _RECORD <= len(data):
            file_hash = data[offset:offset + 32]
            flags, count = struct.unpack_from("<II", data, offset + 32)
            offset += _RECORD
            if file_hash == _END:
                break
            size = sum(struct.unpack_from("<I", data, offset + i * _RECORD + 36)[0] for i in range(count))
            offset += _RECORD * count * (2 if flags & _WITH_VERIFICATION else 1)
            if flags & _WITH_METADATA and offset + 32 <= len(data):
                out[_hash_hex(data[offset:offset + 32])] = (_hash_hex(file_hash), size)
                offset += _RECORD
    except struct.error:  # a truncated shard: keep what was complete
        pass
    return out


def known_files(cas_dir: Path) -> dict[str, tuple[str, int]]:
    """{sha256: (Xet hash, size)} over every shard under the local CAS folder."""
    found: dict[str, tuple[str, int]] = {}
    for shard in sorted(Path(cas_dir).rglob("*.mdb")):
        found.update(shard_files(shard.read_bytes()))
    return found


def read_back(cas_dir: Path, wanted: dict[str, int], scratch: Path) -> dict[str, Path]:
    """Reconstruct the files {sha256: size} from the local CAS into `scratch`; {sha256: file} for those whose
    bytes hash to their sha256 (missing ones are left out: unknown to the shards, or hf_xet not installed)."""
    try:
        import hf_xet
    except ImportError:
        return {}
    index = known_files(cas_dir)
    jobs = {sha: index[sha] for sha, size in wanted.items() if sha in index and index[sha][1] == size}
    if not jobs:
        return {}
    cas = _mirror(Path(cas_dir), Path(scratch) / "cas")
    targets = {}
    for sha in jobs:
        fd, name = tempfile.mkstemp(dir=scratch, suffix=".xet")
        os.close(fd)
        targets[sha] = Path(name)
    done: dict[str, Path] = {}
    try:
        session = hf_xet.XetSession()
        with session.new_file_download_group(endpoint=f"local://{cas.resolve()}", token="local",
                                             token_expiry_unix_secs=2**40) as group:
            for sha, (xet_hash, size) in jobs.items():
                group.start_download_file(hf_xet.XetFileInfo(xet_hash, size), str(targets[sha]))
        done = {sha: path for sha, path in targets.items()
                if path.stat().st_size == jobs[sha][1] and _sha256(path) == sha}
    finally:
        for sha, path in targets.items():
            if sha not in done:
                path.unlink(missing_ok=True)
    return done


def _mirror(cas_dir: Path, mirror: Path) -> Path:
    """The CAS under `mirror`: its lookup database (redb) copied — the uploading client may still hold the original
    open and locked —, xorbs and shards hard-linked (copied across file systems)."""
    for source in cas_dir.rglob("*"):
        if source.is_file():
            target = mirror / source.relative_to(cas_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                if source.suffix == ".redb":
                    raise OSError("copied")
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
    return mirror


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()

"""zstd tar bundles: deterministic bytes, round trip, streaming verify, refusal of damaged or unsafe bundles."""
from __future__ import annotations

import io
import json
import tarfile

import pytest
import zstandard

from ktconvert.ops.bundle import bundle, unbundle, verify_bundle
from ktconvert.errors import InputError, OutputError, VerifyError
from test_hub import make_out, sample_files


def _zst_tar(path, members: list[tuple[str, bytes]]) -> None:
    """Write a .tar.zst by hand (independent of ktconvert.ops.bundle) from (name, bytes) members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))


def test_round_trip_and_determinism(tmp_path):
    files = sample_files(7)
    make_out(tmp_path / "out", files)
    a = bundle(tmp_path / "out", tmp_path / "a.tar.zst")
    bundle(tmp_path / "out", tmp_path / "b.tar.zst")
    assert (tmp_path / "a.tar.zst").read_bytes() == (tmp_path / "b.tar.zst").read_bytes()
    assert a["files"] == len(files) + 1 and a["bytes_out"] == (tmp_path / "a.tar.zst").stat().st_size
    # independent reader: zstandard + tarfile; manifest first, then sorted paths, fixed metadata
    with open(tmp_path / "a.tar.zst", "rb") as fh:
        raw = zstandard.ZstdDecompressor().stream_reader(fh).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["ktconvert.json"] + sorted(files)
        assert {(m.mtime, m.uid, m.gid, m.mode, m.uname) for m in members} == {(0, 0, 0, 0o644, "")}
        assert tar.extractfile("notes.txt").read() == files["notes.txt"]
    report = verify_bundle(tmp_path / "a.tar.zst")
    assert report["ok"] and report["checked"] == len(files)
    restored = unbundle(tmp_path / "a.tar.zst", tmp_path / "restored")
    assert restored["ok"]
    for rel, data in files.items():
        assert (tmp_path / "restored" / rel).read_bytes() == data
    assert (tmp_path / "restored/ktconvert.json").read_bytes() == (tmp_path / "out/ktconvert.json").read_bytes()


def test_flipped_byte_in_bundle_is_caught(tmp_path):
    make_out(tmp_path / "out", sample_files(8))
    bundle(tmp_path / "out", tmp_path / "x.tar.zst")
    data = bytearray((tmp_path / "x.tar.zst").read_bytes())
    data[len(data) // 2] ^= 0x40
    (tmp_path / "x.tar.zst").write_bytes(bytes(data))
    report = verify_bundle(tmp_path / "x.tar.zst")
    assert not report["ok"] and report["problems"]
    with pytest.raises((VerifyError, InputError)):
        unbundle(tmp_path / "x.tar.zst", tmp_path / "restored")
    assert not (tmp_path / "restored").exists() and not (tmp_path / ".restored.partial").exists()


def test_member_hash_mismatch_missing_and_extra(tmp_path):
    files = sample_files(9)
    make_out(tmp_path / "out", files)
    manifest = (tmp_path / "out/ktconvert.json").read_bytes()
    members = [("ktconvert.json", manifest), ("config.json", files["config.json"]),
               ("notes.txt", b"small text filE\n"), ("zz-extra.bin", b"x")]
    _zst_tar(tmp_path / "bad.tar.zst", members)
    report = verify_bundle(tmp_path / "bad.tar.zst")
    assert report["mismatched"] == ["notes.txt"] and report["extra"] == ["zz-extra.bin"]
    assert report["missing"] == sorted(p for p in files if p.endswith(".kt"))
    assert not report["ok"]


def test_path_traversal_refused(tmp_path):
    manifest = json.dumps({"files": {"../evil": {"bytes": 1}}}).encode()
    _zst_tar(tmp_path / "evil.tar.zst", [("ktconvert.json", manifest), ("../evil", b"x")])
    with pytest.raises(InputError, match="traversal"):
        unbundle(tmp_path / "evil.tar.zst", tmp_path / "dest")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "dest").exists()


def test_bundle_refuses_corrupted_folder_and_unbundle_refuses_nonempty_dest(tmp_path):
    make_out(tmp_path / "out", sample_files(10))
    (tmp_path / "out/notes.txt").write_bytes(b"tampered\n")
    with pytest.raises(VerifyError):
        bundle(tmp_path / "out", tmp_path / "x.tar.zst")
    assert not list(tmp_path.glob("*.tar.zst")) and not list(tmp_path.glob(".*.partial"))
    make_out(tmp_path / "ok", sample_files(11))
    bundle(tmp_path / "ok", tmp_path / "ok.tar.zst")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy/file").write_bytes(b"keep")
    with pytest.raises(OutputError):
        unbundle(tmp_path / "ok.tar.zst", tmp_path / "busy")

"""zstd tar bundles: deterministic bytes, round trip, streaming verify, refusal of damaged or unsafe bundles."""
from __future__ import annotations

import io
import json
import tarfile

import pytest
import zstandard

from ktconvert.ops.bundle import bundle, unbundle, verify_bundle
from ktconvert.errors import OutputError, VerifyError
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
    with pytest.raises(VerifyError):
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
    with pytest.raises(VerifyError, match="traversal"):
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


# ---------------------------------------------------------------- sizes, caps and names (issue 14, items 9 and 15)

def _manifest_for(members: dict[str, bytes], claims: dict[str, int] | None = None) -> bytes:
    """A ktconvert.json whose files table lists `members` with their true hashes (sizes overridable by `claims`)."""
    import hashlib

    files = {}
    for name, data in members.items():
        files[name] = {"bytes": (claims or {}).get(name, len(data)), "sha256": hashlib.sha256(data).hexdigest(),
                       "git_sha1": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    return json.dumps({"format": "ktconvert-manifest", "format_version": 2, "files": files}).encode()


def _zst_tar_stream(path, members: list[tuple[str, int, object]]) -> None:
    """Like _zst_tar, but members are (name, size, fileobj) streamed through zstd: large members cost no memory."""
    with open(path, "wb") as raw:
        with zstandard.ZstdCompressor(level=1).stream_writer(raw, closefd=False) as zst:
            with tarfile.open(fileobj=zst, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for name, size, fobj in members:
                    info = tarfile.TarInfo(name)
                    info.size = size
                    tar.addfile(info, fobj)


class _Zeros(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        buf[:] = bytes(len(buf))
        return len(buf)


def test_member_larger_than_the_manifest_says_is_refused_before_writing(tmp_path):
    """The manifest says big.bin is 6 bytes; the tar member is 64 MiB of zeros. A child process that may write at
    most 1 MiB per file runs unbundle: the refusal must come from the size check, not from the file-size limit."""
    import subprocess
    import sys

    manifest = _manifest_for({"big.bin": b"\0" * 6})
    big = 64 << 20
    _zst_tar_stream(tmp_path / "bomb.tar.zst", [("ktconvert.json", len(manifest), io.BytesIO(manifest)),
                                                ("big.bin", big, io.BufferedReader(_Zeros()))])
    assert (tmp_path / "bomb.tar.zst").stat().st_size < 1 << 20
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
            "from ktconvert.ops.bundle import unbundle\n"
            "from ktconvert.errors import KtConvertError\n"
            "try:\n"
            f"    unbundle({str(tmp_path / 'bomb.tar.zst')!r}, {str(tmp_path / 'dest')!r})\n"
            "except KtConvertError as exc:\n"
            "    print('REFUSED', type(exc).__name__, exc)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.startswith("REFUSED VerifyError"), run.stdout + run.stderr[-2000:]
    assert "big.bin" in run.stdout and "6" in run.stdout and str(big) in run.stdout
    assert not (tmp_path / "dest").exists() and not (tmp_path / ".dest.partial").exists()
    report = verify_bundle(tmp_path / "bomb.tar.zst")
    assert not report["ok"] and report["mismatched"] == ["big.bin"]


def test_manifest_over_the_size_cap_is_refused_unread(tmp_path, monkeypatch):
    import ktconvert.ops.bundle as bundle_mod

    monkeypatch.setattr(bundle_mod, "MAX_MANIFEST_BYTES", 1 << 20)
    manifest = _manifest_for({"a.bin": b"abc"}) + b" " * (2 << 20)      # valid JSON, 2 MiB with padding
    _zst_tar(tmp_path / "fat.tar.zst", [("ktconvert.json", manifest), ("a.bin", b"abc")])
    report = verify_bundle(tmp_path / "fat.tar.zst")
    assert not report["ok"] and "ktconvert.json" in report["problems"][0] and str(1 << 20) in report["problems"][0]
    with pytest.raises(VerifyError):
        unbundle(tmp_path / "fat.tar.zst", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("manifest", [b'{"files": {}}', b'{"files": {"a.bin": {"bytes": 3}}}',
                                      b'{"files": {"a.bin": {"bytes": "3", "sha256": "x"}}}',
                                      b'{"files": {"a.bin": {"bytes": -1, "sha256": "' + b"0" * 64 + b'"}}}',
                                      b'{"files": {"a.bin": []}}', b'{"files": {"": {"bytes": 0}}}'])
def test_manifest_without_a_checkable_file_is_refused(tmp_path, manifest):
    members = [("ktconvert.json", manifest)] + ([("a.bin", b"abc")] if b"a.bin" in manifest else [])
    _zst_tar(tmp_path / "empty.tar.zst", members)
    report = verify_bundle(tmp_path / "empty.tar.zst")
    assert not report["ok"] and "ktconvert.json" in report["problems"][0]
    with pytest.raises(VerifyError):
        unbundle(tmp_path / "empty.tar.zst", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_member_that_is_also_a_folder_is_refused(tmp_path):
    members = {"a": b"file", "a/b": b"inside"}
    manifest = _manifest_for(members)
    _zst_tar(tmp_path / "clash.tar.zst", [("ktconvert.json", manifest)] + list(members.items()))
    with pytest.raises(VerifyError) as err:
        unbundle(tmp_path / "clash.tar.zst", tmp_path / "dest")
    assert "a/b" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "dest").exists() and not (tmp_path / ".dest.partial").exists()


def test_member_name_too_long_is_refused(tmp_path):
    name = "x" * 300
    members = {name: b"long"}
    _zst_tar(tmp_path / "long.tar.zst", [("ktconvert.json", _manifest_for(members))] + list(members.items()))
    with pytest.raises(VerifyError) as err:
        unbundle(tmp_path / "long.tar.zst", tmp_path / "dest")
    assert "255" in str(err.value)
    assert not (tmp_path / "dest").exists()


def test_dest_symlink_is_refused(tmp_path):
    make_out(tmp_path / "out", sample_files(13))
    bundle(tmp_path / "out", tmp_path / "ok.tar.zst")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "dest").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="symlink"):
        unbundle(tmp_path / "ok.tar.zst", tmp_path / "dest")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputError, match="symlink"):
        unbundle(tmp_path / "ok.tar.zst", tmp_path / "dangling")
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "nowhere").exists()


def test_partial_symlink_is_not_followed(tmp_path):
    make_out(tmp_path / "out", sample_files(14))
    bundle(tmp_path / "out", tmp_path / "ok.tar.zst")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"keep")
    (tmp_path / ".dest.partial").symlink_to(elsewhere)
    result = unbundle(tmp_path / "ok.tar.zst", tmp_path / "dest")
    assert result["ok"] and (tmp_path / "dest/notes.txt").exists()
    assert [p.name for p in elsewhere.iterdir()] == ["keep"]       # nothing written through the link


def test_cli_unbundle_errors_are_one_line(tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    members = {"a": b"file", "a/b": b"inside"}
    _zst_tar(tmp_path / "clash.tar.zst", [("ktconvert.json", _manifest_for(members))] + list(members.items()))
    result = CliRunner().invoke(cli, ["unbundle", str(tmp_path / "clash.tar.zst"), str(tmp_path / "dest")])
    assert result.exit_code == 4, result.output       # a fault inside a bundle fails verification (README)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "a/b" in lines[0]


def _cli(*args):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("head", [{"format": "other", "format_version": 2}, {"format_version": 2},
                                  {"format": "ktconvert-manifest", "format_version": 99},
                                  {"format": "ktconvert-manifest", "format_version": True}],
                         ids=["other", "none", "version-99", "version-true"])
def test_bundle_manifest_of_an_unknown_format_fails(tmp_path, head):
    """Before: `"format": "other"` passed verify FILE.tar.zst and unbundle. Inside a bundle it is exit 4."""
    members = {"a.bin": b"abc"}
    manifest = json.dumps({**json.loads(_manifest_for(members)), **head})
    if "format" not in head:
        manifest = json.dumps({k: v for k, v in json.loads(manifest).items() if k != "format"})
    _zst_tar(tmp_path / "other.tar.zst", [("ktconvert.json", manifest.encode())] + list(members.items()))
    report = verify_bundle(tmp_path / "other.tar.zst")
    assert not report["ok"] and "ktconvert.json in bundle is not a ktconvert manifest" in report["problems"][0]
    for args in (("verify", tmp_path / "other.tar.zst"), ("unbundle", tmp_path / "other.tar.zst", tmp_path / "d")):
        result = _cli(*args)
        assert result.exit_code == 4, result.output
        assert "not a ktconvert manifest" in result.output
    assert not (tmp_path / "d").exists()


def test_folder_manifest_of_an_unknown_format(tmp_path):
    """A folder: verify reports it (4); bundle / publish refuse it as bad input (3), as README's table says."""
    make_out(tmp_path / "out", sample_files(21))
    path = tmp_path / "out" / "ktconvert.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": "other"}))
    assert _cli("verify", tmp_path / "out").exit_code == 4
    result = _cli("bundle", tmp_path / "out", tmp_path / "x.tar.zst")
    assert result.exit_code == 3 and "not a ktconvert manifest" in result.output, result.output


def test_manifest_over_the_real_cap_is_refused_unread_in_little_memory(tmp_path):
    """A bundle whose ktconvert.json is valid JSON padded past MAX_MANIFEST_BYTES (256 MiB): refused from the tar
    header's size, nothing of it read (before: a 500 MB manifest under the old 512 MiB cap was accepted at 1.55 GB
    RSS). The child process reports its peak RSS."""
    import subprocess
    import sys

    from ktconvert.util.safe_read import MAX_MANIFEST_BYTES

    head = _manifest_for({"a.bin": b"abc"})
    size = 300_000_000                            # a size the old cap (512 MiB) let through
    assert size > MAX_MANIFEST_BYTES
    padded = _Concat(io.BytesIO(head[:-1]), _Spaces(size - len(head)), io.BytesIO(b"}"))   # spaces before "}"
    _zst_tar_stream(tmp_path / "fat.tar.zst", [("ktconvert.json", size, io.BufferedReader(padded)),
                                               ("a.bin", 3, io.BytesIO(b"abc"))])
    # VmHWM is this process's own peak (ru_maxrss would carry the forking pytest's RSS across the exec)
    code = ("import json\n"
            "from ktconvert.ops.bundle import verify_bundle\n"
            f"report = verify_bundle({str(tmp_path / 'fat.tar.zst')!r})\n"
            "hwm = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
            "print(json.dumps({'problems': report['problems'], 'rss_kb': hwm}))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["problems"] == [f"{tmp_path / 'fat.tar.zst'}: ktconvert.json in bundle is larger than "
                                  f"{MAX_MANIFEST_BYTES} bytes, found {size} bytes"], result
    assert result["rss_kb"] < 400 << 10, result


class _Concat(io.RawIOBase):
    """The bytes of several readers one after the other."""

    def __init__(self, *parts):
        self.parts = list(parts)

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.parts:
            n = self.parts[0].readinto(buf)
            if n:
                return n
            self.parts.pop(0)
        return 0


class _Spaces(io.RawIOBase):
    def __init__(self, size: int):
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self.left)
        buf[:n] = b" " * n
        self.left -= n
        return n


def test_edited_manifest_in_a_bundle_and_bundling_an_edited_folder(tmp_path):
    """The self hash: a bundle whose ktconvert.json was edited fails verify / unbundle (4); bundling a folder
    whose ktconvert.json was edited is refused (4)."""
    make_out(tmp_path / "out", sample_files(22))
    bundle(tmp_path / "out", tmp_path / "ok.tar.zst")
    path = tmp_path / "out" / "ktconvert.json"
    manifest = json.loads(path.read_text())
    manifest["tool_version"] = "9.9.9"
    edited = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    members = [("ktconvert.json", edited)] + [(rel, (tmp_path / "out" / rel).read_bytes())
                                              for rel in sorted(manifest["files"])]
    _zst_tar(tmp_path / "edited.tar.zst", members)
    report = verify_bundle(tmp_path / "edited.tar.zst")
    assert not report["ok"] and "edited after it was written" in report["problems"][0]
    assert _cli("unbundle", tmp_path / "edited.tar.zst", tmp_path / "d").exit_code == 4
    path.write_bytes(edited)
    result = _cli("bundle", tmp_path / "out", tmp_path / "again.tar.zst")
    assert result.exit_code == 4 and "edited after it was written" in result.output, result.output
    assert not (tmp_path / "again.tar.zst").exists()


def test_a_difference_names_the_field_that_differs(tmp_path):
    """A git_sha1 (or size) unlike the file's: the message shows that field, not two equal sha256s (before:
    "expected X, found X")."""
    make_out(tmp_path / "out", sample_files(23))
    path = tmp_path / "out" / "ktconvert.json"
    manifest = json.loads(path.read_text())
    manifest.pop("self_sha256", None)                     # a manifest of an older writer
    manifest["files"]["notes.txt"]["git_sha1"] = "0" * 40
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with pytest.raises(VerifyError) as err:
        bundle(tmp_path / "out", tmp_path / "x.tar.zst")
    assert str(err.value).endswith(f"; expected git_sha1 {'0' * 40}, found git_sha1 "
                                   f"{manifest['files']['notes.txt']['git_sha1'] and _git(b'small text file' + bytes([10]))}")


def _git(data: bytes) -> str:
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

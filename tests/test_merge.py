"""`ktconvert merge` trusts nothing unchecked: a file copied across filesystems is hashed while it is copied and
compared with its part manifest's sha256 (exit 4 on a difference, nothing more read than the copy reads), a
hard-linked one is hashed as it is linked; `merge --verify` also hashes every part file before anything is written
(tests/test_merge_trust.py: every other way a part can lie); a merge interrupted (an exception, or the
process killed) leaves an OUT without ktconvert.json, and running the same merge again finishes it, byte-identical
to a single run. The reference is the single-process conversion (test_parts' `single`) and hashlib over the part
files."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ktconvert.distributed import merge as merge_module

from ktconvert.util import profile
from ktconvert.errors import KtConvertError
from ktconvert.formats.out_manifest import MANIFEST_NAME
from ktconvert.distributed.merge import MERGE_JOURNAL, merge
from ktconvert.distributed.parts import load_part
from test_parts import CPU, run_cli, source, single, tree, write_parts  # noqa: F401  (fixtures)

RANGES = ["1-1", "2-3"]


@pytest.fixture
def parts(source, tmp_path):
    return write_parts(source, tmp_path / "parts", RANGES)


def no_link(src, dst, **kw):
    """os.link between two filesystems."""
    raise OSError(errno.EXDEV, "Invalid cross-device link")


@pytest.fixture
def across_filesystems(monkeypatch):
    """Every part file is copied, as between two filesystems."""
    monkeypatch.setattr(os, "link", no_link)


def interrupt_merge_after(monkeypatch, placed: int) -> None:
    """Ctrl-C in merge once `placed` files are in place (monkeypatch.undo or a new setattr restores _place)."""
    real_place, done = merge_module._place, []

    def failing_place(*args, **kw):
        if len(done) == placed:
            raise KeyboardInterrupt
        done.append(args)
        return real_place(*args, **kw)

    monkeypatch.setattr(merge_module, "_place", failing_place)


def flip_a_byte(path: Path) -> None:
    """Change one byte in the middle of `path`, keeping its size."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def largest_file(part: Path) -> Path:
    files = load_part(part)["manifest"]["files"]
    return part / max(files, key=lambda rel: int(files[rel]["bytes"]))


def test_copy_hashes_while_copying_and_refuses_a_changed_part_file(parts, single, tmp_path, across_filesystems):
    total = sum(int(e["bytes"]) for p in parts for e in load_part(p)["manifest"]["files"].values())
    profile.enable()
    try:
        result = merge(tmp_path / "copied", parts)
    finally:
        report = profile.disable()
    assert tree(tmp_path / "copied") == tree(single)
    assert result.copied == result.files == len(tree(single)) - 1
    assert report["kinds"]["hash.file"]["bytes"] == total        # every copied byte hashed once, no second pass
    bad = largest_file(parts[1])
    flip_a_byte(bad)
    code, out = run_cli("merge", tmp_path / "bad", *parts)
    line = out.strip().splitlines()[-1]
    assert code == 4, out
    assert str(bad) in line and hashlib.sha256(bad.read_bytes()).hexdigest() in line
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
    assert not [p for p in (tmp_path / "bad").rglob("*") if p.name.endswith(".partial")]


def test_verify_hashes_every_part_file_before_writing(parts, single, tmp_path):
    code, out = run_cli("merge", tmp_path / "checked", *parts, "--verify")
    assert code == 0, out
    assert tree(tmp_path / "checked") == tree(single)
    bad = largest_file(parts[0])
    flip_a_byte(bad)
    code, out = run_cli("merge", tmp_path / "linked", *parts)      # a linked file is hashed as it is linked
    line = out.strip().splitlines()[-1]
    assert code == 4 and str(bad) in line and hashlib.sha256(bad.read_bytes()).hexdigest() in line, out
    assert not (tmp_path / "linked" / MANIFEST_NAME).exists()
    assert not (tmp_path / "linked" / bad.relative_to(parts[0])).exists()     # the bad link removed again
    code, out = run_cli("merge", tmp_path / "refused", *parts, "--verify")
    line = out.strip().splitlines()[-1]
    assert code == 4 and str(bad) in line and "sha256" in line, out
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
    code, out = run_cli("merge", "--help")
    assert "--verify" in out and "before anything is written" in out


@pytest.mark.parametrize("copying", [False, True])
def test_merge_interrupted_by_an_exception_finishes_when_run_again(parts, single, tmp_path, monkeypatch, copying):
    if copying:
        monkeypatch.setattr(os, "link", no_link)
    real_place = merge_module._place
    interrupt_merge_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        merge(tmp_path / "out", parts)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists() and (tmp_path / "out" / MERGE_JOURNAL).exists()
    code, out = run_cli("verify", tmp_path / "out")
    assert code != 0
    monkeypatch.setattr(merge_module, "_place", real_place)
    merge(tmp_path / "out", list(reversed(parts)))                # the same merge, parts in another order
    assert tree(tmp_path / "out") == tree(single)
    merge(tmp_path / "out", parts)                                # once more: a finished merge is left as is
    assert tree(tmp_path / "out") == tree(single)


def test_merge_killed_mid_way_finishes_when_run_again(parts, single, tmp_path):
    script = ("import os, signal, sys\n"
              "from ktconvert.distributed.merge import merge\n"
              "real, calls = os.link, []\n"
              "def link(src, dst, **kw):\n"
              "    calls.append(dst)\n"
              "    if len(calls) == 4:\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return real(src, dst, **kw)\n"
              "os.link = link\n"
              "merge(sys.argv[1], sys.argv[2:])\n")
    killed = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out"), *map(str, parts)])
    assert killed.returncode == -9
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    placed = {p.name for p in (tmp_path / "out").rglob("*") if p.is_file()} - {".ktconvert.lock", MERGE_JOURNAL}
    assert len(placed) == 3
    code, out = run_cli("merge", tmp_path / "out", *parts)
    assert code == 0, out
    assert tree(tmp_path / "out") == tree(single)


def test_unfinished_merge_of_other_parts_is_refused(source, parts, tmp_path, monkeypatch):
    other = write_parts(source, tmp_path / "other", RANGES, method="amxint8", numa=2)
    interrupt_merge_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        merge(tmp_path / "out", parts)
    monkeypatch.undo()
    with pytest.raises(KtConvertError, match="unfinished merge of other parts") as info:
        merge(tmp_path / "out", other)
    assert info.value.exit_code == 1 and MERGE_JOURNAL in str(info.value)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("x")
    code, out = run_cli("merge", tmp_path / "plain", *parts)
    assert code == 1 and "not empty" in out
    assert json.loads((tmp_path / "out" / MERGE_JOURNAL).read_text())["format"] == "ktconvert-merge"

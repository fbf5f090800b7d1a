"""`ktconvert merge` trusts nothing it did not check. Each way a part folder can lie that once gave exit 0 and an OUT
failing `verify --hashes` is refused, with one error line: a changed byte, two swapped shards of one size, a part
file that is a symlink, an edited file or tensor sha256 in a part manifest (with and without --verify), a part
manifest naming ktconvert's own files or a name with an empty component, parts of two checkpoints sharing one
config.json, a malformed part manifest; a full disk while copying across filesystems leaves no file under its
final name; a rerun of an interrupted merge does not hash again what it proved, unless that file changed; a Ray
run reusing a tampered finished part in --parts-dir, or parts of the checkpoint SRC held before, is refused. The references are the CLI's exit code and line,
`verify --hashes` and hashlib."""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest

from ktconvert.distributed import merge as merge_module

from ktconvert.util import profile
from ktconvert.formats.out_manifest import MANIFEST_NAME, manifest_bytes
from ktconvert.distributed.merge import MERGE_JOURNAL, merge
from ktconvert.distributed.parts import PART_NAME, load_part
from test_merge import flip_a_byte, interrupt_merge_after, no_link
from test_parts import CPU, MODEL, run_cli, source, single, tree, write_parts  # noqa: F401  (fixtures)

RANGES = ["1-1", "2-3"]


@pytest.fixture
def parts(source, tmp_path):
    return write_parts(source, tmp_path / "parts", RANGES)


def edit_part(part: Path, change) -> None:
    """Rewrite the part manifest of `part` after change(record)."""
    record = json.loads((part / PART_NAME).read_text())
    change(record)
    (part / PART_NAME).write_bytes(manifest_bytes(record))


def refused(tmp_path, *args, code: int, words=()) -> str:
    """Run `merge OUT *args`: assert exit `code`, one `error:` line holding every word, and no ktconvert.json."""
    out = tmp_path / "out"
    exit_code, text = run_cli("merge", out, *args)
    lines = text.strip().splitlines()
    assert exit_code == code, text
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert all(str(word) in lines[0] for word in words), text
    assert not (out / MANIFEST_NAME).exists()
    return lines[0]


def shard(part: Path, index: int = 0) -> Path:
    return part / sorted(n for n in load_part(part)["manifest"]["files"] if n.endswith(".safetensors"))[index]


# ---------------------------------------------------------------------------------------------- the part files

@pytest.mark.parametrize("copying", [False, True])
def test_a_changed_byte_is_refused_linked_or_copied(parts, tmp_path, monkeypatch, copying):
    if copying:
        monkeypatch.setattr(os, "link", no_link)
    bad = shard(parts[0])
    flip_a_byte(bad)
    refused(tmp_path, *parts, code=4, words=[bad, hashlib.sha256(bad.read_bytes()).hexdigest()])
    assert not (tmp_path / "out" / bad.relative_to(parts[0])).exists()        # not left linked, never renamed


def test_two_swapped_shards_of_one_size_are_refused(parts, tmp_path):
    first, second = shard(parts[1], 0), shard(parts[1], 1)
    assert first.stat().st_size == second.stat().st_size
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    refused(tmp_path, *parts, code=4, words=[first, "part file differs from its part manifest"])


def test_a_symlink_inside_a_part_is_refused(parts, tmp_path):
    """Exit 3 (bad input: a part file that is not what it must be), as a FIFO would be; nothing in OUT."""
    victim = tmp_path / "outside.bin"
    link = shard(parts[0])
    original = link.read_bytes()
    victim.write_bytes(b"\0" * len(original))                    # the recorded size, other bytes
    link.unlink()
    link.symlink_to(victim)
    refused(tmp_path, *parts, code=3, words=[link, "symlink"])
    assert not (tmp_path / "out").exists() or not any(p.is_symlink() for p in (tmp_path / "out").rglob("*"))
    link.unlink()
    link.write_bytes(original)                                    # a symlinked folder on the way: refused too
    folder = parts[1] / "sub"
    folder.symlink_to(tmp_path)
    edit_part(parts[1], lambda r: r["manifest"]["files"].update(
        {"sub/outside.bin": {"bytes": victim.stat().st_size, "sha256": "0" * 64, "git_sha1": "0" * 40}}))
    refused(tmp_path, *parts, code=3, words=[folder, "symlink"])


def test_an_edited_file_sha256_is_refused(parts, tmp_path):
    name = shard(parts[0]).name
    edit_part(parts[0], lambda r: r["manifest"]["files"][name].update(sha256="ab" * 32))
    refused(tmp_path, *parts, code=4, words=[shard(parts[0]), "ab" * 32])


@pytest.mark.parametrize("verify", [False, True])
def test_an_edited_tensor_sha256_is_refused(parts, tmp_path, verify):
    tensor = sorted(load_part(parts[1])["manifest"]["tensors"])[3]
    edit_part(parts[1], lambda r: r["manifest"]["tensors"].update({tensor: "cd" * 32}))
    line = refused(tmp_path, *parts, *(["--verify"] if verify else []), code=4,
                   words=[tensor, "cd" * 32, parts[1], "tensor differs"])
    assert ".safetensors" in line
    if verify:                                                   # refused before anything is written
        assert not (tmp_path / "out").exists()


def test_a_tensor_listed_in_no_file_is_refused(parts, tmp_path):
    edit_part(parts[1], lambda r: r["manifest"]["tensors"].update({"blk.2.ffn_up_exps.99.weight": "ef" * 32}))
    refused(tmp_path, *parts, code=4, words=["blk.2.ffn_up_exps.99.weight", "in none of its files"])


# ---------------------------------------------------------------------------------------------- names, manifests

@pytest.mark.parametrize("name", ["ktconvert.json", ".ktconvert-merge.json", ".ktconvert.lock", "sub//x"])
def test_a_part_naming_an_own_or_unplain_name_is_refused(parts, tmp_path, name):
    data = b'{"format": "ktconvert-merge", "manifest_sha256": "x"}\n'
    path = parts[0] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
             "git_sha1": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    edit_part(parts[0], lambda r: r["manifest"]["files"].update({name: entry}))
    refused(tmp_path, *parts, code=3, words=[parts[0] / PART_NAME, "will not write", name])


def test_own_names_and_unplain_names():
    from ktconvert.distributed.parts import output_name_problem

    for name in ("ktconvert.json", "ktconvert-part.json", ".ktconvert-merge.json", ".ktconvert.lock",
                 ".ktconvert-journal.json", "a/.ktconvert-journal.stream.pt", "a/.x.safetensors.partial",
                 "/abs", "../up", "a/../b", "sub//x", "./x", "", "a\\b", "a\nb"):
        assert output_name_problem(name), name
    for name in ("config.json", "model-00001-of-00003.safetensors", "_layer_3/_numa_0/INT4_down.kt", ".hidden"):
        assert output_name_problem(name) is None, name


def _nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


MALFORMED = {
    "file bytes not a number": lambda r: next(iter(r["manifest"]["files"].values())).update(bytes="x"),
    "files a list": lambda r: r["manifest"].update(files=[]),
    "layers not numbers": lambda r: r.update(layers=["a"]),
    "layers empty": lambda r: r.update(layers=[]),
    "no source": lambda r: r["manifest"].pop("source"),
    "tensor sha256 a number": lambda r: r["manifest"]["tensors"].update({"x": 5}),
    "source file entry a string": lambda r: r["manifest"]["source"]["files"].update({"x": "y"}),
    "no source sample": lambda r: r.pop("source_sample"),
    "deeply nested": lambda r: r["options"].update(deep=_nested(100)),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_part_manifest_is_one_line_exit_3(parts, tmp_path, what):
    edit_part(parts[0], MALFORMED[what])
    refused(tmp_path, *parts, code=3, words=[parts[0] / PART_NAME])


def test_a_huge_part_manifest_is_one_line_exit_3(parts, tmp_path, monkeypatch):
    from ktconvert.distributed import parts as parts_module
    monkeypatch.setattr(parts_module, "MAX_MANIFEST_BYTES", 4096)
    refused(tmp_path, *parts, code=3, words=[parts[0] / PART_NAME, "larger than 4096 bytes"])


# ---------------------------------------------------------------------------------------------- the source

def test_parts_of_two_checkpoints_sharing_a_config_are_refused(source, parts, tmp_path):
    from ktconvert.examples.tiny import make_tiny_model

    other = make_tiny_model(tmp_path / "other-model", "deepseek_v3", seed=7, **MODEL)
    assert (other / "config.json").read_bytes() == (source / "config.json").read_bytes()
    other_part = write_parts(other, tmp_path / "other", ["2-3"])[0]
    read = [set(load_part(p)["manifest"]["source"]["files"]) for p in (parts[0], other_part)]
    assert not read[0] & read[1]                                   # no source file both parts read
    refused(tmp_path, parts[0], other_part, code=3, words=[other_part, "different source checkpoints"])


# ---------------------------------------------------------------------------------------------- a full disk

def test_a_full_disk_while_copying_is_exit_1_and_leaves_no_final_name(parts, tmp_path, monkeypatch):
    """Every write to a temporary copy writes half of what it is given (a short write), then nothing fits."""
    real_write, room = os.write, {"bytes": 150_000}

    def short_write(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            return real_write(fd, data)
        if room["bytes"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        count = min(max(1, len(data) // 2), room["bytes"])
        room["bytes"] -= count
        return real_write(fd, bytes(memoryview(data)[:count]))

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "write", short_write)
    line = refused(tmp_path, *parts, code=1, words=["No space left on device"])
    assert ".safetensors" in line
    placed = {p.name: p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file()}
    sizes = {Path(rel).name: e["bytes"] for p in parts for rel, e in load_part(p)["manifest"]["files"].items()}
    assert all(size == sizes[name] for name, size in placed.items() if name in sizes), placed   # nothing truncated
    assert not [name for name in placed if name.endswith(".partial")]


def test_write_all_writes_on_after_a_short_write(tmp_path, monkeypatch):
    from ktconvert.formats.fileio import write_all

    real_write, calls = os.write, []
    monkeypatch.setattr(os, "write", lambda fd, data: calls.append(len(data)) or real_write(fd, bytes(data[:3])))
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    write_all(fd, b"0123456789")
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(OSError) as info:
        write_all(fd, b"x")
    os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"0123456789" and calls == [10, 7, 4, 1]
    assert info.value.errno == errno.ENOSPC


# ---------------------------------------------------------------------------------------------- a rerun

def test_a_rerun_hashes_only_what_it_did_not_prove_and_what_changed(parts, single, tmp_path, monkeypatch):
    first_files = len(load_part(parts[0])["manifest"]["files"])
    real_place = merge_module._place
    interrupt_merge_after(monkeypatch, first_files + 1)           # the first part proven, one file of the second
    with pytest.raises(KeyboardInterrupt):
        merge(tmp_path / "out", parts)
    monkeypatch.setattr(merge_module, "_place", real_place)
    proven = json.loads((tmp_path / "out" / MERGE_JOURNAL).read_text())["proven"]
    assert [len(files) for files in proven.values()] == [first_files]
    second = sum(e["bytes"] for e in load_part(parts[1])["manifest"]["files"].values())
    profile.enable()
    try:
        merge(tmp_path / "out", parts)
    finally:
        report = profile.disable()
    assert report["kinds"]["hash.file"]["bytes"] == second        # the first part's files not hashed again
    assert tree(tmp_path / "out") == tree(single)
    # a proven file that changes afterwards (its ctime moves) is proven again: refused
    interrupt_merge_after(monkeypatch, first_files + 1)
    with pytest.raises(KeyboardInterrupt):
        merge(tmp_path / "again", parts)
    monkeypatch.setattr(merge_module, "_place", real_place)
    bad = shard(parts[0])
    flip_a_byte(bad)
    with pytest.raises(Exception, match="part file differs") as info:
        merge(tmp_path / "again", parts)
    assert info.value.exit_code == 4


# ---------------------------------------------------------------------------------------------- Ray

def test_ray_run_reusing_a_tampered_finished_part_is_refused(cluster, source, tmp_path):
    """The merge on the driver proves every part file, reused or not: exit 4 naming the file (the part is not
    redone: a finished part that changed means something else writes the parts folder)."""
    args = ["cpu", source, tmp_path / "out", "--method", "amxint4", "--numa", "2", "--executor", "ray",
            "--parts", "2", "--parts-dir", tmp_path / "p", "--quiet"]
    code, text = run_cli(*args)
    assert code == 0, text
    part = sorted((tmp_path / "p" / "out").iterdir())[-1]
    bad = shard(part)
    flip_a_byte(bad)
    (tmp_path / "out").rename(tmp_path / "first")
    code, text = run_cli(*args)
    line = text.strip().splitlines()[-1]
    assert code == 4 and str(bad) in line and "part file differs" in line, text
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_ray_run_reusing_parts_of_another_checkpoint_at_src_is_refused(cluster, source, tmp_path):
    """SRC replaced by another checkpoint with the same config.json: every finished part in --parts-dir is reused
    (their journals match the plan), but their source sample is not SRC's: exit 3."""
    import shutil

    from ktconvert.examples.tiny import make_tiny_model

    src = tmp_path / "src"
    shutil.copytree(source, src)
    args = ["cpu", src, tmp_path / "out", "--method", "amxint4", "--numa", "2", "--executor", "ray",
            "--parts", "2", "--parts-dir", tmp_path / "p", "--quiet"]
    code, text = run_cli(*args)
    assert code == 0, text
    other = make_tiny_model(tmp_path / "other", "deepseek_v3", seed=7, **MODEL)
    for path in other.glob("*.safetensors"):
        shutil.copyfile(path, src / path.name)
    (tmp_path / "out").rename(tmp_path / "first")
    code, text = run_cli(*args)
    line = text.strip().splitlines()[-1]
    assert code == 3 and "another source checkpoint than SRC" in line, text
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()

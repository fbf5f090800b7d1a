"""``--resume`` with another source of the same config.json (same shapes, other weights) is refused (issue 25, item 7;
before, the resumed OUT mixed two checkpoints): exit 2 naming the file, before anything is converted, and the
journal is left as it was, so a resume with the right source still finishes byte-identical to a clean run.

What is compared (ktconvert.formats.source_identity): every source file the interrupted run read to its end is trusted as is
when it is the very file that was read (stat identity), else checked by size and the sha256 of its first MiB, then
hashed whole; finished layers holding bytes of a file that was not read to its end are converted again."""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from ktconvert.errors import EXIT_USAGE
from test_resume_options import _killed_after, _run

CPU = ("--method", "amxint4", "--numa", "2")
JOURNAL = ".ktconvert-journal.json"


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _journal(out: Path) -> dict:
    return json.loads((out / JOURNAL).read_text())


def _refused(result, out: Path, name: str, *needles) -> None:
    assert result.exit_code == EXIT_USAGE, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"error: {out}: {name}: cannot resume: SRC is not the source the output was being "
                           "written from"), line
    for needle in needles:
        assert needle in line, (needle, line)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("deepseek_v3", layers=6, experts=8)      # one shard per MoE layer, 120 expert matrices


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    assert _run("cpu", model, out, *CPU, "--quiet").exit_code == 0
    return _tree(out)


@pytest.fixture
def interrupted(model, tmp_path):
    """(a copy of the model, OUT killed after 60 matrices, a shard the journal records as read to its end)."""
    src = tmp_path / "src"
    shutil.copytree(model, src)
    out = tmp_path / "out"
    _killed_after(60, "cpu", src, out, *CPU, "--threads", "1")
    finished = sorted(_journal(out)["sources"])
    assert finished, "expected a source file read to its end before the kill"
    return src, out, finished[-1]


def test_another_checkpoint_of_the_same_shapes_is_refused(interrupted, reference, tmp_path):
    from ktconvert.examples.tiny import make_tiny_model

    src, out, name = interrupted
    other = make_tiny_model(tmp_path / "other", "deepseek_v3", layers=6, experts=8, seed=7)
    assert (other / "config.json").read_bytes() == (src / "config.json").read_bytes()
    journal = (out / JOURNAL).read_bytes()
    first = sorted(_journal(out)["sources"])[0]
    _refused(_run("cpu", other, out, *CPU, "--resume", "--quiet"), out, first, "sha256 of its first")
    for shard in sorted(other.glob("*.safetensors")):            # the same files copied over the source's
        shutil.copy(shard, src / shard.name)
    _refused(_run("cpu", src, out, *CPU, "--resume", "--quiet"), out, first, "sha256 of its first")
    assert (out / JOURNAL).read_bytes() == journal                  # nothing changed: no layer forgotten either


def test_a_changed_byte_past_the_first_mib_is_found_by_the_full_hash(interrupted, model, reference):
    src, out, name = interrupted
    path = src / name
    assert path.stat().st_size > 1 << 20
    with open(path, "r+b") as fh:                 # the same size and first MiB: only the whole file's sha256 tells
        fh.seek(-100, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 1]))
    recorded = _journal(out)["sources"][name]["blake3"]
    _refused(_run("cpu", src, out, *CPU, "--resume", "--quiet"), out, name, f"expected blake3 {recorded}, found blake3")
    shutil.copy(model / name, path)               # the right bytes again (another inode: hashed, then trusted)
    assert _run("cpu", src, out, *CPU, "--resume", "--quiet").exit_code == 0
    assert _tree(out) == reference


def test_a_moved_copy_of_the_source_resumes(interrupted, reference, tmp_path):
    src, out, _name = interrupted
    moved = tmp_path / "moved"
    shutil.copytree(src, moved)                   # other inodes, same bytes: hashed once, then the run goes on
    result = _run("cpu", moved, out, *CPU, "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming: hashing" in result.output
    assert _tree(out) == reference


def test_a_source_lacking_a_file_the_run_read_is_refused(interrupted, tmp_path):
    """The same config and weights in one file instead of shards: the journal's files are not in SRC."""
    src, out, _name = interrupted
    joined = _single_file(src, tmp_path / "joined")
    first = sorted(_journal(out)["sources"])[0]
    _refused(_run("cpu", joined, out, *CPU, "--resume", "--quiet"), out, first, "found no such file in SRC")


def _single_file(src: Path, dst: Path) -> Path:
    """`src`'s shards joined into one model.safetensors (tensors in the shards' order), with its config.json."""
    header, blobs, offset = {}, [], 0
    for shard in sorted(src.glob("*.safetensors")):
        raw = shard.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        entries = json.loads(raw[8:8 + n])
        entries.pop("__metadata__", None)
        for tensor, entry in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            blobs.append(raw[8 + n + begin:8 + n + end])
            header[tensor] = {**entry, "data_offsets": [offset, offset + end - begin]}
            offset += end - begin
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return dst


def test_layers_from_a_file_not_read_to_its_end_are_converted_again(tiny_model, tmp_path):
    """One file holding both MoE layers, killed after layer 0 was written but before the file was read to its end:
    no digest vouches for layer 0's bytes, so a resume converts it again from what SRC holds now. Before, layer 0
    kept the old bytes while ktconvert.json recorded the new file's sha256."""
    from ktconvert.formats.safetensors_reader import Checkpoint

    src = _single_file(tiny_model("qwen3_moe"), tmp_path / "src")
    out = tmp_path / "out"
    _killed_after(40, "cpu", src, out, *CPU, "--threads", "1")          # 24 matrices per layer
    journal = _journal(out)
    assert "0" in journal["layers"] and "model.safetensors" not in journal["sources"], journal.keys()
    ref = Checkpoint.open(src).tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    with open(ref.file, "r+b") as fh:            # another checkpoint's layer 0 (one weight of it)
        fh.seek(ref.offset + 2 * 300)
        fh.write(b"\x80\x3f")                    # BF16 1.0
    resumed = _run("cpu", src, out, *CPU, "--resume", "--quiet")
    assert resumed.exit_code == 0, resumed.output
    clean = tmp_path / "clean"
    assert _run("cpu", src, clean, *CPU, "--quiet").exit_code == 0
    assert _tree(out) == _tree(clean)


def test_a_digest_recorded_before_must_not_change(tmp_path):
    """A source file read again (its layers not all finished) must hash as recorded: a file changed during the
    run is refused there too."""
    from ktconvert.errors import ResumeMismatchError
    from ktconvert.run.journal import Journal

    journal = Journal.start(tmp_path, {"method": "amxint4"}, resume=False)
    journal.finish_source("a.safetensors", {"bytes": 3, "sha256": "1" * 64})
    journal.finish_source("a.safetensors", {"bytes": 3, "sha256": "1" * 64})
    with pytest.raises(ResumeMismatchError, match=f"a.safetensors: cannot resume: .*expected sha256 {'1' * 64}, "
                                                  f"found sha256 {'2' * 64}"):
        journal.finish_source("a.safetensors", {"bytes": 3, "sha256": "2" * 64})
    assert journal.sources["a.safetensors"]["sha256"] == "1" * 64


@pytest.mark.parametrize("recorded, requested", [
    (list(range(3, 61)), list(range(3, 62))),                                   # long lists: the same 37 chars
    ({"hub": "hf", "repo": "org/name", "revision": "a" * 40}, {"hub": "hf", "repo": "org/name",
                                                                "revision": "a" * 39 + "b"}),
    ("/data/calibration/samples-of-the-first-kind/a.jsonl", "/data/calibration/samples-of-the-first-kind/b.jsonl"),
    (None, "None"), (2, 2.0), ([1, 2], (1, 2)),
], ids=["layers", "hub-revision", "path", "none-vs-string", "int-vs-float", "list-vs-tuple"])
def test_a_resume_mismatch_never_shows_two_equal_values(recorded, requested):
    """Before, values were cut to their first 37 characters: "expected X..., found X..." for MoE layer lists,
    hub revisions or paths differing further on; str() made None and "None" read the same."""
    from ktconvert.run.journal import mismatch_error

    error = mismatch_error("/out", [("--opt", recorded, requested)])
    assert error.expected != error.found, (error.expected, error.found)
    assert len(error.expected) <= len("--opt ") + 40 and len(error.found) <= len("--opt ") + 40

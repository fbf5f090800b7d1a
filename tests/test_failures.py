"""Failures while converting: a full disk, an unusable output path, a source that changes under the converter.
Each is one clear error naming the file, a non-zero exit code, and nothing left that looks complete."""
from __future__ import annotations

import errno
import os
import shutil

from click.testing import CliRunner

from ktconvert.cli.main import cli


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _looks_complete(out) -> list[str]:
    """Files a user (or kt-kernel's loader) could mistake for finished output."""
    if not out.exists():
        return []
    names = [p.name for p in out.rglob("*") if p.is_file()]
    return [n for n in names if n == "ktconvert.json" or (n.endswith(".safetensors") and not n.startswith("."))]


def test_disk_full_at_preallocation(tiny_model, tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    src = tiny_model("qwen3_moe")           # made before the disk "fills": the model's own shards preallocate too
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    out = tmp_path / "out"
    result = _run("cpu", src, out, "--method", "amxint4", "--quiet")
    assert result.exit_code != 0
    assert "No space left on device" in result.output and ".partial" in result.output
    assert _looks_complete(out) == []


def test_disk_full_while_writing(tiny_model, tmp_path, monkeypatch):
    from ktconvert.formats import st_writer

    real = st_writer._pwrite_all
    calls = {"n": 0}

    def fail_later(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(st_writer, "_pwrite_all", fail_later)
    out = tmp_path / "out"
    result = _run("cpu", tiny_model("qwen3_moe"), out, "--method", "amxint8", "--numa", "2", "--quiet")
    assert result.exit_code != 0 and "write failed (No space left on device)" in result.output
    assert _looks_complete(out) == []
    monkeypatch.setattr(st_writer, "_pwrite_all", real)   # space freed: --resume finishes the job
    result = _run("cpu", tiny_model("qwen3_moe"), out, "--method", "amxint8", "--numa", "2", "--quiet", "--resume")
    assert result.exit_code == 0, result.output
    assert _run("verify", out, "--hashes").exit_code == 0


def test_output_path_under_a_file(tiny_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = _run("cpu", tiny_model("qwen3_moe"), blocker / "out", "--method", "amxint4", "--quiet")
    assert result.exit_code != 0
    assert "not writable" in result.output and "file/out" in result.output


def test_source_truncated_mid_run(tiny_model, tmp_path, monkeypatch):
    from ktconvert.formats import stream

    src = tmp_path / "src"
    shutil.copytree(tiny_model("qwen3_moe", layers=3), src)
    real = stream.HashingFileReader.read_range
    calls = {"n": 0}

    def vanish(self, offset, nbytes):
        calls["n"] += 1
        if calls["n"] == 10:   # another process truncates the shard being read
            os.truncate(self.path, offset)
        return real(self, offset, nbytes)

    monkeypatch.setattr(stream.HashingFileReader, "read_range", vanish)
    out = tmp_path / "out"
    result = _run("cpu", src, out, "--method", "amxint4", "--quiet", "--threads", "1")
    assert result.exit_code == 3
    assert "changed or truncated while reading" in result.output and ".safetensors" in result.output
    assert "ktconvert.json" not in _looks_complete(out)


def test_nan_in_a_weight_names_file_tensor_layer_expert_projection(tiny_model, tmp_path):
    from ktconvert.formats.safetensors_reader import Checkpoint

    src = tmp_path / "src"
    shutil.copytree(tiny_model("qwen3_moe"), src)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    ref = Checkpoint.open(src).tensors[name]
    with open(ref.file, "r+b") as fh:
        fh.seek(ref.offset + 2 * 300)
        fh.write(b"\xc0\x7f")          # BF16 quiet NaN at row 1, column 44 (H = 256)
    out = tmp_path / "out"
    result = _run("cpu", src, out, "--method", "amxint4", "--quiet")
    assert result.exit_code == 3
    assert f"{ref.file.name}: {name} (layer 1, expert 3, up)" in result.output
    assert "NaN at row 1, column 44" in result.output
    assert "ktconvert.json" not in _looks_complete(out)


def _enospc(*_args, **_kw):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _one_line_exit_1(result) -> str:
    assert result.exit_code == 1, (result.output, result.exception)
    assert not isinstance(result.exception, OSError), result.exception      # a traceback outside the runner
    lines = result.output.strip().splitlines()       # progress lines (bundle, unbundle), then the error
    assert "Traceback" not in result.output and [line for line in lines if line.startswith("error: ")] == lines[-1:]
    assert "No space left on device" in lines[-1], lines
    return lines[-1]


def test_disk_full_at_a_journal_save(tiny_model, tmp_path, monkeypatch):
    """The journal is saved after every layer: a full disk there (creating its temporary) was an OSError
    traceback; now exit 1, one line naming the journal, nothing that looks complete, and --resume finishes."""
    from ktconvert.formats import fileio

    real = fileio.create_new
    saves = {"n": 0}

    def full_at_third_save(path, *args, **kw):
        if ".ktconvert-journal.json" in str(path):
            saves["n"] += 1
            if saves["n"] == 3:
                _enospc()
        return real(path, *args, **kw)

    monkeypatch.setattr(fileio, "create_new", full_at_third_save)
    out = tmp_path / "out"
    args = ("cpu", tiny_model("qwen3_moe"), out, "--method", "amxint4", "--quiet")
    assert ".ktconvert-journal.json" in _one_line_exit_1(_run(*args))
    assert _looks_complete(out) == [] or "ktconvert.json" not in _looks_complete(out)
    assert not list(out.glob(".*.tmp")) and not list(out.glob("*.partial"))
    monkeypatch.setattr(fileio, "create_new", real)
    assert _run(*args, "--resume").exit_code == 0
    assert _run("verify", out, "--hashes").exit_code == 0


def test_disk_full_while_bundling_and_unbundling(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert _run("cpu", tiny_model("qwen3_moe"), out, "--method", "amxint4", "--quiet").exit_code == 0
    monkeypatch.setattr(os, "fsync", _enospc)                   # the bundle's data reaches the disk at its fsync
    _one_line_exit_1(_run("bundle", out, tmp_path / "b.tar.zst"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]        # no bundle, no partial one
    monkeypatch.undo()
    assert _run("bundle", out, tmp_path / "b.tar.zst").exit_code == 0
    monkeypatch.setattr(os, "mkdir", _enospc)                   # unbundle into a folder that cannot be made
    _one_line_exit_1(_run("unbundle", tmp_path / "b.tar.zst", tmp_path / "new" / "dest"))
    monkeypatch.undo()
    from ktconvert.ops import bundle
    real = bundle.create_new                                    # the disk fills as the manifest is written last
    monkeypatch.setattr(bundle, "create_new", lambda path, *a, **k: _enospc() if "ktconvert.json" in str(path)
                        else real(path, *a, **k))
    line = _one_line_exit_1(_run("unbundle", tmp_path / "b.tar.zst", tmp_path / "dest"))
    assert "ktconvert.json: cannot write bundle member" in line
    assert not (tmp_path / "dest").exists() and not (tmp_path / ".dest.partial").exists()

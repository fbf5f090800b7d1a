"""What every output directory shares (ktconvert/run/output.py): one writer at a time (a lock held by a real second
process), validation before OUT exists (the GPU side too), and each command reading the source and the family
manifests once."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import EXIT_ERROR, InputError


def _hold_lock(src, out, kind: str) -> subprocess.Popen:
    """A second process that opens OUT for writing (plan validated, lock taken, journal started) and keeps it
    until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from ktconvert.api import CpuOptions, GpuOptions
        from ktconvert.cpu.output import CpuOutput
        from ktconvert.cpu.plan import plan_cpu
        from ktconvert.gpu.output import GpuOutput
        from ktconvert.gpu.plan import plan_gpu
        if {kind!r} == "cpu":
            output = CpuOutput({str(out)!r}, plan_cpu({str(src)!r}, CpuOptions.make(method="amxint4")))
        else:
            output = GpuOutput({str(out)!r}, plan_gpu({str(src)!r}, GpuOptions.make()))
        assert output.open()
        print("locked", flush=True)
        sys.stdin.read()
        output.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _ktconvert(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *map(str, args)], capture_output=True, text=True)


def test_a_second_writer_is_refused_naming_the_holder(tiny_model, tmp_path):
    src, out = tiny_model("qwen3_moe"), tmp_path / "out"
    holder = _hold_lock(src, out, "cpu")
    try:
        for extra in ("--resume", "--force"):
            res = _ktconvert("cpu", src, out, "--method", "amxint4", "--quiet", extra)
            assert res.returncode == EXIT_ERROR, res.stderr
            assert f"another ktconvert process (pid {holder.pid} on host {socket.gethostname()}) is writing this " \
                   "output directory" in res.stderr
        assert (out / ".ktconvert-journal.json").is_file()      # --force deleted nothing under the lock
    finally:
        holder.communicate("")
    assert holder.returncode == 0 and not (out / ".ktconvert.lock").exists()
    res = _ktconvert("cpu", src, out, "--method", "amxint4", "--quiet", "--resume")
    assert res.returncode == 0, res.stderr
    assert not (out / ".ktconvert.lock").exists() and (out / "ktconvert.json").is_file()
    assert _ktconvert("verify", out, "--hashes").returncode == 0


def test_gpu_and_one_pass_outputs_are_locked_too(tiny_model, tmp_path):
    src = tiny_model("qwen3_moe")
    holder = _hold_lock(src, tmp_path / "gpu", "gpu")
    try:
        res = _ktconvert("convert", src, "--cpu", tmp_path / "cpu", "--method", "amxint4", "--gpu", tmp_path / "gpu",
                         "--quiet")
        holder_named = f"(pid {holder.pid} on host {socket.gethostname()})"
        assert res.returncode == EXIT_ERROR and holder_named in res.stderr, res.stderr
        assert not (tmp_path / "cpu").exists()          # the other output of the pass was undone
    finally:
        holder.communicate("")


def test_a_killed_writer_leaves_a_lock_file_that_does_not_block(tiny_model, tmp_path):
    """flock dies with its process: a stale lock file (SIGKILL) neither blocks --resume nor makes OUT 'not empty'."""
    src, out = tiny_model("qwen3_moe"), tmp_path / "out"
    holder = _hold_lock(src, out, "cpu")
    holder.kill()
    holder.wait()
    assert (out / ".ktconvert.lock").exists()
    res = _ktconvert("cpu", src, out, "--method", "amxint4", "--quiet", "--resume")
    assert res.returncode == 0, res.stderr
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / ".ktconvert.lock").write_text("12345\n")
    assert _ktconvert("cpu", src, tmp_path / "fresh", "--method", "amxint8", "--quiet").returncode == 0


def test_gpu_refuses_before_creating_out(tmp_path):
    """A GGUF source cannot become the GPU checkpoint: the error comes from the plan, before OUT exists."""
    from pathlib import Path

    from ktconvert.api import convert_gpu

    gguf = Path(__file__).parent / "golden" / "gguf" / "tiny-qwen3moe-Q4_K_M.gguf"
    with pytest.raises(InputError, match="HF safetensors"):
        convert_gpu(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(cli, ["gpu", str(gguf), str(tmp_path / "out2"), "--group-size", "48", "--quiet"])
    assert result.exit_code == 2 and not (tmp_path / "out2").exists()


def test_one_command_opens_the_source_and_parses_the_manifests_once(tiny_model, tmp_path, monkeypatch):
    from ktconvert.architectures import manifests as architecture
    from ktconvert.api import CpuOptions, GpuOptions, convert
    from ktconvert.formats import safetensors_reader

    src = tiny_model("deepseek_v3", layers=3)
    counts = {"headers": 0, "manifests": 0}
    real_parse, real_manifest = safetensors_reader.parse_header, architecture.parse_manifest

    def parse_header(path):
        counts["headers"] += str(path).startswith(str(src))
        return real_parse(path)

    def parse_manifest(text, source):
        counts["manifests"] += 1
        return real_manifest(text, source)

    monkeypatch.setattr(safetensors_reader, "parse_header", parse_header)
    monkeypatch.setattr(architecture, "parse_manifest", parse_manifest)
    convert(src, [(tmp_path / "cpu", CpuOptions.make(method="amxint4", numa=2)),
                  (tmp_path / "gpu", GpuOptions.make(experts="w4a16"))], threads=1)
    assert counts["headers"] == len(list(src.glob("*.safetensors")))
    assert counts["manifests"] == len(architecture._manifest_files())
    assert os.listdir(tmp_path / "cpu") and (tmp_path / "gpu" / "ktconvert.json").is_file()

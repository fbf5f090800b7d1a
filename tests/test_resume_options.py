"""`--resume` continues only the output OUT was started (or finished) with (issue 14, item 7): other options, another
source or another kind of output are a usage error (exit 2) naming each differing option, on a finished OUT (its
ktconvert.json) and on an unfinished one (its journal), for `cpu`, `gpu`, `convert` (each target) and batch jobs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import EXIT_USAGE

CPU = ("--method", "amxint4", "--numa", "2")


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _killed_after(n_jobs: int, *args) -> None:
    """Run the CLI in a child that SIGKILLs itself after `n_jobs` converted matrices: OUT stays unfinished."""
    env = dict(os.environ, KTCONVERT_NO_PROGRESS="1", KTCONVERT_FAULT_AFTER_JOBS=str(n_jobs))
    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *map(str, args)], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def _refused(result, *options) -> None:
    assert result.exit_code == EXIT_USAGE, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and "cannot resume" in line, line
    for option in options:
        assert option in line, (option, line)


@pytest.fixture(scope="module")
def src(tiny_model):
    return tiny_model("qwen3_moe", layers=3)


@pytest.fixture(scope="module")
def finished_cpu(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "cpu"
    assert _run("cpu", src, out, *CPU, "--quiet").exit_code == 0
    return out


def _copy(out, tmp_path):
    dst = tmp_path / out.name
    shutil.copytree(out, dst)
    return dst


def test_finished_cpu_output_refuses_other_options(src, finished_cpu, tmp_path):
    out = _copy(finished_cpu, tmp_path)
    before = (out / "ktconvert.json").read_bytes()
    res = _run("cpu", src, out, "--resume", "--method", "amxint8", "--numa", "1", "--layout", "kt", "--quiet")
    _refused(res, "--method", "--numa", "--layout")
    assert "AMXINT4" in res.output and "AMXINT8" in res.output
    for args, option in ((("--method", "amxint4", "--numa", "1"), "--numa"),
                         (("--method", "amxint4", "--numa", "2", "--quant", "mse"), "--quant"),
                         (("--method", "amxint4", "--numa", "2", "--include-dense"), "--include-dense")):
        _refused(_run("cpu", src, out, "--resume", *args, "--quiet"), option)
    assert (out / "ktconvert.json").read_bytes() == before
    assert not (out / ".ktconvert.lock").exists() and not (out / ".ktconvert-journal.json").exists()
    same = _run("cpu", src, out, "--resume", *CPU, "--quiet")                 # the same options: nothing to do
    assert same.exit_code == 0 and "already complete" in same.output


def test_finished_cpu_output_refuses_another_source(src, finished_cpu, tmp_path):
    out = _copy(finished_cpu, tmp_path)
    other = tmp_path / "other-src"
    shutil.copytree(src, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "note": "another checkpoint"}))
    _refused(_run("cpu", other, out, "--resume", *CPU, "--quiet"), "SRC")


def test_unfinished_cpu_output_refuses_other_options_with_exit_2(src, tmp_path):
    out = tmp_path / "o"
    _killed_after(20, "cpu", src, out, *CPU)
    assert (out / ".ktconvert-journal.json").is_file() and not (out / "ktconvert.json").exists()
    res = _run("cpu", src, out, "--resume", "--method", "amxint8", "--numa", "1", "--quiet")
    _refused(res, "--method", "--numa")
    assert "--layout" not in res.output
    assert _run("cpu", src, out, "--resume", *CPU, "--quiet").exit_code == 0


def test_gpu_output_refuses_other_options(src, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "g"
    _killed_after(20, "gpu", src, out, "--experts", "w4a16")
    _refused(_run("gpu", src, out, "--resume", "--experts", "w8a16", "--quiet"), "--experts")
    assert _run("gpu", src, out, "--resume", "--experts", "w4a16", "--quiet").exit_code == 0
    for args, option in ((("--experts", "w8a16"), "--experts"), (("--linears", "bf16"), "--linears"),
                         (("--group-size", "64"), "--group-size")):
        _refused(_run("gpu", src, out, "--resume", *args, "--quiet"), option)
    # a GPU checkpoint is not a CPU output, and the other way round
    _refused(_run("cpu", src, out, "--resume", *CPU, "--quiet"), "kind")


def test_convert_checks_each_target(src, tmp_path):
    pytest.importorskip("torch")
    cpu_out, gpu_out = tmp_path / "c", tmp_path / "g"
    args = ("convert", src, "--cpu", cpu_out, "--gpu", gpu_out, *CPU, "--experts", "w4a16", "--quiet")
    assert _run(*args).exit_code == 0
    res = _run("convert", src, "--cpu", cpu_out, "--gpu", gpu_out, "--method", "amxint4", "--numa", "1",
               "--experts", "w4a16", "--resume", "--quiet")
    _refused(res, "--numa")
    res = _run("convert", src, "--cpu", cpu_out, "--gpu", gpu_out, *CPU, "--experts", "w4a16", "--linears", "bf16",
               "--resume", "--quiet")
    _refused(res, "--linears")
    assert "already complete" in _run(*args, "--resume").output


def test_batch_job_on_an_output_of_other_options_fails_with_exit_2(src, tmp_path):
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f"""
[[jobs]]
name = "int4"
source = "{src}"
out = "out"
method = "amxint4"
numa = 2

[[jobs]]
name = "int8-same-folder"
source = "{src}"
out = "out"
method = "amxint8"
numa = 1
layout = "kt"
""")
    res = _run("batch", jobs, "--keep-going", "--json", "--quiet")
    assert res.exit_code == EXIT_USAGE, res.output
    summary = json.loads(res.output)
    first, second = summary["jobs"]
    assert first["status"] == "ok"
    assert second["status"] == "failed" and second["exit_code"] == EXIT_USAGE
    assert all(opt in second["error"] for opt in ("--method", "--numa", "--layout"))

"""``verify`` with hostile inputs (issue 14, items 15, 17 and the regular-file rule for outputs).

* ``--source`` samples experts for the numerics, but every source tensor header of the converted layers is checked
  first (what the conversion's plan checks): a broken source is bad input, exit 3 naming file and tensor, whether
  or not its broken expert is sampled (before: exit 0 when unsampled; with ``--experts all`` a right-sized tensor
  of the wrong shape was a matmul ValueError traceback). A valid source of another model fails verification (4).
* A FIFO where an output file should be is refused, never opened for a blocking read (``verify --hashes`` hung).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.native import forward as native_rt

SHARD = "model-00002-of-00002.safetensors"
LAST = "model.layers.1.mlp.experts.7.up_proj.weight"      # layer 1, last expert: rarely in a sample of 1
needs_native = pytest.mark.skipif(not native_rt.available(), reason="native library not built")
METHODS = [pytest.param("bf16", id="bf16"), pytest.param("amxint4", id="amxint4", marks=needs_native)]


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def patch_header(path: Path, tensor: str, key: str, value) -> None:
    """Rewrite one entry of a safetensors header (the data stays where it is)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[tensor][key] = value
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


@pytest.fixture(scope="module")
def converted(tiny_model, tmp_path_factory):
    """{method: OUT} of the tiny Qwen3-MoE (2 layers x 8 experts, H = I = 256) and the source itself."""
    src = tiny_model("qwen3_moe")
    outs = {}
    for method in ("bf16", "amxint4"):
        out = tmp_path_factory.mktemp("out") / method
        if method == "amxint4" and not native_rt.available():
            continue
        assert _cli("cpu", src, out, "--method", method, "--quiet").exit_code == 0
        outs[method] = out
    return src, outs


SOURCE_FAULTS = [
    pytest.param("shape", [128, 512], "expert matrix shape disagrees with config.json", id="same-bytes-wrong-shape"),
    pytest.param("shape", [256, 256, 1], "expert weight is not a matrix", id="3-d"),
    pytest.param("dtype", "I16", "unsupported dtype", id="integer-dtype"),
    pytest.param("dtype", "F32", "span does not match shape x dtype", id="span"),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("key, value, message", SOURCE_FAULTS)
def test_broken_source_is_bad_input_sampled_or_not(converted, tmp_path, method, key, value, message):
    src, outs = converted
    broken = tmp_path / "src"
    shutil.copytree(src, broken)
    patch_header(broken / SHARD, LAST, key, value)
    for experts in ("1", "all"):
        result = _cli("verify", outs[method], "--source", broken, "--experts", experts)
        assert result.exit_code == 3, (experts, result.output)
        line = result.output.strip().splitlines()[-1]
        assert "Traceback" not in result.output and line.startswith(f"error: {SHARD}: {LAST}: ") and message in line


@pytest.mark.parametrize("method", METHODS)
def test_honest_source_passes(converted, method):
    src, outs = converted
    result = _cli("verify", outs[method], "--source", src, "--experts", "all")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("method", METHODS)
def test_source_of_another_model_fails_verification(converted, tiny_model, method):
    _src, outs = converted
    other = tiny_model("qwen3_moe", hidden=128)
    result = _cli("verify", outs[method], "--source", other, "--experts", "all")
    assert result.exit_code == 4, result.output
    assert "--source is another model: hidden, intermediate, experts [128, 256, 8]" in result.output


def test_broken_gguf_source_is_bad_input(tmp_path):
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from test_gguf_header import _write_moe_gguf, patched

    good = tmp_path / "m.gguf"
    _write_moe_gguf()(good, T.F16, layers=2, experts=4, hidden=256, inter=256)
    out = tmp_path / "out"
    assert _cli("cpu", good, out, "--method", "bf16", "--quiet").exit_code == 0
    name = "blk.1.ffn_up_exps.weight"
    bad = patched(good, tmp_path / "bad.gguf", name, "offset", lambda rel: rel + 1)
    result = _cli("verify", out, "--source", bad, "--experts", "1")
    assert result.exit_code == 3, result.output
    assert result.output.strip().splitlines()[-1].startswith(f"error: bad.gguf: {name}: tensor data offset is not")


def _verify_subprocess(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "KTCONVERT_NO_PROGRESS": "1"}
    env.pop("KTCONVERT_DEBUG", None)
    try:
        return subprocess.run([sys.executable, "-m", "ktconvert.cli.main", "verify", *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("ktconvert verify hung on a FIFO")


@needs_native
@pytest.mark.parametrize("layout", ["kt", "safetensors"])
def test_fifo_in_place_of_an_output_file(tiny_model, tmp_path, layout):
    out = tmp_path / "out"
    assert _cli("cpu", tiny_model("qwen3_moe"), out, "--method", "amxint4", "--layout", layout,
                "--quiet").exit_code == 0
    victim = sorted(out.rglob("*.kt" if layout == "kt" else "*.safetensors"))[0]
    victim.unlink()
    os.mkfifo(victim)
    rel = victim.relative_to(out).as_posix()
    for args in ((out, "--hashes"), (out,)):
        run = _verify_subprocess(*args)
        assert run.returncode == 4, run.stdout + run.stderr
        assert "Traceback" not in run.stderr and rel in run.stdout
    assert f"{rel}: file is not a regular file (a FIFO)" in _verify_subprocess(out, "--hashes").stdout


def test_output_readers_refuse_a_fifo(tmp_path):
    """hash_file (verify --hashes, publish) and the kt-layout reader's pread refuse a FIFO instead of blocking."""
    from test_safe_read import _refused

    from ktconvert.errors import VerifyError
    from ktconvert.formats.fileio import hash_file
    from ktconvert.verification.reader import _pread

    fifo = tmp_path / "x.kt"
    os.mkfifo(fifo)
    _refused(lambda: hash_file(fifo), [fifo])
    _refused(lambda: _pread(fifo, 0, 4, "x.kt"), [fifo], error=VerifyError)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("option, value", [("--tokens", "0"), ("--tokens", "-1"), ("--experts", "x"),
                                           ("--experts", "0"), ("--threshold", "nan"), ("--layers", "x"),
                                           ("--layers", ",")])
def test_unusable_numeric_option_is_a_usage_error(converted, method, option, value):
    """Before: --tokens 0 / -1 and --experts x were ValueError tracebacks, --threshold nan passed everything."""
    src, outs = converted
    result = _cli("verify", outs[method], "--source", src, option, value)
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert "Traceback" not in result.output and line.startswith(f"error: {option} is not usable"), line

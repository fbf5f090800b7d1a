"""A source whose routed experts already are the requested in-place method's tensors is carried over byte for byte
(methods' carry_over): compared with the source through the safetensors library itself (not ktconvert's reader),
recorded in ktconvert.json, and verify against the source reports zero error. Anything else is still quantized."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")

CASES = [("ct-int4", "rawint4"), ("fp8", "fp8"), ("bf16", "bf16")]   # (tiny-model dtype, --method)


def _tensors(folder) -> dict:
    """Every tensor of every shard as bytes, read with the safetensors library (raw bytes, any dtype)."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        header_len = int.from_bytes(shard.read_bytes()[:8], "little")
        header = json.loads(shard.read_bytes()[8:8 + header_len])
        data = shard.read_bytes()[8 + header_len:]
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                out[name] = (info["dtype"], tuple(info["shape"]), data[begin:end])
    return out


def _convert(src, out, method, *extra):
    result = CliRunner().invoke(cli, ["cpu", str(src), str(out), "--method", method, "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "ktconvert.json").read_text())


@pytest.mark.parametrize("dtype, method", CASES)
def test_experts_already_in_the_method_are_copied_unchanged(tiny_model, tmp_path, dtype, method):
    src = tiny_model("deepseek_v3", dtype=dtype)
    out = tmp_path / "out"
    manifest = _convert(src, out, method)
    theirs, ours = _tensors(src), _tensors(out)
    experts = [n for n in ours if ".mlp.experts." in n]
    layers = manifest["model"]["layers"]
    assert len({n.split(".")[2] for n in experts}) == len(layers) and {n.split(".")[-1] for n in experts} == \
        {n.split(".")[-1] for n in theirs if ".mlp.experts." in n}
    for name in experts:
        assert ours[name] == theirs[name], f"{name} differs from the source's tensor"
    assert manifest["carried_over"]["source_format"] and "not applied" in manifest["carried_over"]["quant"]
    # verify against the source: the output decodes to exactly the source's weights
    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", "verify", str(out), "--source", str(src),
                           "--hashes", "--json", "--sample-experts", "all"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["numerics"]["layers"]
    assert rows and all(r["weight_rel_l2"] == 0.0 and r["moe_rel_l2"] == 0.0 for r in rows), rows


def test_plan_says_it_carries_over(tiny_model):
    result = CliRunner().invoke(cli, ["plan", str(tiny_model("deepseek_v3", dtype="ct-int4")), "--method", "rawint4"])
    assert result.exit_code == 0, result.output
    assert "carried over byte for byte" in result.output


@pytest.mark.parametrize("dtype, method", [("bf16", "rawint4"), ("ct-int4", "amxint4"), ("ct-int4", "fp8"),
                                           ("fp8", "bf16")])
def test_other_formats_are_converted_not_copied(tiny_model, tmp_path, dtype, method):
    manifest = _convert(tiny_model("deepseek_v3", dtype=dtype), tmp_path / "out", method)
    assert "carried_over" not in manifest


def test_a_killed_carry_over_resumes_to_the_same_bytes(tiny_model, tmp_path):
    src = tiny_model("deepseek_v3", dtype="ct-int4")
    clean = tmp_path / "clean"
    _convert(src, clean, "rawint4")
    out = tmp_path / "killed"
    cmd = [sys.executable, "-c", "from ktconvert.cli.main import main; main()", "cpu", str(src), str(out), "--method",
           "rawint4", "--quiet"]
    env = {**__import__("os").environ, "KTCONVERT_FAULT_AFTER_JOBS": "20", "KTCONVERT_NO_PROGRESS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (out / "ktconvert.json").exists()
    assert subprocess.run(cmd + ["--resume"], capture_output=True, text=True).returncode == 0
    files = sorted(p.relative_to(clean) for p in clean.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    for rel in files:
        assert (out / rel).read_bytes() == (clean / rel).read_bytes(), rel

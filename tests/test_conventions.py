"""One convention for every command (issue 30, item 3): --num-samples / --max-length on every calibrated path (as
expert-stats has them), --dampening documented against llm-compressor's default, and the API's ConvertResult.files
the relative paths written."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli


class Sampled(Exception):
    """Raised by the stand-in load_samples: what the calibrated path asked for, nothing run."""


def _capture(monkeypatch, target: str) -> None:
    def load_samples(path, model_dir, max_length=2048, num_samples=None, vocab_size=None):
        raise Sampled(json.dumps({"max_length": max_length, "num_samples": num_samples}))

    monkeypatch.setattr(target, load_samples)
    monkeypatch.setenv("KTCONVERT_DEBUG", "1")          # let the stand-in's exception through


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


COMMANDS = [
    pytest.param("ktconvert.gptq.cpu.load_samples", ["cpu", "{src}", "{out}", "--method", "amxint4", "--quant", "gptq"],
                 id="cpu-gptq"),
    pytest.param("ktconvert.gpu.convert.load_samples", ["gpu", "{src}", "{out}", "--quant", "gptq"], id="gpu-gptq"),
]


@pytest.mark.parametrize("target, words", COMMANDS)
def test_calibrated_conversions_take_num_samples_and_max_length(target, words, tiny_model, calibration, tmp_path,
                                                                monkeypatch):
    pytest.importorskip("torch", reason="--quant gptq needs the [gpu] extra")
    _capture(monkeypatch, target)
    args = [w.format(src=tiny_model("qwen3_moe"), out=tmp_path / "out") for w in words]
    result = _cli(*args, "--calibration", calibration, "--num-samples", "2", "--max-length", "16", "--quiet")
    assert isinstance(result.exception, Sampled), result.output
    assert json.loads(str(result.exception)) == {"max_length": 16, "num_samples": 2}


def test_verify_calibration_takes_num_samples_and_max_length(tiny_model, calibration, tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="verify --calibration needs the [gpu] extra")
    src = tiny_model("qwen3_moe")
    assert _cli("cpu", src, tmp_path / "out", "--method", "bf16", "--quiet").exit_code == 0
    _capture(monkeypatch, "ktconvert.gptq.calibration.load_samples")      # imported at use
    result = _cli("verify", tmp_path / "out", "--source", src, "--calibration", calibration, "--num-samples", "1",
                  "--max-length", "8")
    assert isinstance(result.exception, Sampled), result.output
    assert json.loads(str(result.exception)) == {"max_length": 8, "num_samples": 1}


@pytest.mark.parametrize("words", [["cpu", "{src}", "{out}", "--method", "amxint4"], ["gpu", "{src}", "{out}"]])
def test_sampling_options_without_gptq_are_usage(words, tiny_model, tmp_path):
    args = [w.format(src=tiny_model("qwen3_moe"), out=tmp_path / "out") for w in words]
    result = _cli(*args, "--num-samples", "2")
    assert result.exit_code == 2 and "--num-samples is only used with --quant gptq" in result.output
    assert not (tmp_path / "out").exists()


def test_dampening_help_names_llm_compressors_default():
    text = " ".join(_cli("cpu", "--help").output.split())
    assert "dampening_frac defaults to 0.01" in text and "default 0.1" in text


@pytest.mark.parametrize("words", [["cpu", "{src}", "{out}", "--method", "amxint4"],
                                   ["convert", "{src}", "--cpu", "{out}", "--method", "amxint4"]])
def test_dry_run_prints_the_plan_and_writes_nothing(words, tiny_model, tmp_path):
    src = tiny_model("qwen3_moe")
    args = [w.format(src=src, out=tmp_path / "out") for w in words]
    result = _cli(*args, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)
    plan = _cli("plan", src, "--method", "amxint4", "--json")
    expected = json.loads(plan.output)
    got = planned["targets"][0]["plan"] if planned.get("targets") else planned["cpu"]
    assert got["files"] == expected["cpu"]["files"] and got["total_bytes"] == expected["cpu"]["total_bytes"]
    assert not (tmp_path / "out").exists()


def test_one_layers_syntax_for_parts_and_verify(tiny_model, tmp_path):
    """Ranges and lists everywhere (before: a part took only A-B, verify only 1,3): parts 0,2 and 1,3 of a
    4-layer model merge into the single run's bytes; verify runs 0-1,3."""
    src = tiny_model("qwen3_moe", layers=4)
    single = tmp_path / "single"
    assert _cli("cpu", src, single, "--method", "amxint4", "--quiet").exit_code == 0
    for name, layers in (("a", "0,2"), ("b", "1,3")):
        result = _cli("cpu", src, tmp_path / name, "--method", "amxint4", "--layers", layers, "--quiet")
        assert result.exit_code == 0, result.output
    assert _cli("merge", tmp_path / "m", tmp_path / "a", tmp_path / "b").exit_code == 0
    files = sorted(p.relative_to(single) for p in single.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "m") for p in (tmp_path / "m").rglob("*") if p.is_file())
    assert all((single / f).read_bytes() == (tmp_path / "m" / f).read_bytes() for f in files)
    verify = _cli("verify", tmp_path / "m", "--layers", "0-1,3", "--json")
    assert verify.exit_code == 0, verify.output
    assert [row["layer"] for row in json.loads(verify.output)["numerics"]["layers"]] == [0, 1, 3]
    bad = _cli("cpu", src, tmp_path / "bad", "--method", "amxint4", "--layers", "1-", "--quiet")
    assert bad.exit_code == 2 and "1-3,7" in bad.output

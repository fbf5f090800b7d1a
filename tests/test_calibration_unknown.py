"""Calibration text the tokenizer cannot read (issue 30, item 4): most tokens the unknown token is refused before
anything runs (before: expert-stats counted 90 <unk> tokens' routing and said nothing), a smaller share warns;
tiny-model --help says what its tokenizer reads."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import InputError

pytest.importorskip("transformers", reason="text calibration needs the [gpu] extra")
pytest.importorskip("tokenizers", reason="the tiny model's tokenizer needs `tokenizers`")


def _write(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_mostly_unknown_text_is_refused(tiny_model, tmp_path):
    from ktconvert.gptq.calibration import load_samples

    calib = _write(tmp_path / "c.jsonl", ["hello world, the quick brown fox"] * 3)
    with pytest.raises(InputError, match=r"\(100%\) are the tokenizer's unknown token '<unk>'"):
        load_samples(calib, tiny_model("qwen3_moe"))


def test_some_unknown_text_warns(tiny_model, tmp_path):
    from ktconvert.gptq.calibration import CalibrationWarning, load_samples

    calib = _write(tmp_path / "c.jsonl", ["tok5 tok6 tok7 hello"])
    with pytest.warns(CalibrationWarning, match=r"1 of the 4 calibration tokens \(25%\)"):
        samples = load_samples(calib, tiny_model("qwen3_moe"))
    assert samples[0].tolist() == [5, 6, 7, 0]


def test_readable_text_is_silent(tiny_model, tmp_path, recwarn):
    from ktconvert.gptq.calibration import load_samples

    load_samples(_write(tmp_path / "c.jsonl", ["tok5 tok6 tok7 tok8"]), tiny_model("qwen3_moe"))
    assert not recwarn.list


def test_expert_stats_refuses_unknown_text(tiny_model, tmp_path):
    pytest.importorskip("torch")
    calib = _write(tmp_path / "c.jsonl", ["hello world"] * 2)
    result = CliRunner().invoke(cli, ["expert-stats", str(tiny_model("qwen3_moe")), str(tmp_path / "s.pt"),
                                      "--calibration", str(calib)])
    assert result.exit_code == 3 and "unknown token" in result.output
    assert not (tmp_path / "s.pt").exists()


def test_tiny_model_help_says_what_its_tokenizer_reads():
    text = " ".join(CliRunner().invoke(cli, ["tiny-model", "--help"]).output.split())
    assert "reads only the words tok4, tok5" in text and "input_ids" in text

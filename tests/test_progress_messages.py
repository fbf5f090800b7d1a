"""What a user sees while and after a conversion runs (issue 30, item 2): the terminal bar at 80 columns, counters
that move and say what they count, one end event, the folder spelled one way in every printed flag line, parts that
print nothing to launch, and merge naming the layer that is missing as missing."""
from __future__ import annotations

import io
import json
import os

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.util.progress import PlainProgress, TqdmProgress

LABEL = "convert BF16 T=1 + convert AMXINT4 T=1 + convert AMXINT8 T=1"    # what a 3-output convert is called


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_three_output_bar_fits_80_columns_with_rate_and_eta():
    """Before: the label took the width and tqdm left only "▌" of the bar, no rate, no ETA."""
    stream = FakeTty()
    progress = TqdmProgress(stream, interval=0, ncols=80)
    ticks = iter(range(1000))
    progress.clock = lambda: float(next(ticks))
    with progress:
        progress.start(96 << 20, 96, LABEL, unit="matrices")
        for _ in range(96):
            progress.advance(1 << 20, items=1)
    line = [part for part in stream.getvalue().split("\r") if part.strip()][-1].rstrip("\n")
    assert len(line) <= 80 and line.startswith("convert 3 outputs: 100%|#")
    assert "B/s" in line and "<00:00" in line and line.endswith("96/96 matrices]")


def test_items_move_before_the_bytes_end(tiny_model, tmp_path, monkeypatch):
    """Before: the items were layers, finished after the last byte: 0/2 until 100 %."""
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    result = _cli("cpu", tiny_model("qwen3_moe"), tmp_path / "out", "--method", "bf16", "--json-progress")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stderr.splitlines()]
    moving = [e for e in events if e["event"] == "progress" and 0 < e["items"] < e["total_items"]]
    assert moving and all(e["unit"] == "matrices" for e in events if "unit" in e)
    # the end of the phase is said once: no "progress" event repeats the counters of "done"
    done = events[-1]
    assert done["event"] == "done"
    assert not [e for e in events[:-1] if (e["bytes"], e["items"]) == (done["bytes"], done["items"])
                and e["label"] == done["label"]]


def test_a_phase_without_bytes_says_what_it_counts():
    """expert-stats counts layers, not bytes: before "0 B, 3/3 items"."""
    stream = io.StringIO()
    with PlainProgress(stream, interval=0) as progress:
        progress.start(0, 3, "expert-stats", unit="layers")
        for layer in range(3):
            progress.advance(0, items=1, detail=f"layer {layer}")
    text = stream.getvalue()
    assert "expert-stats: started (3 layers)" in text and "3/3 layers" in text and "0 B" not in text


def test_expert_stats_counts_layers(tiny_model, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    calibration = tmp_path / "c.jsonl"
    calibration.write_text("".join(json.dumps({"input_ids": list(range(4, 30))}) + "\n" for _ in range(2)))
    result = _cli("expert-stats", tiny_model("qwen3_moe"), tmp_path / "s.pt", "--calibration", calibration)
    assert result.exit_code == 0, result.output
    assert "2/2 layers" in result.stderr and "0 B" not in result.stderr


def test_weight_path_spelled_one_way(tiny_model, tmp_path, monkeypatch):
    """Before: the end line said the OUT as typed, verify's flags row "."; now both the absolute folder, and
    ktconvert.json keeps "." (the folder itself, wherever it is moved)."""
    monkeypatch.chdir(tmp_path)
    result = _cli("cpu", tiny_model("qwen3_moe"), "out", "--method", "bf16", "--quiet")
    assert result.exit_code == 0, result.output
    absolute = os.path.abspath("out")
    assert f"--kt-weight-path {absolute} " in result.output
    assert json.loads((tmp_path / "out" / "ktconvert.json").read_text())["flags"]["kt-weight-path"] == "."
    verify = _cli("verify", "out")
    assert f"--kt-weight-path {absolute} " in verify.output and "--kt-weight-path . " not in verify.output


def test_a_part_prints_no_launch_flags_and_merge_names_the_missing_layer(tiny_model, tmp_path):
    result = _cli("cpu", tiny_model("qwen3_moe"), tmp_path / "p0", "--method", "bf16", "--layers", "0", "--quiet")
    assert result.exit_code == 0, result.output
    assert "--kt-" not in result.output and "ktconvert check" not in result.output
    assert "wrote part" in result.output and "ktconvert merge" in result.output
    merged = _cli("merge", tmp_path / "m", tmp_path / "p0")
    assert merged.exit_code == 3
    assert "found layers 1" not in merged.output        # before: the missing layer was called "found"
    assert "held by no part" in merged.output and "layers 1;" in merged.output
    assert "found parts holding layers 0" in merged.output and "--layers 1 " in merged.output

"""--profile: where a conversion's time goes. The byte columns are checked against what the run must have
processed (the source files' sizes, the expert matrices' BF16 bytes, the output files' sizes), and nested spans
report self time."""
from __future__ import annotations

import json
import time

from click.testing import CliRunner

from ktconvert.util import profile
from ktconvert.cli.main import cli


def test_nested_spans_report_self_time():
    profile.enable()
    with profile.span("outer", 10):
        time.sleep(0.05)
        with profile.span("inner", 5):
            time.sleep(0.1)
    report = profile.disable()
    kinds = report["kinds"]
    assert 0.09 < kinds["inner"]["wall_s"] < 0.5 and kinds["inner"]["bytes"] == 5
    assert 0.04 < kinds["outer"]["wall_s"] < 0.09, "outer must exclude the inner span's time"
    assert {"other", "startup"} <= set(kinds)
    assert profile.disable() is None and not profile.enabled()


def test_span_is_a_no_op_when_disabled():
    assert not profile.enabled()
    with profile.span("x", 1):
        pass
    profile.enable()
    assert "x" not in profile.disable()["kinds"]


def test_cpu_profile_counts_every_byte(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe", layers=3, experts=4)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["cpu", str(model), str(out), "--method", "amxint8", "--numa", "2", "--quiet",
                                   "--profile", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    kinds = data["profile"]["kinds"]
    source_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    manifest = json.loads((out / "ktconvert.json").read_text())
    shards = sum(e["bytes"] for name, e in manifest["files"].items() if name.endswith(".safetensors"))
    matrices = len(manifest["model"]["layers"]) * manifest["model"]["experts"] * 3 * \
        manifest["model"]["hidden"] * manifest["model"]["intermediate"] * 2
    assert kinds["hash.source"]["bytes"] == source_bytes
    assert kinds["quantize.cpu"]["bytes"] == matrices
    assert kinds["decode"]["bytes"] == matrices
    assert kinds["hash.tensor"]["bytes"] == shards - sum(_header_bytes(out / n) for n in manifest["files"]
                                                         if n.endswith(".safetensors"))
    assert kinds["hash.file"]["bytes"] >= shards
    assert data["profile"]["core_s"] > 0 and data["profile"]["wall_s"] > 0
    assert "profile: wall" in res.stderr and "hash.source" in res.stderr


def _header_bytes(path) -> int:
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")

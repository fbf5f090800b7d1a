"""``verify --report FILE.html`` (issue 12 item 10): one self-contained page of what verify measured.

The page is parsed, not grepped: balanced tags (html.parser), every <svg> well-formed XML (xml.etree), figures
counted by kind and group, the worst-experts table read back cell by cell. The numbers it shows are compared with
the verify result they come from, and the experts it names with the output's own ktconvert.json tensors.
"""
from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner

import ktconvert
from ktconvert.cli.main import cli
from ktconvert.errors import OutputError, UsageError
from ktconvert.layouts.naming import PROJS, merged_key
from ktconvert.native import forward as native_rt
from ktconvert.verification.report_html import build_report, error_groups
from test_report import SVG, parse_page

needs_native = pytest.mark.skipif(not native_rt.available(), reason="native library not built")


class _Page(HTMLParser):
    """Figures (kind, group) in order and every table as rows of cell texts."""

    def __init__(self, text: str):
        super().__init__()
        self.figures, self.tables, self._cell = [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.figures.append((attrs.get("data-kind"), attrs.get("data-group")))
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None

    def table(self, *headers: str) -> list[dict]:
        """The rows of the one table whose header cells start with `headers`, as {header: text}."""
        (rows,) = [t for t in self.tables if t and tuple(t[0][:len(headers)]) == headers]
        return [dict(zip(rows[0], r)) for r in rows[1:]]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3_moe", layers=4, experts=8)


@pytest.fixture(scope="module")
def cpu_out(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu") / "out"
    ktconvert.convert_cpu(model, out, method="amxint4", numa=2, threads=1)
    return out


def _sampled(result) -> dict[int, list[int]]:
    return {row["layer"]: row["experts"] for row in result.numerics["layers"]}


@needs_native
def test_report_of_a_cpu_output(model, cpu_out, tmp_path):
    path = tmp_path / "verify.html"
    result = ktconvert.verify(cpu_out, source=model, layers="all", sample_experts="3", report=path)
    assert result.ok and result.report == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["verify.html"]       # renamed into place, no temp left
    text = path.read_text()
    kinds, svgs = parse_page(text)
    page = _Page(text)
    groups = [g.key for g in error_groups(result.to_dict(), json.loads((cpu_out / "ktconvert.json").read_text()))]
    assert groups == ["cpu"]
    assert [g for k, g in page.figures if k == "line"] == groups            # one error curve per checked layer group
    assert page.figures == [("line", "cpu"), ("heatmap", "cpu")] and kinds == ["line", "heatmap"]
    curve, heat = svgs
    legend = [t.text for t in curve.iter(SVG + "text")]
    assert {"gate", "up", "down", "MoE", "MoE limit"} <= set(legend)
    sampled = _sampled(result)
    assert list(sampled) == json.loads((cpu_out / "ktconvert.json").read_text())["model"]["layers"]   # --layers all
    tips = [r.find(SVG + "title").text for r in heat.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(tips) == len(sampled) * 8                                      # checked layers x every expert
    with_data = {tuple(int(x) for x in re.match(r"layer (\d+), expert (\d+)", t).groups())
                 for t in tips if not t.endswith("no data")}
    assert with_data == {(layer, e) for layer, experts in sampled.items() for e in experts}
    assert "random probe vectors" in text and "8 tokens per layer" in text
    layers = page.table("layer")
    assert [int(r["layer"]) for r in layers] == list(sampled) and all(r["status"] == "ok" for r in layers)
    for row, measured in zip(layers, result.numerics["layers"]):
        assert float(row["MoE rel L2"]) == pytest.approx(measured["moe_rel_l2"], rel=1e-3)
    _check_worst_experts(page, result, cpu_out)
    thresholds = page.table("group", "threshold")
    assert any(r["threshold"] == "moe_rel_l2" and float(r["value"]) == result.numerics["thresholds"]["moe_rel_l2"]
               for r in thresholds)


def _check_worst_experts(page: _Page, result, out) -> None:
    """The worst-experts table names sampled experts of checked layers, each with tensors in OUT's ktconvert.json,
    in descending order of the error verify measured for it."""
    manifest = json.loads((out / "ktconvert.json").read_text())
    measured = {(row["layer"], x["expert"]): x["rel_l2"] for row in result.numerics["layers"]
                for x in row["expert_errors"]}
    worst = page.table("rank")
    assert len(worst) == min(10, len(measured))
    named = [(int(r["layer"]), int(r["expert"])) for r in worst]
    assert named == sorted(measured, key=lambda k: (-measured[k], k))[:len(worst)]
    for layer, e in named:
        for proj in PROJS:
            for t in range(manifest["numa"]):
                assert merged_key(layer, proj, e, t, "weight") in manifest["tensors"]
    for row in result.numerics["layers"]:          # the per-row top 3 verify already names are the same experts
        top = sorted(row["expert_errors"], key=lambda x: -x["rel_l2"])[:3]
        assert [x["expert"] for x in top] == [x["expert"] for x in row["worst_experts"]]


@needs_native
def test_failing_verification_still_writes_the_report(model, cpu_out, tmp_path):
    """--threshold below the honest error: exit 4, and the page says FAILED, lists the problems, marks the layers."""
    path = tmp_path / "failed.html"
    run = CliRunner().invoke(cli, ["verify", str(cpu_out), "--source", str(model), "--threshold", "0.01",
                                   "--report", str(path), "--json"])
    assert run.exit_code == 4, run.output
    result = json.loads(run.output)
    assert not result["ok"] and result["report"] == str(path)
    text = path.read_text()
    parse_page(text)
    page = _Page(text)
    assert '<p class="status failed">' in text and f"verification FAILED: {len(result['problems'])}" in text
    for problem in result["problems"]:
        assert f"<li>{html.escape(problem)}</li>" in text
    assert [r["status"] for r in page.table("layer")] == ["FAILED"] * len(result["numerics"]["layers"])
    assert [g for k, g in page.figures if k == "line"] == ["cpu"]
    assert any(r["threshold"] == "moe_rel_l2" and r["value"] == "0.01" for r in page.table("group", "threshold"))


def test_report_of_an_output_without_manifest(model, tmp_path):
    """Nothing to measure (no ktconvert.json): the page is still written, says why, and holds no plot."""
    (tmp_path / "broken").mkdir()
    path = tmp_path / "r.html"
    result = ktconvert.verify(tmp_path / "broken", report=path)
    assert not result.ok
    kinds, _ = parse_page(path.read_text())
    assert kinds == [] and "No readable ktconvert.json" in path.read_text()
    assert "verification FAILED" in path.read_text()


def test_report_target_is_checked_before_verify_runs(cpu_out, tmp_path):
    before = sorted(p.name for p in cpu_out.iterdir())
    with pytest.raises(UsageError, match="into the output folder it verifies"):
        ktconvert.verify(cpu_out, report=cpu_out / "verify.html")
    with pytest.raises(OutputError, match="folder does not exist"):
        ktconvert.verify(cpu_out, report=tmp_path / "missing" / "verify.html")
    with pytest.raises(OutputError, match="is a folder"):
        ktconvert.verify(cpu_out, report=tmp_path)
    assert sorted(p.name for p in cpu_out.iterdir()) == before


def test_report_of_a_gpu_checkpoint(model, tmp_path):
    """GPU outputs: what GPU verify reports (its checks, matrix errors per layer and expert) as a curve and a heat
    map; the experts named are the decompressed ones (the first N per layer)."""
    out = tmp_path / "gpu"
    ktconvert.convert_gpu(model, out, experts="w4a16", threads=1)
    path = tmp_path / "gpu.html"
    result = ktconvert.verify(out, source=model, sample_experts="2", report=path)
    assert result.ok, result.problems
    text = path.read_text()
    kinds, svgs = parse_page(text)
    page = _Page(text)
    assert page.figures == [("line", "gpu"), ("heatmap", "gpu")]
    errors = result.gpu["errors"]
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert [row["layer"] for row in errors["layers"]] == manifest["model"]["layers"]
    assert {(x["layer"], x["expert"]) for x in errors["experts"]} == \
        {(layer, e) for layer in manifest["model"]["layers"] for e in (0, 1)}
    assert errors["matrices"] == 3 * 2 * len(manifest["model"]["layers"])
    worst = page.table("rank")
    assert {int(r["expert"]) for r in worst} <= {0, 1} and len(worst) == min(10, len(errors["experts"]))
    assert max(float(r["relative L2"]) for r in worst) == pytest.approx(errors["max_rel_l2"], rel=1e-3)
    assert {c["name"] for c in result.checks} <= {r["check"] for r in page.table("check")}
    assert "compressed-tensors" in text and "matrix limit" in {t.text for t in svgs[0].iter(SVG + "text")}


@needs_native
def test_report_of_an_inplace_output(model, tmp_path):
    """In-place BF16 from a BF16 source: every expert matrix and output equals the source's, so every error the page
    shows is 0; the groups and plots are those of the CPU side."""
    out = tmp_path / "bf16"
    ktconvert.convert_cpu(model, out, method="bf16", threads=1)
    path = tmp_path / "bf16.html"
    result = ktconvert.verify(out, source=model, sample_experts="2", report=path)
    assert result.ok, result.problems
    for row in result.numerics["layers"]:
        assert row["gate_rel_l2"] == row["up_rel_l2"] == row["down_rel_l2"] == row["moe_rel_l2"] == 0.0
        assert [x["rel_l2"] for x in row["expert_errors"]] == [0.0, 0.0]
    page = _Page(path.read_text())
    parse_page(path.read_text())
    assert page.figures == [("line", "cpu"), ("heatmap", "cpu")]
    assert all(float(r["relative L2"]) == 0.0 for r in page.table("rank"))


def test_calibration_numerics_plug_in():
    """A numerics report of another kind (verify --calibration: per-layer MoE errors of OUT and a --compare output,
    no per-expert errors) gets its own curve, labelled with its probe kind, and no heat map."""
    rows = [{"layer": L, "tokens": 64, "outputs": {"out": {"moe_rel_l2": 0.1 * L, "moe_cosine": 0.99},
                                                    "compare": {"moe_rel_l2": 0.2 * L, "moe_cosine": 0.98}}}
            for L in (1, 2, 3)]
    result = {"ok": False, "out": "OUT", "problems": ["layer 3: MoE output on the calibration tokens vs source: "
                                                     "relative L2 0.3 > 0.25"],
              "checks": [{"name": "numerics", "status": "failed", "detail": ""}],
              "numerics": {"probe": "calibration", "calibration": {"file": "calib.jsonl", "samples": 4, "tokens": 256},
                           "layers": rows, "thresholds": {"moe_rel_l2": 0.25}, "problems": []}}
    result["numerics"]["problems"] = list(result["problems"])
    text = build_report(result, manifest={"method": "AMXINT4", "model": {"experts": 8, "layers": [1, 2, 3]}})
    kinds, svgs = parse_page(text)
    page = _Page(text)
    assert page.figures == [("line", "cpu")] and kinds == ["line"]
    assert "calibration tokens" in text and "256 tokens from 4 samples of calib.jsonl" in text
    legend = {t.text for t in svgs[0].iter(SVG + "text")}
    assert {"MoE (out)", "MoE (compare)", "MoE limit"} <= legend
    assert [r["status"] for r in page.table("layer")] == ["ok", "ok", "FAILED"]
    assert [r["MoE (compare) rel L2"] for r in page.table("layer")] == ["0.2", "0.4", "0.6"]

"""ktconvert.util.svg_report: self-contained HTML pages with inline SVG plots (and the expert-stats page built on it).

Checks: the page parses as HTML with every non-void element closed in order (html.parser), every <svg> is
well-formed XML (xml.etree) in the SVG namespace, the plots hold what was asked (cells, series, rows), and the page
loads nothing from outside.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np

from ktconvert.util import svg_report as report
SVG = "{http://www.w3.org/2000/svg}"
VOID = {"meta", "br", "img", "hr", "input", "link", "rect", "circle", "line", "path", "polyline", "stop"}


class _Checker(HTMLParser):
    """Records figures and fails on unbalanced tags."""

    def __init__(self):
        super().__init__()
        self.stack, self.figures, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.figures.append(attrs.get("data-kind"))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()


def parse_page(text: str) -> tuple[list[str], list[ET.Element]]:
    """(figure kinds in order, parsed <svg> roots); asserts the document is balanced and self-contained."""
    assert text.startswith("<!DOCTYPE html>")
    checker = _Checker()
    checker.feed(text)
    checker.close()
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", text) and "<script" not in text
    svgs = [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", text, re.S)]
    assert all(s.tag == SVG + "svg" for s in svgs)
    return checker.figures, svgs


def test_page_with_every_block():
    values = np.arange(12, dtype=float).reshape(3, 4)
    values[1] = np.nan
    text = report.page("A <title> & more", [
        report.section("Heat", report.heat_map(values, row_labels=["a", "b", "c"], x_label="expert",
                                               y_label="layer", value_label="count", title="T")),
        report.section("Lines", report.line_chart({"one": [(0, 1.0), (1, 2.0), (2, float("nan"))],
                                                   "two <b>": [(0, 3.0), (2, 1.0)], "dot": [(1, 1.5)]},
                                                  x_label="x", y_label="y"), note="a note"),
        report.section("Table", report.table(["name", "value"], [["x & y", 1.5], ["z", 3]]))])
    kinds, svgs = parse_page(text)
    assert kinds == ["heatmap", "line"] and len(svgs) == 2
    assert "<title>A &lt;title&gt; &amp; more</title>" in text
    heat, lines = svgs
    cells = [r for r in heat.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(cells) == 12
    tips = [r.find(SVG + "title").text for r in cells]
    assert tips[5] == "layer b, expert 1: no data" and tips[11] == "layer c, expert 3: 11"
    assert [r.get("fill") for r in cells[4:8]] == ["url(#nodata)"] * 4
    assert cells[0].get("fill") == report.colour(0.0) and cells[11].get("fill") == report.colour(1.0)
    polylines = list(lines.iter(SVG + "polyline"))
    assert [p.find(SVG + "title").text for p in polylines] == ["one", "two <b>"]   # "dot" has one point
    assert len(polylines[0].get("points").split()) == 2                             # NaN point skipped
    assert len(list(lines.iter(SVG + "circle"))) == 5
    assert text.count("<tr>") == 3 and '<td class="num">1.5</td>' in text


def test_large_heat_map_stays_bounded():
    """61 layers x 256 experts: one cell each, and the picture keeps a screen-sized width."""
    fig = report.heat_map(np.random.default_rng(0).random((61, 256)))
    (svg,) = [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", fig, re.S)]
    assert sum(1 for r in svg.iter(SVG + "rect") if r.find(SVG + "title") is not None) == 61 * 256
    assert float(svg.get("width")) <= 1200


def test_ticks_and_colours():
    assert report.nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    assert report.nice_ticks(1, 2, 8, integer=True) == [1, 2]
    assert report.nice_ticks(0.0, 0.3, 3) == [0.0, 0.1, 0.2, 0.3]
    assert report.colour(-1) == report.colour(0) and report.colour(2) == report.colour(1)
    assert re.fullmatch(r"#[0-9a-f]{6}", report.colour(0.5))


def test_expert_stats_page():
    """The expert-stats page: summary table, one heat map (every layer x expert, dense rows without data), the
    top-N coverage chart and the placement chart."""
    from ktconvert.activation.counts import ExpertActivation
    from ktconvert.activation.report import build_report, top_n_curves

    counts = np.zeros((3, 8), np.int64)
    counts[1] = [8, 4, 2, 2, 0, 0, 0, 0]
    counts[2] = [2] * 8
    meta = {"moe_layers": [1, 2], "top_k": 2, "tokens": 8, "samples": 1, "model_type": "deepseek_v3",
            "routing": {"hidden_states": "float forward (no quantization)", "dtype": "float32"}}
    kinds, svgs = parse_page(build_report(ExpertActivation(counts, meta)))
    assert kinds == ["heatmap", "line", "line"]
    cells = [r for r in svgs[0].iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(cells) == 3 * 8 and all(c.get("fill") == "url(#nodata)" for c in cells[:8])
    np.testing.assert_allclose(top_n_curves(counts, [1, 2])[:, :4], [[0.5, 0.75, 0.875, 1.0],
                                                                      [0.125, 0.25, 0.375, 0.5]])

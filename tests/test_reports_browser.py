"""Every HTML report kind rendered in a real browser (headless Chromium from the OS packages; skipped where there is
none): verify --report of a CPU output, of a GPU checkpoint and of an in-place output, verify --calibration --compare,
and expert-stats --report.

Each page is opened at 1400x1000 with a small script appended that measures it through getBoundingClientRect and
writes the measurements into the DOM (read back with --dump-dom), and a screenshot is taken. The layout assertions:
no two elements overlap (HTML siblings; inside each plot: texts against texts, heat-map cells and the plot frame),
no text leaves its plot, nothing is wider than the window, heat-map cells are readable. The page's own text (what a
reader sees, ``innerText``) is checked against what ran.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import ktconvert
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.native import forward as native_rt

BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = [pytest.mark.skipif(BROWSER is None, reason="no headless Chromium on this machine (apt-get install "
                                                          "chromium)"),
              pytest.mark.skipif(not native_rt.available(), reason="native library not built")]
WINDOW = (1400, 1000)

MEASURE = r"""<script>(function () {
  const box = e => e.getBoundingClientRect();
  const cross = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 0.5 &&
                          Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 0.5;
  const label = e => e.tagName.toLowerCase() + ' "' + (e.textContent || '').trim().slice(0, 50) + '"';
  const out = {overlaps: [], outside: [], cells: [], text: document.body.innerText,
               width: document.documentElement.scrollWidth, window: window.innerWidth};
  const skip = e => ['SCRIPT', 'STYLE', 'DEFS', 'TITLE', 'PATTERN'].includes(e.tagName.toUpperCase());
  for (const el of [document.body, ...document.body.querySelectorAll('*')]) {
    if (el.closest('svg')) continue;
    const kids = [...el.children].filter(k => !skip(k) && box(k).width * box(k).height > 0);
    for (let i = 0; i < kids.length; i++)
      for (let j = i + 1; j < kids.length; j++)
        if (cross(box(kids[i]), box(kids[j]))) out.overlaps.push([label(kids[i]), label(kids[j])]);
  }
  for (const svg of document.querySelectorAll('svg')) {
    const frame = box(svg);
    const texts = [...svg.querySelectorAll('text')];
    const cells = [...svg.querySelectorAll('rect')].filter(r => r.querySelector('title'));
    const plot = [...svg.querySelectorAll('rect')].filter(r => r.getAttribute('fill') === 'none');
    for (let i = 0; i < texts.length; i++) {
      const a = box(texts[i]);
      if (a.left < frame.left - 0.5 || a.right > frame.right + 0.5 || a.top < frame.top - 0.5 ||
          a.bottom > frame.bottom + 0.5) out.outside.push(label(texts[i]));
      for (let j = i + 1; j < texts.length; j++)
        if (cross(a, box(texts[j]))) out.overlaps.push([label(texts[i]), label(texts[j])]);
      for (const r of cells.concat(plot)) {
        const b = box(r);
        const inside = a.left >= b.left && a.right <= b.right && a.top >= b.top && a.bottom <= b.bottom;
        if (cross(a, b) && !(r.getAttribute('fill') === 'none' && inside))
          out.overlaps.push([label(texts[i]), 'rect ' + (r.textContent || 'plot frame').trim().slice(0, 50)]);
      }
    }
    if (cells.length) out.cells.push(Math.min(...cells.map(c => Math.min(box(c).width, box(c).height))));
  }
  const pre = document.createElement('pre');
  pre.id = 'layout-measurements';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();</script>"""


class _Pre(HTMLParser):
    """The text of <pre id="layout-measurements">."""

    def __init__(self, text: str):
        super().__init__()
        self.inside, self.data = False, ""
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.inside = tag == "pre" and dict(attrs).get("id") == "layout-measurements"

    def handle_data(self, data):
        if self.inside:
            self.data += data

    def handle_endtag(self, tag):
        self.inside = False


def _chromium(tmp: Path, *args: str) -> str:
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
           f"--window-size={WINDOW[0]},{WINDOW[1]}", "--hide-scrollbars", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def render(page: Path, tmp: Path) -> dict:
    """The measurements of `page` in Chromium (and a screenshot beside it, page.png)."""
    measured = tmp / (page.stem + ".measured.html")
    measured.write_text(page.read_text().replace("</body>", MEASURE + "\n</body>"))
    shot = tmp / (page.stem + ".png")
    _chromium(tmp, f"--screenshot={shot}", measured.as_uri())
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = _Pre(_chromium(tmp, "--dump-dom", measured.as_uri())).data
    assert data, f"{page.name}: the measuring script did not run"
    return json.loads(data)


def _layout_ok(name: str, m: dict, min_cell: float = 0.0) -> None:
    assert m["window"] == WINDOW[0]
    assert not m["overlaps"], f"{name}: overlapping elements {m['overlaps'][:5]}"
    assert not m["outside"], f"{name}: text outside its plot {m['outside'][:5]}"
    assert m["width"] <= WINDOW[0], f"{name}: page {m['width']} px wide in a {WINDOW[0]} px window"
    assert all(c >= min_cell for c in m["cells"]), f"{name}: heat-map cells of {m['cells']} px"
    assert not re.search(r"\b1 (experts|layers|samples|tokens|files|matrices)\b", m["text"]), name


@pytest.fixture(scope="module")
def pages(tiny_model, calibration, tmp_path_factory):
    """{kind: (report file, verify result or None)} for every report kind, from a tiny 8-expert model."""
    tmp = tmp_path_factory.mktemp("pages")
    model = tiny_model("qwen3_moe", layers=4, experts=8)
    cpu, cpu2, gpu, bf16 = (tmp / n for n in ("cpu", "cpu-int8", "gpu", "bf16"))
    ktconvert.convert_cpu(model, cpu, method="amxint4", numa=2, threads=1)
    ktconvert.convert_cpu(model, cpu2, method="amxint8", numa=2, threads=1)
    ktconvert.convert_gpu(model, gpu, experts="w4a16", threads=1)
    ktconvert.convert_cpu(model, bf16, method="bf16", threads=1)
    out = {}
    for kind, folder, extra in (("cpu", cpu, {"sample_experts": "3", "layers": "all"}),
                                ("compare", cpu, {"calibration": str(calibration), "compare": str(cpu2)}),
                                ("gpu", gpu, {"sample_experts": "2"}), ("bf16", bf16, {"sample_experts": "2"})):
        report = tmp / f"{kind}.html"
        out[kind] = (report, ktconvert.verify(folder, source=model, report=report, **extra))
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    stats = tmp / "stats.html"
    res = CliRunner().invoke(cli, ["expert-stats", str(model), str(tmp / "stats.pt"), "--calibration",
                                   str(calibration), "--report", str(stats), "--quiet"])
    assert res.exit_code == 0, res.output
    out["stats"] = (stats, None)
    out["model"] = model
    return out


def _curve_styles(path: Path) -> list[tuple[str, str]]:
    """(stroke, dash pattern) of every curve of the page's line charts."""
    return [(m.group(1), m.group(2) or "") for m in
            re.finditer(r'<polyline fill="none" stroke="([^"]+)" stroke-width="[^"]+"(?: stroke-dasharray="([^"]+)")?',
                        path.read_text())]


def test_cpu_verify_page(pages, tmp_path):
    path, result = pages["cpu"]
    m = render(path, tmp_path)
    _layout_ok("cpu", m, min_cell=24)
    text = m["text"]
    assert "verification OK" in text and "AMXINT4" in text and "random probe vectors" in text
    assert "numa\t2" in text and "No source weights" not in text
    limit = result.numerics["thresholds"]["moe_rel_l2"]
    assert f"Colour: 0 (dark) to {limit:.4g}, the MoE limit" in text             # a fixed, stated scale
    styles = _curve_styles(path)
    assert len(styles) >= 4 and len(set(styles)) == len(styles)   # gate / up / down / MoE: each its own line style


def test_compare_page_states_what_ran(pages, tmp_path):
    path, result = pages["compare"]
    m = render(path, tmp_path)
    _layout_ok("compare", m)
    text = m["text"]
    tokens = result.numerics["calibration"]["tokens"]
    assert "calibration tokens" in text and f"{tokens} tokens from 3 samples" in text
    assert "MoE (compare: cpu-int8)" in text and "MoE (out: cpu)" in text   # the compared folder is named
    assert "No source weights" not in text and "no source weights" not in text    # --source was given
    assert "experts sampled" not in text and "whole MoE output" in text
    layers = [line.split("\t") for line in text.splitlines() if re.match(r"\d+\t(ok|FAILED)\t", line)]
    assert layers and all(int(cells[2]) == tokens for cells in layers)    # each layer: every calibration token
    ran = text[text.index("how the numerics ran"):]
    assert "calib.jsonl" in ran and "cpu-int8" in ran and "router" in ran


def test_gpu_verify_page_has_no_cpu_wording(pages, tmp_path):
    path, result = pages["gpu"]
    m = render(path, tmp_path)
    _layout_ok("gpu", m, min_cell=24)
    text = m["text"]
    assert "GPU experts (W4A16)" in text and "compressed-tensors" in text
    assert not re.search(r"\bnuma\b|\bNUMA\b|\bCPU\b|kt-kernel", text), re.findall(r".*(?:numa|NUMA|CPU).*", text)
    # the FP8 linears' error: every linear of the first, middle and last layer, each number as the E4M3 spec gives it
    rows = {cells[0]: cells for cells in (line.split("\t") for line in text.splitlines()) if len(cells) == 3
            and cells[0].startswith("model.layers.")}
    fp8 = sorted(n[:-len(".weight")] for n, r in Checkpoint.open(path.parent / "gpu").tensors.items()
                 if r.dtype == "F8_E4M3")
    assert sorted(rows) == [m for m in fp8 if int(m.split(".")[2]) in (0, 2, 3)]
    module = "model.layers.2.self_attn.o_proj"
    assert float(rows[module][2]) == pytest.approx(_fp8_rel_l2(path.parent / "gpu", pages["model"], module), rel=2e-3)


def _e4m3(codes: np.ndarray) -> np.ndarray:
    """float32 of OCP E4M3 codes from the format's definition: sign, 4 exponent bits (bias 7), 3 mantissa bits,
    subnormals at exponent 0."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 0xF, c & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return (sign * value).astype(np.float32)


def _fp8_rel_l2(out: Path, model: Path, module: str) -> float:
    ck, src = Checkpoint.open(out), Checkpoint.open(model)
    codes, scale = ck.read(module + ".weight").view(np.uint8), ck.read(module + ".weight_scale_inv")
    w = _e4m3(codes) * np.kron(scale, np.ones((128, 128), np.float32))[: codes.shape[0], : codes.shape[1]]
    ref = (src.read(module + ".weight").view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return float(np.linalg.norm(w - ref) / np.linalg.norm(ref))


def test_failed_verification_page(pages, tmp_path):
    """The page of a failed run: the verdict, every problem line, the failed layer marked."""
    from ktconvert.verification.report_html import write_report

    _, result = pages["cpu"]
    data = result.to_dict()
    layer = data["numerics"]["layers"][1]["layer"]
    lines = [f"layer {layer}: MoE output vs source: relative L2 {0.9:.4g} > limit", "model-00002-of-00005.safetensors: "
             "sha256 differs from ktconvert.json " + "0123456789abcdef" * 4]
    data.update(ok=False, problems=lines)
    data["numerics"] = {**data["numerics"], "problems": lines[:1]}
    page = write_report(tmp_path / "failed.html", data)
    m = render(page, tmp_path)
    _layout_ok("failed", m, min_cell=24)
    assert "verification FAILED: 2 problem lines" in m["text"] and all(line in m["text"] for line in lines)
    assert re.search(rf"^{layer}\tFAILED\t", m["text"], re.M)


def test_inplace_page(pages, tmp_path):
    path, _ = pages["bf16"]
    _layout_ok("bf16", render(path, tmp_path), min_cell=24)


def test_expert_stats_page_scale_is_stated(pages, tmp_path):
    path, _ = pages["stats"]
    m = render(path, tmp_path)
    _layout_ok("stats", m, min_cell=24)
    text = m["text"]
    assert "Routed share per expert" in text
    assert "Colour: 0% (dark) to 3x the uniform share of 12.5% (8 experts) or more (bright)." in text
    assert "top 1 expert (%)" in text


def test_the_measurements_see_overlaps(tmp_path):
    """The layout assertions can fail: overlapping blocks, overlapping plot labels, a label outside its plot and
    a page wider than the window are each reported."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><p>first block</p><p style="margin-top:-1.5em">second block</p>'
                    '<svg xmlns="http://www.w3.org/2000/svg" width="200" height="60"><text x="10" y="20">one</text>'
                    '<text x="14" y="22">two</text><text x="180" y="40">outside the plot</text></svg>'
                    '<div style="width:2000px">wide</div></body></html>')
    m = render(page, tmp_path)
    pairs = [" / ".join(p) for p in m["overlaps"]]
    assert any("first block" in p and "second block" in p for p in pairs), pairs
    assert any('"one"' in p and '"two"' in p for p in pairs), pairs
    assert m["outside"] == ['text "outside the plot"'] and m["width"] > WINDOW[0]

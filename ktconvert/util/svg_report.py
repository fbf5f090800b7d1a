"""Self-contained HTML reports: building blocks that return HTML text, plots as inline SVG (no scripts, no
external resources, no plotting library).

    page(title, [section(heading, table(...), heat_map(...), line_chart(...)), ...])  -> the whole document

* ``heat_map(values [rows, cols], ...)``: one coloured cell per value (NaN: "no data", hatched grey), a colour
  bar, a tooltip (``<title>``) per cell; large maps keep a readable size by shrinking cells; ``scale=(lo, hi)``
  fixes the colours' range (values beyond it take the end colours, the bar says so).
* ``line_chart({name: [(x, y), ...]}, ...)``: polylines with axes, ticks and a legend; each series has its own
  colour, dash pattern and marker size, so curves that coincide stay visible; ``limits`` adds dashed
  horizontal lines (thresholds).
* ``count(n, noun)``: "1 expert", "3 experts".
* ``table(header, rows)``: numbers right-aligned; ``bullets(items)``: a list; ``status(ok, text)``: a verdict line.

Every plot is a ``<figure class="plot" data-kind="heatmap|line">`` holding one ``<svg>`` that is well-formed XML,
so a reader (or a test) can count and parse them; ``group=`` adds ``data-group`` (which part of a page a plot
belongs to) and keeps the ids inside one heat map's SVG distinct from another's. Text is escaped; the output
depends only on the arguments.
"""
from __future__ import annotations

import html
import math

import numpy as np

# sequential palette (dark blue -> teal -> yellow), interpolated linearly in RGB
_PALETTE = ((0.0, (38, 24, 95)), (0.35, (33, 110, 140)), (0.7, (94, 187, 111)), (1.0, (246, 230, 68)))
_SERIES_DASHES = ("", "7 4", "2 3", "10 3 2 3")        # cycled with the colours: coinciding curves stay visible
_SERIES_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf")
MAX_MARKERS = 64
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:2px 8px}
td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f4f4f4}
figure.plot{margin:1em 0}figcaption{font-size:.9em;color:#555}p.note{color:#555;font-size:.9em}
svg text{font-family:system-ui,sans-serif}p.status{font-size:1.2em;font-weight:bold;padding:.3em .6em}
p.status.ok{background:#e3f4e1;color:#1d5e1a}p.status.failed{background:#fbe3e1;color:#8a1c12}"""


def esc(value) -> str:
    """Text or attribute value escaped for HTML and XML."""
    return html.escape(str(value), quote=True)


def count(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless n is 1 ("1 expert", "8 experts")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def fmt(value) -> str:
    """Numbers for tables and labels: ints as is, floats with 4 significant digits."""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return "nan" if math.isnan(value) else f"{float(value):.4g}"
    return str(value)


# ---------------------------------------------------------------------------------------------- document

def page(title: str, sections: list[str], subtitle: str = "") -> str:
    """The complete HTML5 document: inline CSS, `sections` (HTML fragments) in order."""
    sub = f"<p>{esc(subtitle)}</p>\n" if subtitle else ""
    body = "\n".join(sections)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{esc(title)}</title>\n'
            f"<style>{_CSS}</style>\n</head>\n<body>\n<h1>{esc(title)}</h1>\n{sub}{body}\n</body>\n</html>\n")


def section(heading: str, *parts: str, note: str = "") -> str:
    """A titled part of the page: heading, optional explanatory note, then the fragments."""
    text = f'<p class="note">{esc(note)}</p>\n' if note else ""
    return f"<section>\n<h2>{esc(heading)}</h2>\n{text}" + "\n".join(parts) + "\n</section>"


def table(header: list, rows: list[list], caption: str = "") -> str:
    """An HTML table; numeric cells right-aligned (formatted with fmt)."""
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>\n" for row in rows)
    return f"<table>{cap}<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table>"


def bullets(items: list) -> str:
    """An unordered list of `items` (text, escaped)."""
    return "<ul>\n" + "".join(f"<li>{esc(item)}</li>\n" for item in items) + "</ul>"


def status(ok: bool, text: str) -> str:
    """A verdict line, green when `ok`, red otherwise."""
    return f'<p class="status {"ok" if ok else "failed"}">{esc(text)}</p>'


def _cell(value) -> str:
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return f'<td class="num">{esc(fmt(value))}</td>'
    return f"<td>{esc(value)}</td>"


def _figure(kind: str, svg: str, caption: str, group: str = "") -> str:
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    data = f' data-group="{esc(group)}"' if group else ""
    return f'<figure class="plot" data-kind="{kind}"{data}>\n{svg}\n{cap}</figure>'


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}">\n'
            + "\n".join(body) + "\n</svg>")


def _text(x: float, y: float, text, size: int = 11, anchor: str = "start", rotate: bool = False) -> str:
    turn = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{turn}>'
            f"{esc(text)}</text>")


# ---------------------------------------------------------------------------------------------- heat map

def colour(t: float) -> str:
    """Palette colour for t in [0, 1] as #rrggbb."""
    t = min(1.0, max(0.0, float(t)))
    for (t0, c0), (t1, c1) in zip(_PALETTE, _PALETTE[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(c0, c1))
    return "#%02x%02x%02x" % _PALETTE[-1][1]


def heat_map(values, *, row_labels: list | None = None, col_labels: list | None = None, title: str = "",
             x_label: str = "", y_label: str = "", value_label: str = "value", caption: str = "",
             max_width: int = 1100, max_cell: int = 32, group: str = "", scale: tuple | None = None) -> str:
    """A heat map figure of `values` (2-D array-like [rows, cols], NaN = no data). Rows top to bottom, columns
    left to right; colour linear from the smallest to the largest finite value, or over `scale` (lo, hi) when
    given (values outside take the end colours; the bar's end label reads "≥ hi" when some value is above).
    Each cell's tooltip names its row label, column label and value. group: the figure's data-group, also the
    suffix of its "no data" pattern id (give each heat map of a page its own)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"heat map needs a 2-D array, got shape {v.shape}")
    rows, cols = v.shape
    row_labels = [str(r) for r in (row_labels if row_labels is not None else range(rows))]
    col_labels = [str(c) for c in (col_labels if col_labels is not None else range(cols))]
    cell_w = max(1.0, min(float(max_cell), (max_width - 170) / max(cols, 1)))
    cell_h = max(2.0, min(float(max_cell), 600 / max(rows, 1), cell_w * 3))
    left, top = 70.0, 30.0 if title else 12.0
    finite = v[np.isfinite(v)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    above = False
    if scale is not None:
        above = bool(finite.size) and hi > float(scale[1])
        lo, hi = float(scale[0]), float(scale[1])
    span = hi - lo if hi > lo else 1.0
    nodata = f"nodata-{group}" if group else "nodata"
    body = [f'<defs><pattern id="{esc(nodata)}" width="4" height="4" patternUnits="userSpaceOnUse">'
            '<rect width="4" height="4" fill="#eee"/><path d="M0 4L4 0" stroke="#bbb" stroke-width="0.7"/>'
            "</pattern></defs>"]
    if title:
        body.append(_text(left, 18, title, 13))
    for r in range(rows):
        for c in range(cols):
            x, y = left + c * cell_w, top + r * cell_h
            val = v[r, c]
            fill = f"url(#{esc(nodata)})" if not math.isfinite(val) else colour((val - lo) / span)
            tip = f"{y_label or 'row'} {row_labels[r]}, {x_label or 'column'} {col_labels[c]}: " \
                  f"{'no data' if not math.isfinite(val) else fmt(val)}"
            body.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{cell_w:.2f}" height="{cell_h:.2f}" '
                        f'fill="{fill}"><title>{esc(tip)}</title></rect>')
    grid_w, grid_h = cols * cell_w, rows * cell_h
    body += _heat_labels(row_labels, col_labels, left, top, cell_w, cell_h)
    if x_label:
        body.append(_text(left + grid_w / 2, top + grid_h + 32, x_label, 11, "middle"))
    if y_label:
        body.append(_text(14, top + grid_h / 2, y_label, 11, "middle", rotate=True))
    bar_top = top + grid_h + (48 if x_label else 30)
    body += _colour_bar(left, bar_top, min(max(grid_w, 160.0), 320.0), lo, hi, value_label, above)
    width = max(left + grid_w + 20, left + 340 + 7 * len(value_label))
    return _figure("heatmap", _svg(width, bar_top + 30, body, title or "heat map"), caption, group)


def _heat_labels(row_labels, col_labels, left, top, cell_w, cell_h) -> list[str]:
    """Tick labels every few rows / columns, so they never overlap."""
    out = []
    row_step = max(1, math.ceil(12 / cell_h))
    for r in range(0, len(row_labels), row_step):
        out.append(_text(left - 4, top + (r + 0.5) * cell_h + 4, row_labels[r], 10, "end"))
    col_step = max(1, math.ceil(28 / cell_w))
    for c in range(0, len(col_labels), col_step):
        out.append(_text(left + (c + 0.5) * cell_w, top + len(row_labels) * cell_h + 14, col_labels[c], 10,
                         "middle"))
    return out


def _colour_bar(x, top, width, lo, hi, label, above: bool = False) -> list[str]:
    """A horizontal colour bar from lo (left) to hi (right, "≥ hi" when values beyond it share its colour) with
    its label after it."""
    steps = 32
    out = [f'<rect x="{x + i * width / steps:.2f}" y="{top:.1f}" width="{width / steps + 0.5:.2f}" height="10" '
           f'fill="{colour(i / (steps - 1))}"/>' for i in range(steps)]
    out.append(_text(x, top + 22, fmt(lo), 10))
    out.append(_text(x + width, top + 22, ("≥ " if above else "") + fmt(hi), 10, "end"))
    out.append(_text(x + width + 10, top + 9, label, 10))
    return out


# ---------------------------------------------------------------------------------------------- line chart

def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten; at least 1 if integer)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    step = max(step, 1.0) if integer else step
    start = math.ceil(lo / step - 1e-9) * step
    ticks = []
    while start <= hi + step * 1e-9:
        ticks.append(round(start, 12))
        start += step
    return ticks


def line_chart(series: dict, *, title: str = "", x_label: str = "", y_label: str = "", caption: str = "",
               y_min: float | None = None, y_max: float | None = None, width: int = 720, height: int = 320,
               limits: dict | None = None, group: str = "") -> str:
    """A line chart figure: `series` maps a legend name to [(x, y), ...] (points with NaN y are skipped; a
    series with one point is drawn as a dot; points get a marker with a tooltip when a series has at most
    MAX_MARKERS). limits: {legend name: y} drawn as dashed horizontal lines (thresholds; None values skipped).
    y range: the data's and the limits', unless y_min / y_max are given. group: the figure's data-group."""
    points = {name: [(float(x), float(y)) for x, y in pts if math.isfinite(float(y))] for name, pts in series.items()}
    levels = {name: float(y) for name, y in (limits or {}).items() if y is not None and math.isfinite(float(y))}
    xs = [x for pts in points.values() for x, _ in pts]
    ys = [y for pts in points.values() for _, y in pts] + list(levels.values())
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    y_lo = y_min if y_min is not None else (min(ys) if ys else 0.0)
    y_hi = y_max if y_max is not None else (max(ys) if ys else 1.0)
    x_hi, y_hi = (x_hi if x_hi > x_lo else x_lo + 1.0), (y_hi if y_hi > y_lo else y_lo + 1.0)
    left, top, bottom = 64.0, 30.0 if title else 12.0, 46.0
    right = 40.0 + 6.5 * max((len(str(name)) for name in [*points, *levels]), default=0)
    pw, ph = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y):
        return top + ph - (y - y_lo) / (y_hi - y_lo) * ph

    body = [_text(left, 18, title, 13)] if title else []
    body.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for t in nice_ticks(y_lo, y_hi):
        if y_lo <= t <= y_hi:
            body.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>')
            body.append(_text(left - 6, sy(t) + 4, fmt(t), 10, "end"))
    integer_x = all(float(x).is_integer() for x in xs)
    for t in nice_ticks(x_lo, x_hi, 8, integer=integer_x):
        if x_lo <= t <= x_hi:
            body.append(_text(sx(t), top + ph + 16, fmt(t), 10, "middle"))
    legend = []
    for i, (name, pts) in enumerate(points.items()):
        c = _SERIES_COLOURS[i % len(_SERIES_COLOURS)]
        dash = _SERIES_DASHES[i % len(_SERIES_DASHES)]
        style = f' stroke-dasharray="{dash}"' if dash else ""
        if len(pts) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            body.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6"{style} points="{path}">'
                        f"<title>{esc(name)}</title></polyline>")
        if len(pts) <= MAX_MARKERS:
            # later series: larger hollow rings around the earlier dots, so equal points show every series
            ring = f'r="{2.2 + 1.6 * (i % 4):.1f}" fill="{c}"' if i % 4 == 0 else \
                f'r="{2.2 + 1.6 * (i % 4):.1f}" fill="none" stroke="{c}" stroke-width="1.2"'
            body += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" {ring}><title>{esc(name)}: '
                     f"{esc(fmt(x))}, {esc(fmt(y))}</title></circle>" for x, y in pts]
        legend.append((name, c, style))
    for name, y in levels.items():
        if y_lo <= y <= y_hi:
            body.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#555" '
                        f'stroke-dasharray="6 4"><title>{esc(name)}: {esc(fmt(y))}</title></line>')
        legend.append((name, "#555", ' stroke-dasharray="6 4"'))
    body += _legend(legend, left + pw, top)
    if x_label:
        body.append(_text(left + pw / 2, height - 8, x_label, 11, "middle"))
    if y_label:
        body.append(_text(14, top + ph / 2, y_label, 11, "middle", rotate=True))
    return _figure("line", _svg(width, height, body, title or "line chart"), caption, group)


def _legend(entries: list[tuple[str, str, str]], x: float, top: float) -> list[str]:
    """One legend row per (name, colour, extra line attributes), right of the plot area at `x`."""
    out = []
    for i, (name, c, style) in enumerate(entries):
        ly = top + 8 + 16 * i
        out.append(f'<line x1="{x + 12}" x2="{x + 30}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"{style}/>')
        out.append(_text(x + 34, ly + 4, name, 10))
    return out

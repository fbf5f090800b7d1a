"""`ktconvert inspect`: what a checkpoint is, from its headers and config.json only (no tensor data read).

inspect(path) -> dict (JSON-ready): the source's own description (``Source.describe_path``: files, dtypes,
quantization, bytes per component, layers, experts, expert layout) plus, per kt-kernel method, the method
registry's verdict on it. render(dict) -> text table.
"""
from __future__ import annotations

from ktconvert.formats.sources import source_class
from ktconvert.methods import all_methods

def kt_methods(source) -> dict[str, str]:
    """kt-kernel method -> "as is (...)" / "convert: ..." / "no: why", for an opened source (the method registry's
    verdicts, kt-format.md §1.1, §2.6-2.8)."""
    return {m.kt_method: m.inspect_line(source) for m in all_methods()}


def inspect(path, expert_orientation: str | None = None) -> dict:
    """Describe checkpoint `path` (any registered source format) from headers + config. See render().
    expert_orientation: ``--expert-orientation`` for square fused expert tensors."""
    description, source = source_class(path).describe_path(path, expert_orientation)
    if source is not None:
        description["kt_methods"] = kt_methods(source)
    return description


def _gb(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _layout_rows(title: str, el: dict) -> list[tuple[str, str]]:
    """Rows for one detected expert layout: kind (+ the family's usual one when different), names, and per
    fused tensor its stored shape, orientation and why."""
    if not el:
        return [(title, "none present")]
    kind = el["form"] + ("" if el.get("family_usual") in (None, el["form"]) else
                         f" (the family usually stores {el['family_usual']})")
    rows = [(title, kind + (", with biases" if el.get("biases") else "")
             + (", gate/up interleaved" if el.get("interleaved_gate_up") else ""))]
    if "pattern" in el:
        rows.append(("  names", el["pattern"]))
    for role, name in el.get("tensors", {}).items():
        o = el.get("orientation", {}).get(role)
        rows.append((f"  {role}", name if o is None else
                     f"{name} {o['stored']} ({o['orientation']}-major): {o['why']}"))
    if "problem" in el:
        rows.append(("  problem", el["problem"]))
    return rows


def render(result: dict) -> str:
    """The inspect dict as an aligned text report."""
    rows = [("path", result["path"]),
            ("files", f"{result['files']} ({_gb(result['file_bytes'])}), {result['tensors']} tensors"),
            ("model_type", str(result.get("model_type"))),
            ("family", str(result.get("family")) if result.get("supported") else f"unsupported: {result['reason']}")]
    rows.append(("dtypes", ", ".join(f"{k} {_gb(v)}" for k, v in result["dtypes"].items())))
    q = result.get("quantization")
    rows.append(("quantization", "none" if not q else ", ".join(f"{k}={v}" for k, v in q.items())))
    if result.get("supported"):
        lay = result["layers"]
        rows += [("input format", result["input_format"]),
                 ("layers", f"{lay['total']}: dense {_ranges(lay['dense'])}; MoE {_ranges(lay['moe'])}; "
                            f"MTP {_ranges(lay['mtp'])}"),
                 ("experts", f"{result['experts']} routed, {result['experts_per_tok']} per token, "
                             f"{result['shared_experts']} shared"),
                 ("H, I", f"hidden {result['hidden']}, expert intermediate {result['intermediate']}")]
        rows += _layout_rows("expert layout", result["expert_layout"])
        if "mtp" in result["expert_layout"]:
            rows += _layout_rows("MTP expert layout", result["expert_layout"]["mtp"])
    rows.append(("bytes", ""))
    rows += [(f"  {k}", _gb(v)) for k, v in result["components"].items()]
    if result.get("supported"):
        rows.append(("kt-kernel methods", ""))
        rows += [(f"  {k}", v) for k, v in result["kt_methods"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}".rstrip() for k, v in rows)

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


def inspect(path) -> dict:
    """Describe checkpoint `path` (any registered source format) from headers + config. See render()."""
    description, source = source_class(path).describe_path(path)
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
        el = result["expert_layout"]
        desc = el["form"] + (f" ({el['pattern']})" if "pattern" in el else "")
        if el["form"] == "fused":
            desc += (f": gate_up {el.get('gate_up', '?')}, down {el.get('down', '?')}"
                     + (", gate/up interleaved" if el.get("interleaved_gate_up") else ""))
            desc += "" if "orientation" not in el else f" {el['orientation']}"
        rows.append(("expert layout", desc + (", with biases" if el.get("biases") else "")))
        rows += [("  note", a) for a in el.get("ambiguous", [])]
    rows.append(("bytes", ""))
    rows += [(f"  {k}", _gb(v)) for k, v in result["components"].items()]
    if result.get("supported"):
        rows.append(("kt-kernel methods", ""))
        rows += [(f"  {k}", v) for k, v in result["kt_methods"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}".rstrip() for k, v in rows)

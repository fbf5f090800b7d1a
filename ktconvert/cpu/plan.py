"""`ktconvert plan`: what a CPU conversion would write, checked before any weight is read.

plan(...) -> dict raises on every problem (bad NUMA count with the valid ones listed, missing or misshapen expert
tensors, too little disk at OUT); pipeline.convert_cpu calls it first. render(dict) -> text.

Sizes (kt-format.md §2.0-2.2, §3.3, §3.4): AMX part matrices gate/up [n=I/T, k=H], down [n=H, k=I/T]; INT4 quant
n*k/2 bytes, INT8 n*k, scales 4n. Merged shards are exact (headers built as the writer builds them); the index is
exact; ktconvert.json is an estimate. In-place methods (bf16, fp8, rawint4) report expert bytes in kt-kernel's
native HF tensor formats.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ktconvert.errors import OutputError, UsageError
from ktconvert.formats.kt_sink import copy_sources
from ktconvert.formats.st_writer import build_header
from ktconvert.formats.sources import open_source
from ktconvert.envinfo import cpu_flags
from ktconvert.layouts.naming import INDEX_NAME, PROJS, kt_relpath, merged_key, part_shape, shard_name
from ktconvert.methods import METHODS
from ktconvert.methods.base import check

PROCESS_BASE_BYTES = 160 << 20  # interpreter + numpy + modules, measured order of magnitude
READ_CHUNK_BYTES = 16 << 20     # formats/stream.py CHUNK
JOBS_PER_WORKER = 2             # runner._throttle keeps at most 2 jobs per worker in flight


def _part_sizes(method, hidden: int, inter: int, numa: int) -> dict[str, dict[str, int]]:
    """{proj: method.matrix_bytes of one NUMA part's [n, k]}: gate/up [I/T, H], down [H, I/T]."""
    return {p: method.matrix_bytes(*part_shape(p, hidden, inter, numa)) for p in PROJS}


def _merged_files(layers: list[int], method, hidden: int, inter: int, numa: int, experts: int) -> list[dict]:
    """One shard per layer: exact bytes (the writer's own header construction + data)."""
    sizes = _part_sizes(method, hidden, inter, numa)
    files, by_digits = [], {}
    for i, layer in enumerate(layers, start=1):
        key = len(str(layer))
        if key not in by_digits:
            specs = [spec for p in PROJS for e in range(experts) for t in range(numa) for spec in (
                (merged_key(layer, p, e, t, "weight"), "I8", (sizes[p]["quant"],)),
                (merged_key(layer, p, e, t, "scale"), "F32", (sizes[p]["scale"] // 4,)))]
            header, spans = build_header(specs, None)
            by_digits[key] = len(header) + sum(e - b for b, e in spans.values())
        files.append({"path": shard_name(i, len(layers)), "bytes": by_digits[key], "layer": layer})
    return files


def _index_bytes(layers: list[int], experts: int, numa: int, shard_bytes: list[dict], data_total: int) -> int:
    """Exact size of model.safetensors.index.json as json.dumps(indent=2, sort_keys=True) + "\\n" writes it.

    One line per key: 4 spaces, the quoted key, ": ", the quoted shard name, and ",\\n" (the last "\\n")."""
    digits_e = sum(len(str(e)) for e in range(experts))
    digits_t = sum(len(str(t)) for t in range(numa))
    n_entries, body = 0, 0
    for i, layer in enumerate(layers):
        line_fixed = len(shard_bytes[i]["path"]) + 10    # 4 spaces, 4 quotes, ": "
        for p in PROJS:
            for part in ("weight", "scale"):
                base = len(merged_key(layer, p, "", "", part))   # the key without its E and t digits
                body += experts * numa * (base + line_fixed) + numa * digits_e + experts * digits_t
                n_entries += experts * numa
    head = len('{\n  "metadata": {\n    "total_size": %d\n  },\n  "weight_map": {\n' % data_total)
    return head + body + 2 * max(n_entries - 1, 0) + len("\n  }\n}\n")


def _copy_files(root: Path) -> list[dict]:
    return [{"path": n, "bytes": p.stat().st_size} for n, p in sorted(copy_sources(root).items())]


def _manifest_estimate(files: list[dict], n_tensors: int, n_sources: int, tensor_key_len: int) -> int:
    """ktconvert.json is written after the fact; estimate: fixed part + one line per file, tensor, source."""
    per_file = sum(len(f["path"]) for f in files) + len(files) * 190
    return 3000 + per_file + n_sources * 150 + n_tensors * (tensor_key_len + 76)


def _peak_ram(source, hidden: int, inter: int, numa: int, threads: int | None) -> dict:
    """A small multiple of one expert matrix per worker: source bytes + BF16 + float32 part work + output."""
    elems = max(len(job.projs) for job in source.matrix_jobs(source.all_layers()[:1])) * inter * hidden
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}.get(source.input_format, 2)
    part = elems // max(numa, 1)
    per_job = elems * itemsize + 2 * elems + 13 * part + 2 * elems
    workers = threads or os.cpu_count() or 1
    total = PROCESS_BASE_BYTES + READ_CHUNK_BYTES + JOBS_PER_WORKER * workers * per_job
    return {"peak_ram_bytes": total, "per_job_bytes": per_job, "workers": workers}


def _free_at(path: Path) -> tuple[str, int]:
    """(existing directory probed, free bytes) for `path` or its nearest existing ancestor."""
    probe = Path(path).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return str(probe), shutil.disk_usage(probe).free


# ---------------------------------------------------------------- plan

def plan(src, method: str, numa: int = 1, layout: str = "safetensors", group_size: int | None = None,
         include_mtp: bool = False, out=None, threads: int | None = None,
         expert_orientation: str | None = None) -> dict:
    """Plan converting the routed experts of `src` with `method` for T = `numa` NUMA parts into `layout`.

    Raises ShapeError (bad T: lists the valid ones; bad expert shapes), InputError (missing/unsupported
    tensors), OutputError (less free disk at `out` than the output needs), UsageError (a layout or group size the
    method does not have). Reads headers and config only.
    Returns: method, kt_method, numa, layout, layers, experts, hidden, intermediate, files [{path, bytes}]
    (merged; kt: summary + files when few), total_bytes, peak_ram_bytes, disk_free_bytes, checks, notes, ...
    """
    m = METHODS.get(method).configured(group_size)
    if layout not in m.layouts:
        raise UsageError(f"--layout {layout} does not exist for {m.kt_method}", expected=" or ".join(m.layouts))
    source = open_source(src, expert_orientation)  # HF safetensors or GGUF (formats.base.SOURCES)
    info = source.info
    H, I, E = info.hidden, info.intermediate, info.n_experts
    checks = m.check_numa(H, I, numa)
    source.validate(include_mtp=include_mtp)
    checks.append(check("every expert tensor present with config shapes", True,
                         f"{len(source.all_layers(include_mtp))} layers x {E} experts"))
    layers = list(source.all_layers(include_mtp))
    result = {
        "source": str(src), "family": info.family, "model_type": info.model_type,
        "input_format": source.input_format, "method": m.name, "numa": numa, "layout": layout,
        "group_size": m.group_size, "layers": layers, "mtp_layers": [layer for layer in layers if layer >= info.n_layers],
        "experts": E, "hidden": H, "intermediate": I, "expert_bytes": m.expert_bytes(H, I, numa),
        "source_config_sha256": source.config_sha256(), "notes": [], "checks": checks, "kt_method": m.kt_method,
    }
    _add_files(result, source, layers, m, layout)
    result.update(_peak_ram(source, H, I, numa, threads))
    _add_disk(result, source, out)
    if source.has_expert_biases():
        result["notes"].append("the experts have biases: kt-kernel's " + m.kt_method + " files carry no bias "
                               "(`cpu` refuses non-zero biases unless --allow-drop-bias)")
    if info.mtp_layers and not include_mtp and source.present_mtp_layers():
        result["notes"].append(f"MTP layers {list(source.present_mtp_layers())} not converted (--include-mtp)")
    result["notes"] += m.runtime_notes(cpu_flags())
    return result


def _add_files(result: dict, source, layers: list[int], method, layout: str) -> None:
    H, I, E, T = result["hidden"], result["intermediate"], result["experts"], result["numa"]
    if not method.needs_conversion:
        result["files"] = []
        result["summary"] = {"expert_bytes_per_layer": E * result["expert_bytes"],
                             "format": f"kt-kernel {method.kt_method} reads HF per-expert tensors in place"}
        result["total_bytes"] = len(layers) * E * result["expert_bytes"]
        result["notes"].append(f"{method.name}: sizes are the expert tensors only, in kt-kernel's native HF format")
        return
    n_tensors = len(layers) * 3 * E * T * 2
    if layout == "safetensors":
        files = _merged_files(layers, method, H, I, T, E)
        data = len(layers) * E * result["expert_bytes"]
        files.append({"path": INDEX_NAME, "bytes": _index_bytes(layers, E, T, files, data)})
        files += _copy_files(source.root)
    else:
        files = _kt_files(layers, method, H, I, T, E, result)
    key_len = len(merged_key(layers[-1], "gate", E - 1, T - 1, "weight")) if layers else 0
    est = _manifest_estimate(files, n_tensors, len(source.files()), key_len)
    files.append({"path": "ktconvert.json", "bytes": est, "approx": True})
    result["files"] = files
    result["file_count"] = result.get("file_count", 0) + len(files)
    result["total_bytes"] = result.get("tree_bytes", 0) + sum(f["bytes"] for f in files)


def _kt_files(layers, method, H, I, T, E, result) -> list[dict]:
    """The .kt tree: counted, listed only when small (<= 64 files)."""
    prefix = method.file_prefix
    sizes = _part_sizes(method, H, I, T)
    count = len(layers) * T * E * 3 * 2
    tree = [{"path": kt_relpath(layer, t, prefix, p, e, b, part), "bytes": b}
            for layer in layers for t in range(T) for p in PROJS for e in range(E)
            for part, b in (("quant", sizes[p]["quant"]), ("scale", sizes[p]["scale"]))] if count <= 64 else []
    result["summary"] = {"kt_files": count, "per_part_bytes": sizes,
                         "example": kt_relpath(layers[0], 0, prefix, "gate", 0, sizes["gate"]["quant"], "quant")
                         if layers else None,
                         "pattern": "_layer_{L}/_numa_{t}/" + prefix + "_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt"}
    if not tree:
        result["file_count"] = count
        result["tree_bytes"] = len(layers) * E * result["expert_bytes"]
    return tree


def _add_disk(result: dict, source, out) -> None:
    probe, free = _free_at(Path(out) if out else Path(source.root))
    result["disk_path"], result["disk_free_bytes"] = probe, free
    enough = free >= result["total_bytes"]
    result["checks"].append(check("free disk >= output bytes" + ("" if out else " (source filesystem)"), enough,
                                   f"free {free}, need {result['total_bytes']}"))
    if out and not enough:
        raise OutputError("not enough free disk space for the output", file=str(out),
                          expected=f">= {result['total_bytes']} bytes free", found=f"{free} bytes at {probe}")


# ---------------------------------------------------------------- render

def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB" if n >= 1 << 26 else f"{n / (1 << 20):.2f} MiB"


def render(result: dict) -> str:
    """The plan dict as text."""
    lines = [f"plan: {result['source']} ({result['family']}, {result['input_format']}) -> "
             f"{result['kt_method']} T={result['numa']} layout={result['layout']}",
             f"layers: {len(result['layers'])} ({', '.join(map(str, result['layers'][:12]))}"
             f"{' ...' if len(result['layers']) > 12 else ''}), {result['experts']} experts, "
             f"H={result['hidden']}, I={result['intermediate']}",
             f"per expert: {result['expert_bytes']} bytes"]
    files = result.get("files", [])
    shown = files if len(files) <= 12 else files[:5] + [{"path": "...", "bytes": 0}] + files[-6:]
    lines.append(f"files: {result.get('file_count', len(files))}")
    for f in shown:
        lines.append(f"  {f['path']:<48} {'' if f['path'] == '...' else f['bytes']}"
                     f"{' (approx)' if f.get('approx') else ''}")
    if "summary" in result:
        lines += [f"  {k}: {v}" for k, v in result["summary"].items()]
    lines += [f"total: {result['total_bytes']} bytes ({_gib(result['total_bytes'])})",
              f"peak RAM (estimate): {_gib(result['peak_ram_bytes'])} with {result['workers']} workers",
              f"disk free at {result['disk_path']}: {_gib(result['disk_free_bytes'])}",
              "checks:"]
    lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}" for c in result["checks"]]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)

"""What a CPU output will occupy, computed from shapes and names alone (no weight read): exact shard and index
sizes, the .kt tree, files copied from the source, an estimate of ktconvert.json, peak RAM and free disk.

Sizes (kt-format.md §2.0-2.2, §3.3, §3.4): part matrices gate/up [n=I/T, k=H], down [n=H, k=I/T]; merged shards
are exact (headers built as the writer builds them); the index is exact; ktconvert.json is an estimate.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ktconvert.formats.kt_sink import copy_sources
from ktconvert.formats.ordered_hash import PARK_BYTES
from ktconvert.formats.stream import CHUNK as READ_CHUNK_BYTES, HASH_BUDGET
from ktconvert.formats.st_writer import build_header
from ktconvert.layouts.naming import INDEX_NAME, PROJS, kt_relpath, merged_key, part_shape, shard_name
from ktconvert.run.read_loop import MAX_READERS

PROCESS_BASE_BYTES = 160 << 20  # interpreter + numpy + modules, measured order of magnitude
JOBS_PER_WORKER = 2             # runner._Pass._throttle keeps at most 2 jobs per worker in flight


def tile_files(report: dict, source, layers: list[int], method, layout: str) -> None:
    """Add files / file_count / total_bytes (and summary) of a converted-tiles output to the plan report."""
    H, I, E, T = report["hidden"], report["intermediate"], report["experts"], report["numa"]
    n_tensors = len(layers) * 3 * E * T * 2
    if layout == "safetensors":
        files = _merged_files(layers, method, H, I, T, E)
        data = len(layers) * E * report["expert_bytes"]
        files.append({"path": INDEX_NAME, "bytes": index_bytes(layers, E, T, files, data)})
        files += _copy_files(source.root)
    else:
        files = _kt_files(layers, method, H, I, T, E, report)
    key_len = len(merged_key(layers[-1], "gate", E - 1, T - 1, "weight")) if layers else 0
    est = _manifest_estimate(files, n_tensors, len(source.files()), key_len)
    files.append({"path": "ktconvert.json", "bytes": est, "approx": True})
    report["files"] = files
    report["file_count"] = report.get("file_count", 0) + len(files)
    report["total_bytes"] = report.get("tree_bytes", 0) + sum(f["bytes"] for f in files)


def hf_tensor_files(report: dict, layers: list[int], method) -> None:
    """Add the sizes of an in-place output (HF expert tensors) to the plan report."""
    E = report["experts"]
    report["files"] = []
    report["summary"] = {"expert_bytes_per_layer": E * report["expert_bytes"],
                         "format": f"kt-kernel {method.kt_method} reads HF per-expert tensors in place"}
    report["total_bytes"] = len(layers) * E * report["expert_bytes"]
    report["notes"].append(f"{method.name}: sizes are the expert tensors only, in kt-kernel's native HF format")


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


def index_bytes(layers: list[int], experts: int, numa: int, shard_bytes: list[dict], data_total: int) -> int:
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


def peak_ram(source, hidden: int, inter: int, numa: int, threads: int | None) -> dict:
    """A small multiple of one expert matrix per worker (source bytes + BF16 + float32 part work + output), plus
    the bytes queued for hashing the source (stream.HASH_BUDGET) and a read chunk per reading thread, plus two
    shards' parked copies (ordered_hash)."""
    elems = max(len(job.projs) for job in source.matrix_jobs(source.all_layers()[:1])) * inter * hidden
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}.get(source.input_format, 2)
    part = elems // max(numa, 1)
    per_job = elems * itemsize + 2 * elems + 13 * part + 2 * elems
    workers = threads or os.cpu_count() or 1
    readers = min(MAX_READERS, workers, len(source.files()))
    total = PROCESS_BASE_BYTES + HASH_BUDGET + readers * READ_CHUNK_BYTES + 2 * PARK_BYTES \
        + JOBS_PER_WORKER * workers * per_job
    return {"peak_ram_bytes": total, "per_job_bytes": per_job, "workers": workers}


def free_at(path: Path) -> tuple[str, int]:
    """(existing directory probed, free bytes) for `path` or its nearest existing ancestor."""
    probe = Path(path).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return str(probe), shutil.disk_usage(probe).free


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

"""What a CPU output will occupy, computed from shapes and names alone (no weight read): every file with its exact
bytes (the sink's own plan, ``planned_files``, from the method's ``tensor_specs``: shards with the writer's
headers, the index, the .kt tree, config and the copies from the source), an estimate of ktconvert.json, peak RAM
and free disk.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ktconvert.formats.kt_sink import KT_PARTS
from ktconvert.formats.ordered_hash import PARK_BYTES
from ktconvert.formats.stream import CHUNK as READ_CHUNK_BYTES, HASH_BUDGET
from ktconvert.run.read_loop import MAX_READERS

PROCESS_BASE_BYTES = 160 << 20  # interpreter + numpy + modules, measured order of magnitude
JOBS_PER_WORKER = 2             # runner._Pass._throttle keeps at most 2 jobs per worker in flight
LISTED_KT_FILES = 64            # a .kt tree of more files is counted, not listed


def output_files(report: dict, source, layers: list[int], method, options) -> None:
    """Add files / file_count / total_bytes (and summary) of the output of `method` with `options` (numa, layout,
    include_dense) to the plan report: the files of the sink's plan, then ktconvert.json (an estimate)."""
    sink = method.open_sink(None, layers, source.info, options.numa, options.layout, options.include_dense)
    dense = source.dense_tensors()[0] if options.include_dense else None
    planned = list(sink.planned_files(copy_from=source.side_files(), fallback_config=source.info.minimal_config(),
                                      dense=dense).values())
    kt_count = sum(1 for f in planned if _in_kt_tree(f))
    files = [{"path": f.path, "bytes": f.nbytes, **({"layer": f.layer} if f.tensors else {})} for f in planned
             if kt_count <= LISTED_KT_FILES or not _in_kt_tree(f)]
    if method.needs_conversion and options.layout == "kt":
        report["summary"] = _kt_summary(sink, layers, kt_count)
    elif not method.needs_conversion:
        report["summary"] = {"expert_bytes_per_layer": report["experts"] * report["expert_bytes"],
                             "format": getattr(sink, "files_format", None) or
                             f"kt-kernel {method.kt_method} reads HF per-expert tensors in place"}
    tensors = sink.layer_tensors(layers[-1]) if layers else []
    key_len = max((len(key) for key, _, _ in tensors), default=0)
    est = _manifest_estimate(files, len(layers) * len(tensors), len(source.files()), key_len)
    files.append({"path": "ktconvert.json", "bytes": est, "approx": True})
    report["files"] = files
    report["file_count"] = len(files) + (kt_count if kt_count > LISTED_KT_FILES else 0)
    report["total_bytes"] = sum(f.nbytes for f in planned) + est


def _in_kt_tree(f) -> bool:
    """A file of a .kt tree: a layer's file that is no safetensors shard."""
    return f.layer is not None and not f.tensors


def _kt_summary(sink, layers: list[int], count: int) -> dict:
    """The .kt tree in a few figures: file count, bytes per NUMA part's file, an example name and the pattern."""
    prefix = sink.method.file_prefix
    return {"kt_files": count,
            "per_part_bytes": {p: {KT_PARTS[s]: b for s, b in sink.part_bytes[p].items()} for p in sink.part_bytes},
            "example": sink.kt_file(layers[0], 0, "gate", 0, "weight") if layers else None,
            "pattern": "_layer_{L}/_numa_{t}/" + prefix + "_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt"}


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

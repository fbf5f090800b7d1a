"""The conversion loop: the one place that walks over a checkpoint's expert matrices.

    plan (validate everything, no weights read)
    → for each source file, front to back (hashing every byte once):
          decode one expert matrix to BF16 → split into NUMA parts → quantize + tile → sink writes it in place
          a layer whose last matrix is written is finished: its files renamed into place, the journal updated
    → index, config copies, manifest `ktconvert.json` (written last: its presence marks a complete output)

Memory: one matrix per worker plus a read chunk, independent of layers and experts. Bytes: every output tensor
has a fixed place, so neither the file order nor the thread count changes a byte.
"""
from __future__ import annotations

import os
import shutil
import threading
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from ktconvert.errors import InputError, OutputError
from ktconvert.formats.stream import HashingFileReader, MatrixJob, jobs_by_file
from ktconvert.formats.out_manifest import JOURNAL_NAME, MANIFEST_NAME
from ktconvert.journal import Journal


class _NullProgress:
    def start(self, *a, **k): ...
    def advance(self, *a, **k): ...
    def message(self, *a, **k): ...


def prepare_output(out: Path, src: Path, resume: bool, force: bool) -> None:
    """Create OUT, or accept it for --resume / empty it for --force. Refuses anything that could lose data."""
    out = out.resolve()
    if out == src.resolve() or src.resolve() in out.parents or out in src.resolve().parents:
        raise OutputError("output directory overlaps the source", file=out, hint="choose another OUT")
    if out.exists() and not out.is_dir():
        raise OutputError("output path exists and is not a directory", file=out)
    if out.exists() and any(out.iterdir()):
        if resume:
            if not (out / JOURNAL_NAME).exists() and not (out / MANIFEST_NAME).exists():
                raise OutputError("nothing to resume: no ktconvert journal in the output directory", file=out,
                                  hint="use --force to overwrite it")
        elif force:
            shutil.rmtree(out)
        else:
            raise OutputError("output directory exists and is not empty", file=out,
                              hint="pass --resume to continue an interrupted run, or --force to start over")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".ktconvert-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"output directory is not writable ({exc.strerror})", file=out) from exc


class _LayerTracker:
    """Counts each layer's outstanding jobs; a layer is finished when all its jobs were submitted and are done."""

    def __init__(self, jobs: list[MatrixJob]):
        self.remaining: dict[int, int] = defaultdict(int)
        for job in jobs:
            self.remaining[job.layer] += 1
        self.futures: dict[int, list[Future]] = defaultdict(list)

    def submitted(self, layer: int, future: Future | None) -> None:
        self.remaining[layer] -= 1
        if future is not None:
            self.futures[layer].append(future)

    def ready(self) -> list[int]:
        """Layers whose every job was submitted and has completed (errors re-raised here)."""
        done = []
        for layer, left in self.remaining.items():
            if left == 0 and all(f.done() for f in self.futures[layer]):
                for f in self.futures[layer]:
                    f.result()
                done.append(layer)
        for layer in done:
            del self.remaining[layer]
            self.futures.pop(layer, None)
        return sorted(done)


def _convert_matrix(source, method, numa: int, quant: str, writer, job: MatrixJob, raw) -> int:
    """Decode one job's bytes, split into NUMA parts, quantize and hand every part to the layer writer."""
    from ktconvert.layouts.numa import numa_slices

    mats = source.decode(job, raw)
    for proj, w in mats.items():
        where = f"layer {job.layer} expert {job.expert} {proj}"
        intermediate = w.shape[0] if proj in ("gate", "up") else w.shape[1]
        for t, sl in enumerate(numa_slices(intermediate, numa)):
            part = w[sl] if proj in ("gate", "up") else w[:, sl]
            blob, scale = method.quantize(part, threads=1, where=where, quant=quant)
            writer.put(proj, job.expert, t, blob, scale)
    return job.nbytes


def convert_cpu(src, out, *, method: str, numa: int = 1, layout: str = "safetensors", quant: str = "rtn",
                group_size: int = 128, threads: int | None = None, resume: bool = False, force: bool = False,
                include_dense: bool = False, include_mtp: bool = False, allow_drop_bias: bool = False,
                progress=None) -> str:
    """Convert the routed experts of checkpoint `src` for kt-kernel into directory `out`. Returns a summary line."""
    from ktconvert.formats.base import open_source
    from ktconvert.formats.kt_sink import KtSink
    from ktconvert.formats.out_manifest import write_manifest
    from ktconvert.plan import plan
    from ktconvert.quant.methods import METHODS

    progress = progress or _NullProgress()
    src_path, src_extra = resolve_source(str(src))
    the_plan = plan(str(src_path), method=method, numa=numa, layout=layout, group_size=group_size,
                    include_mtp=include_mtp, out=str(out))
    source = open_source(src_path)
    _check_biases(source, the_plan, allow_drop_bias)
    qmethod = METHODS.get(method)
    out_dir = Path(out)
    prepare_output(out_dir, src_path, resume, force)
    if resume and (out_dir / MANIFEST_NAME).exists() and not (out_dir / JOURNAL_NAME).exists():
        return f"{out_dir}: already complete (ktconvert.json present); nothing to do"

    layers = list(the_plan["layers"])
    options = {"method": qmethod.name, "numa": numa, "layout": layout, "quant": quant, "group_size": group_size,
               "include_dense": include_dense, "include_mtp": include_mtp, "layers": layers,
               "source_config_sha256": the_plan.get("source_config_sha256"), "source": src_extra}
    journal = Journal.start(out_dir, options, resume)
    info = source.info
    sink = KtSink(out_dir, layout, qmethod, numa, layers, info.n_experts, info.hidden, info.intermediate,
                  include_dense=include_dense)
    jobs = source.matrix_jobs(layers, include_dense=include_dense)
    todo_bytes = sum(j.nbytes for j in jobs if not journal.layer_done(j.layer))
    if journal.layers:
        progress.message(f"resuming: {len(journal.layers)} of {len(layers)} layers already done")
    progress.start(todo_bytes, len(layers) - len(journal.layers), f"convert {qmethod.kt_method} T={numa}")

    _run_jobs(jobs, source, sink, journal, qmethod, numa, quant, threads or os.cpu_count() or 1, progress)

    extra = sink.finalize(copy_from=_source_root(source))
    manifest = _cpu_manifest(qmethod, numa, layout, quant, include_dense, info, layers, journal, extra, source,
                             src_extra)
    write_manifest(out_dir, manifest)
    journal.remove()
    files = len(manifest["files"])
    total = sum(f["bytes"] for f in manifest["files"].values())
    return (f"wrote {out_dir}: {files} files, {total} bytes; run with --kt-method {qmethod.kt_method} "
            f"--kt-weight-path {out_dir} --kt-threadpool-count {numa}")


def _cpu_manifest(qmethod, numa, layout, quant, include_dense, info, layers, journal, extra, source,
                  src_extra) -> dict:
    """ktconvert.json from the journal (every layer's files and tensor hashes, every source file's digest)."""
    from ktconvert.formats.out_manifest import build_manifest, hash_file

    files = {rec.path: rec.entry() for rec in extra}
    tensors: dict[str, str] = {}
    for layer in layers:
        for rec in journal.layers[layer]["files"]:
            files[rec["path"]] = {k: v for k, v in rec.items() if k != "path"}
        tensors.update(journal.layers[layer]["tensors"])
    config = _source_root(source) / "config.json"
    src = {"config_sha256": hash_file(config)[1] if config.is_file() else None,
           "files": dict(sorted(journal.sources.items())), **src_extra}
    model = {"family": info.family, "model_type": info.model_type, "layers": layers, "experts": info.n_experts,
             "hidden": info.hidden, "intermediate": info.intermediate}
    return build_manifest(method=qmethod.kt_method, numa=numa, layout=layout, model=model, source=src,
                          files=files, tensors=tensors, quant=quant, include_dense=include_dense)


def _run_jobs(jobs, source, sink, journal, qmethod, numa, quant, workers, progress) -> None:
    """Read every source file front to back, converting jobs of unfinished layers on a thread pool."""
    tracker = _LayerTracker(jobs)
    writers: dict[int, object] = {}
    lock = threading.Lock()

    def writer_for(layer: int):
        with lock:
            if layer not in writers:
                writers[layer] = sink.begin_layer(layer)
            return writers[layer]

    def finish_ready() -> None:
        for layer in tracker.ready():
            if journal.layer_done(layer):
                continue
            result = writers.pop(layer).finish()
            files = [{"path": rec.path, **rec.entry()} for rec in result.files]
            journal.finish_layer(layer, files, result.tensors)
            progress.advance(0, items=1, detail=f"layer {layer}")

    fault = _FaultInjector.from_env()

    def work(job, raw):
        n = _convert_matrix(source, qmethod, numa, quant, writer_for(job.layer), job, raw)
        progress.advance(n)
        fault.tick()

    grouped = jobs_by_file(jobs)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for path in source.files():
                name = source.relative_name(path)
                file_jobs = grouped.get(path, [])
                if journal.source_digest(name) and all(journal.layer_done(j.layer) for j in file_jobs):
                    for job in file_jobs:
                        tracker.submitted(job.layer, None)
                    continue
                reader = HashingFileReader(path)
                try:
                    for job in file_jobs:
                        raw = reader.read_range(job.offset, job.nbytes)
                        if journal.layer_done(job.layer):
                            tracker.submitted(job.layer, None)
                            continue
                        _throttle(tracker, workers)
                        tracker.submitted(job.layer, pool.submit(work, job, raw))
                        finish_ready()
                    digest = reader.finish()
                finally:
                    reader.close()
                journal.finish_source(name, {"bytes": digest.bytes, "sha256": digest.sha256})
            _drain(tracker)
            finish_ready()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    missing = [layer for layer in tracker.remaining]
    if missing:
        raise InputError("some layers had no expert data in the source files", expected="every MoE layer",
                         found=f"layers {missing} unfinished")


class _FaultInjector:
    """Crash testing: KTCONVERT_FAULT_AFTER_JOBS=N makes the process SIGKILL itself after N converted matrices,
    exactly like a power cut or the OOM killer (no cleanup, no exception handlers)."""

    def __init__(self, after: int | None):
        self.after = after
        self.count = 0
        self.lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "_FaultInjector":
        value = os.environ.get("KTCONVERT_FAULT_AFTER_JOBS")
        return cls(int(value) if value else None)

    def tick(self) -> None:
        if self.after is None:
            return
        with self.lock:
            self.count += 1
            if self.count >= self.after:
                import signal

                os.kill(os.getpid(), signal.SIGKILL)


def _throttle(tracker: _LayerTracker, workers: int) -> None:
    """Bound memory: at most 2 jobs per worker in flight."""
    pending = [f for fs in tracker.futures.values() for f in fs if not f.done()]
    if len(pending) >= 2 * workers:
        wait(pending, return_when=FIRST_COMPLETED)


def _drain(tracker: _LayerTracker) -> None:
    pending = [f for fs in tracker.futures.values() for f in fs]
    wait(pending)


def _check_biases(source, the_plan: dict, allow_drop_bias: bool) -> None:
    """AMX formats carry no bias: refuse to silently drop non-zero expert biases."""
    nonzero = getattr(source, "nonzero_expert_biases", lambda layers: [])(the_plan["layers"])
    if nonzero and not allow_drop_bias:
        raise InputError(f"{len(nonzero)} expert bias tensors are non-zero and kt-kernel's "
                         f"{the_plan['method']} files carry no bias", tensor=nonzero[0],
                         hint="pass --allow-drop-bias to convert anyway (outputs will differ from the source)")


def resolve_source(src: str) -> tuple[Path, dict]:
    """A local path, or hf://ORG/NAME[@REV] / ms://ORG/NAME downloaded and verified first."""
    if src.startswith(("hf://", "ms://")):
        from ktconvert.hub import resolve_source as hub_resolve

        path, extra = hub_resolve(src)
        return Path(path), extra
    path = Path(src)
    if not path.exists():
        raise InputError("source does not exist", file=path)
    return path, {}


def _source_root(source) -> Path:
    root = getattr(source, "root", None)
    return Path(root) if root is not None else Path(source.checkpoint.root)

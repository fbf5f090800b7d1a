"""The conversion loop: the one place that walks over a checkpoint's expert matrices.

    plan (validate everything, no weights read)
    → for each source file, front to back (every byte hashed once, on its own thread):
          decode one expert matrix to BF16 → consumer: NUMA split + quantize + tile → sink writes it in place
          a layer whose last matrix is written is finished (files renamed into place) and journalled
    → index, config copies, manifest `ktconvert.json` (written last: its presence marks a complete output)

Memory: one matrix per worker plus a few read chunks, independent of layers and experts. Bytes: every output
tensor has a fixed place, so neither the file order nor the thread count changes a byte.
"""
from __future__ import annotations

import os
import shutil
import threading
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from ktconvert.errors import InputError, OutputError
from ktconvert.formats.out_manifest import JOURNAL_NAME, MANIFEST_NAME, sglang_args
from ktconvert.formats.stream import HashingFileReader, MatrixJob, jobs_by_file
from ktconvert.journal import Journal


class _NullProgress:
    def start(self, *a, **k): ...
    def advance(self, *a, **k): ...
    def message(self, *a, **k): ...


# ---------------------------------------------------------------------------------------------- output directory

def prepare_output(out: Path, src: Path, resume: bool, force: bool) -> None:
    """Create OUT, or accept it for --resume / empty it for --force. Refuses anything that could lose data."""
    out, src = out.resolve(), src.resolve()
    if out == src or src in out.parents or out in src.parents:
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


# ---------------------------------------------------------------------------------------------- consumers

class _LayerConsumer:
    """One layer of a CPU output: each expert matrix is written by the method (NUMA split + quantize + tile, or
    encoded whole for in-place methods) into the sink's layer writer."""

    def __init__(self, writer, method, numa: int, quant: str):
        self.writer, self.method, self.numa, self.quant = writer, method, numa, quant

    def put_matrix(self, proj: str, expert: int, w, where: str) -> None:
        """w: uint16 BF16 bits, gate/up [I, H], down [H, I]."""
        self.method.write_matrix(self.writer, proj, expert, w, numa=self.numa, quant=self.quant, where=where)

    def finish(self):
        return self.writer.finish()

    def abort(self) -> None:
        self.writer.abort()


class CpuOutput:
    """The CPU output being written: its sink, method and journal. begin_layer() gives a consumer with
    put_matrix / finish / abort; finalize() writes index, config copies and the manifest."""

    def __init__(self, out_dir: Path, method, the_plan: dict, source, *, numa: int, layout: str, quant: str,
                 include_dense: bool, journal: Journal, src_extra: dict):
        self.out_dir, self.numa, self.layout, self.quant = out_dir, numa, layout, quant
        self.include_dense, self.journal, self.source, self.src_extra = include_dense, journal, source, src_extra
        self.layers = list(the_plan["layers"])
        self.method = method
        self.sink = method.open_sink(out_dir, self.layers, source.info, numa, layout, include_dense)

    def begin_layer(self, layer: int):
        return _LayerConsumer(self.sink.begin_layer(layer), self.method, self.numa, self.quant)

    def layer_finished(self, layer: int, result) -> None:
        files = [{"path": rec.path, **rec.entry()} for rec in result.files]
        self.journal.finish_layer(layer, files, result.tensors)

    def finalize(self, expert_activation=None) -> dict:
        """Index, copies, dense shard, manifest; returns the manifest. expert_activation: the FileRecord of the
        expert_activation.pt a calibrated conversion wrote into OUT (recorded, and named in the SGLang flags)."""
        from ktconvert.formats.out_manifest import write_manifest

        if self.include_dense:
            self._write_dense()
        extra = self.sink.finalize(copy_from=self.source.root, fallback_config=self.source.info.minimal_config())
        manifest = self._manifest(extra + ([expert_activation] if expert_activation else []),
                                  expert_activation.path if expert_activation else None)
        write_manifest(self.out_dir, manifest)
        self.journal.remove()
        return manifest

    def _write_dense(self) -> None:
        """Non-expert tensors (kt-kernel's blk. renaming) into the last shard, one tensor at a time."""
        result = self.sink.write_dense(*self.source.dense_tensors())
        self.dense = {"files": [{"path": r.path, **r.entry()} for r in result.files], "tensors": result.tensors}

    def _manifest(self, extra, expert_activation: str | None = None) -> dict:
        from ktconvert.formats.fileio import hash_file
        from ktconvert.formats.out_manifest import build_manifest

        files = {rec.path: rec.entry() for rec in extra}
        tensors: dict[str, str] = {}
        records = [self.journal.layers[layer] for layer in self.layers]
        records += [self.dense] if self.include_dense else []
        for rec in records:
            for f in rec["files"]:
                files[f["path"]] = {k: v for k, v in f.items() if k != "path"}
            tensors.update(rec["tensors"])
        info = self.source.info
        config = source_root(self.source) / "config.json"
        src = {"config_sha256": hash_file(config)[1] if config.is_file() else None,
               "files": dict(sorted(self.journal.sources.items())), **self.src_extra}
        model = {"family": info.family, "model_type": info.model_type, "layers": self.layers,
                 "experts": info.n_experts, "hidden": info.hidden, "intermediate": info.intermediate}
        manifest = build_manifest(method=self.method.kt_method, numa=self.numa, layout=self.layout, model=model,
                                  source=src, files=files, tensors=tensors, quant=self.quant,
                                  include_dense=self.include_dense, expert_activation=expert_activation)
        manifest.update(self.method.manifest_fields())
        return manifest


# ---------------------------------------------------------------------------------------------- entry point

def open_cpu_output(src, out, *, method: str, numa: int, layout: str, quant: str, group_size: int | None,
                    include_dense: bool, include_mtp: bool, allow_drop_bias: bool, resume: bool, force: bool):
    """Everything before the first byte is converted: resolve and plan the source (no weights read), check
    biases, prepare OUT, start (or reopen) the journal. Returns (CpuOutput, source), or None when `resume` finds
    OUT already complete."""
    from ktconvert.formats.sources import open_source
    from ktconvert.cpu.plan import plan
    from ktconvert.methods import METHODS

    src_path, src_extra = resolve_source(str(src))
    the_plan = plan(str(src_path), method=method, numa=numa, layout=layout, group_size=group_size,
                    include_mtp=include_mtp, out=str(out))
    source = open_source(src_path)
    _check_biases(source, the_plan, allow_drop_bias)
    if include_dense:
        source.dense_tensors()   # InputError where the source has no dense tensors to give
    qmethod = METHODS.get(method).configured(group_size)
    out_dir = Path(out)
    prepare_output(out_dir, src_path, resume, force)
    if resume and (out_dir / MANIFEST_NAME).exists() and not (out_dir / JOURNAL_NAME).exists():
        return None
    layers = list(the_plan["layers"])
    options = {"method": qmethod.name, "numa": numa, "layout": layout, "quant": quant, "group_size": group_size,
               "include_dense": include_dense, "include_mtp": include_mtp, "layers": layers,
               "source_config_sha256": the_plan.get("source_config_sha256"), "source": src_extra}
    journal = Journal.start(out_dir, options, resume)
    output = CpuOutput(out_dir, qmethod, the_plan, source, numa=numa, layout=layout, quant=quant,
                       include_dense=include_dense, journal=journal, src_extra=src_extra)
    return output, source


def convert_cpu(src, out, *, method: str, numa: int = 1, layout: str = "safetensors", quant: str = "rtn",
                group_size: int | None = None, threads: int | None = None, resume: bool = False, force: bool = False,
                include_dense: bool = False, include_mtp: bool = False, allow_drop_bias: bool = False,
                calibration=None, progress=None, extra_outputs=()) -> str:
    """Convert the routed experts of checkpoint `src` for kt-kernel into directory `out`. Returns a summary line.

    extra_outputs: more outputs fed from the same source read (e.g. ktconvert.gpu's GpuOutput for `convert`), each
    with `layers` (must equal this conversion's), `journal`, begin_layer / layer_finished / finalize; the CPU
    output's bytes do not depend on them."""
    progress = progress or _NullProgress()
    if quant == "gptq":
        if extra_outputs:
            raise InputError("--quant gptq writes the CPU output on its own", hint="convert the GPU side separately")
        return _convert_cpu_gptq(src, out, method, numa, layout, calibration, resume, force, include_dense,
                                 include_mtp, allow_drop_bias, progress)
    if calibration is not None:
        raise InputError("--calibration is only used with --quant gptq", found=f"--quant {quant}")
    opened = open_cpu_output(src, out, method=method, numa=numa, layout=layout, quant=quant, group_size=group_size,
                             include_dense=include_dense, include_mtp=include_mtp, allow_drop_bias=allow_drop_bias,
                             resume=resume, force=force)
    if opened is None:
        return f"{out}: already complete (ktconvert.json present); nothing to do"
    output, source = opened
    journal, layers, out_dir, qmethod = output.journal, output.layers, output.out_dir, output.method
    jobs = source.matrix_jobs(layers)
    todo_bytes = sum(j.nbytes for j in jobs if not journal.layer_done(j.layer))
    if journal.layers:
        progress.message(f"resuming: {len(journal.layers)} of {len(layers)} layers already done")
    progress.start(todo_bytes, len(layers) - len(journal.layers), f"convert {qmethod.kt_method} T={numa}")

    for extra in extra_outputs:
        if list(extra.layers) != layers:
            raise OutputError("outputs of one pass disagree on the MoE layers", expected=str(layers),
                              found=str(list(extra.layers)), hint="use the same --include-mtp for both")
    run_journal = _JointJournal([journal] + [o.journal for o in extra_outputs]) if extra_outputs else journal
    run_jobs(jobs, source, [output, *extra_outputs], run_journal, threads or os.cpu_count() or 1, progress)

    manifest = output.finalize()
    for extra in extra_outputs:
        extra.finalize()
    total = sum(f["bytes"] for f in manifest["files"].values())
    return (f"wrote {out_dir}: {len(manifest['files'])} files, {total} bytes; run with --kt-method "
            f"{manifest['method']} --kt-weight-path {out_dir} --kt-threadpool-count {numa}")


def _convert_cpu_gptq(src, out, method, numa, layout, calibration, resume, force, include_dense, include_mtp,
                      allow_drop_bias, progress) -> str:
    """--quant gptq: calibrated, one decoder layer at a time (ktconvert.gptq); no resume, no MTP, no dense shard."""
    if calibration is None:
        raise InputError("--quant gptq needs calibration data", expected="--calibration FILE (JSON lines)")
    unsupported = [flag for flag, on in (("--resume", resume), ("--include-dense", include_dense),
                                         ("--include-mtp", include_mtp)) if on]
    if unsupported:
        raise InputError("not available with --quant gptq", found=", ".join(unsupported))
    from ktconvert.gptq.cpu import convert_cpu_gptq

    result = convert_cpu_gptq(src, out, method=method, numa=numa, calibration=calibration, layout=layout,
                              force=force, allow_drop_bias=allow_drop_bias, progress=progress)
    fallback = sum(len(v) for v in result["fallback"].values())
    gptq = sum(c["gptq"] for c in result["selection"].values())
    return (f"wrote {out} (GPTQ for {gptq} experts, {result['fallback_quant']} for {fallback} where GPTQ did not "
            f"beat it on held-out calibration tokens or had too few); run with {sglang_args(result['manifest'], out)}")


# ---------------------------------------------------------------------------------------------- the loop

class _JointJournal:
    """What run_jobs asks of a journal, over several outputs' journals: a layer or source file counts as done
    only when it is done in every one; source digests go to all."""

    def __init__(self, journals: list):
        self.journals = journals

    def layer_done(self, layer: int) -> bool:
        return all(j.layer_done(layer) for j in self.journals)

    def source_digest(self, name: str) -> dict | None:
        digests = [j.source_digest(name) for j in self.journals]
        return digests[0] if all(digests) else None

    def finish_source(self, name: str, digest: dict) -> None:
        for j in self.journals:
            j.finish_source(name, digest)


def run_jobs(jobs: list[MatrixJob], source, outputs: list, journal: Journal, workers: int, progress) -> None:
    """Read every source file front to back; each decoded matrix goes to every output in `outputs`.

    `journal` decides what is already done (layers, fully hashed source files); each output gets
    begin_layer(L) -> consumer (put_matrix / finish / abort) and layer_finished(L, result)."""
    tracker = _LayerTracker(jobs)
    consumers: dict[int, list] = {}
    lock = threading.Lock()
    fault = _FaultInjector.from_env()

    def consumers_for(layer: int) -> list:
        with lock:
            if layer not in consumers:
                consumers[layer] = [out.begin_layer(layer) for out in outputs]
            return consumers[layer]

    def work(job: MatrixJob, raw) -> None:
        targets = consumers_for(job.layer)
        for proj, w in source.decode(job, raw).items():
            where = f"{job_tensor(job)} (layer {job.layer}, expert {job.expert}, {proj})"
            for consumer in targets:
                consumer.put_matrix(proj, job.expert, w, where)
        progress.advance(job.nbytes)
        fault.tick()

    def finish(layer: int) -> list:
        return [c.finish() for c in consumers[layer]]

    finishing: dict[int, Future] = {}

    def record_finished(block: bool = False) -> None:
        if block:
            wait(list(finishing.values()))
        for layer in sorted(finishing):
            if finishing[layer].done():
                for out, result in zip(outputs, finishing.pop(layer).result()):
                    out.layer_finished(layer, result)
                consumers.pop(layer, None)
                progress.advance(0, items=1, detail=f"layer {layer}")

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
                with HashingFileReader(path) as reader:
                    for job in file_jobs:
                        raw = reader.read_range(job.offset, job.nbytes)
                        if journal.layer_done(job.layer):
                            tracker.submitted(job.layer, None)
                            continue
                        _throttle(tracker, workers)
                        tracker.submitted(job.layer, pool.submit(work, job, raw))
                        for layer in tracker.ready():
                            if not journal.layer_done(layer):
                                finishing[layer] = pool.submit(finish, layer)
                        record_finished()
                    digest = reader.finish()
                journal.finish_source(name, {"bytes": digest.bytes, "sha256": digest.sha256})
            wait([f for fs in tracker.futures.values() for f in fs])
            for layer in tracker.ready():
                if not journal.layer_done(layer):
                    finishing[layer] = pool.submit(finish, layer)
            record_finished(block=True)
    except BaseException:
        for layer_consumers in consumers.values():
            for consumer in layer_consumers:
                consumer.abort()
        raise
    if tracker.remaining:
        raise InputError("some layers had no expert data in the source files", expected="every MoE layer",
                         found=f"layers {sorted(tracker.remaining)} unfinished")


def job_tensor(job: MatrixJob) -> str:
    """'file: tensor' (with the expert slice of a fused tensor) for messages."""
    name = job.key[0] if job.key else "?"
    index = job.key[1] if len(job.key) > 1 else None
    return f"{job.file.name}: {name}" + (f"[{index}]" if index is not None else "")


class _LayerTracker:
    """Counts each layer's outstanding jobs; a layer is ready when all its jobs were submitted and are done."""

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
        """Layers whose every job was submitted and has completed (a job's error is re-raised here)."""
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


def _throttle(tracker: _LayerTracker, workers: int) -> None:
    """Bound memory: at most 2 jobs per worker in flight. A failed job stops the run here, not at the end."""
    futures = [f for fs in tracker.futures.values() for f in fs]
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()
    pending = [f for f in futures if not f.done()]
    if len(pending) >= 2 * workers:
        wait(pending, return_when=FIRST_COMPLETED)


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


# ---------------------------------------------------------------------------------------------- sources

def _check_biases(source, the_plan: dict, allow_drop_bias: bool) -> None:
    """kt-kernel's CPU formats carry no bias: refuse to silently drop non-zero expert biases."""
    nonzero = getattr(source, "nonzero_expert_biases", lambda layers: [])(the_plan["layers"])
    if nonzero and not allow_drop_bias:
        raise InputError(f"{len(nonzero)} expert bias tensors are non-zero and kt-kernel's "
                         f"{the_plan['kt_method']} files carry no bias", tensor=nonzero[0],
                         hint="pass --allow-drop-bias to convert anyway (outputs will differ from the source)")


def resolve_source(src: str) -> tuple[Path, dict]:
    """A local path, or hf://ORG/NAME[@REV] / ms://ORG/NAME downloaded and verified first."""
    if src.startswith(("hf://", "ms://")):
        from ktconvert.ops.hub import resolve_source as hub_resolve

        path, extra = hub_resolve(src)
        return Path(path), extra
    path = Path(src)
    if not path.exists():
        raise InputError("source does not exist", file=path)
    return path, {}


def source_root(source) -> Path:
    """The directory holding the source's config.json / tokenizer files."""
    return Path(source.root)

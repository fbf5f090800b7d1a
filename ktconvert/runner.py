"""The conversion loop: the one place that walks over a checkpoint's expert matrices.

    for each source file, front to back (every byte hashed once, on its own thread):
        decode one expert matrix to BF16 -> every output's consumer of that layer writes it
        a layer whose last matrix is written is finished (files renamed into place) and journalled

Memory: at most two jobs per worker in flight (one matrix each) plus a read chunk, independent of layers and
experts. Bytes: every output tensor has a fixed place, so neither the file order nor the thread count changes a
byte. The outputs (``output.Output``) decide what a matrix becomes; this module only schedules.
"""
from __future__ import annotations

import os
import signal
import threading
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from ktconvert import profile
from ktconvert.errors import InputError
from ktconvert.formats.stream import HashingFileReader, MatrixJob, jobs_by_file


class JointJournal:
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


def run_jobs(jobs: list[MatrixJob], source, outputs: list, journal, workers: int, progress) -> None:
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
        with profile.span("decode", job.nbytes):
            matrices = source.decode(job, raw)
        for proj, w in matrices.items():
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
            with profile.span("wait.workers"):
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
            with profile.span("wait.workers"):
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
        with profile.span("wait.workers"):
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
                os.kill(os.getpid(), signal.SIGKILL)

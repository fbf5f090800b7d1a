"""The conversion loop: the one place that walks over a checkpoint's expert matrices.

    for each source file, front to back, several files at once (every byte hashed once, each file on its own
    sha256 thread; an LFS shard of a Hugging Face cache snapshot not at all: its blob name is its sha256):
        decode one expert matrix to BF16 -> every output's consumer of that layer writes it
        a layer whose last matrix is written is finished (files renamed into place) and journalled

Memory: at most two jobs per worker in flight (one matrix each), at most READ_BUDGET bytes read ahead by all
reading threads together, a read chunk per reading thread; independent of layers and experts. Bytes: every output tensor has a fixed place, so neither the file order nor the thread count changes a
byte. The outputs (``output.Output``) decide what a matrix becomes; this module only schedules.
"""
from __future__ import annotations

import os
import signal
import threading
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from ktconvert import profile
from ktconvert.errors import InputError
from ktconvert.formats.stream import HashingFileReader, MatrixJob, jobs_by_file, known_sha256


class JointJournal:
    """What run_jobs asks of a journal, over several outputs' journals (one per output, in order): a layer or
    source file counts as done only when it is done in every one (``needing`` says which outputs still need a
    layer: a resumed output is not written twice); source digests go to all."""

    def __init__(self, journals: list):
        self.journals = journals

    def layer_done(self, layer: int) -> bool:
        return all(j.layer_done(layer) for j in self.journals)

    def needing(self, layer: int) -> list[int]:
        """Indexes of the journals (outputs) that still need `layer`."""
        return [i for i, j in enumerate(self.journals) if not j.layer_done(layer)]

    def source_digest(self, name: str) -> dict | None:
        digests = [j.source_digest(name) for j in self.journals]
        return digests[0] if all(digests) else None

    def finish_source(self, name: str, digest: dict) -> None:
        for j in self.journals:
            j.finish_source(name, digest)


READ_BUDGET = 128 << 20   # bytes of source read ahead of the workers, all reading threads together
MAX_READERS = 4           # source files in flight at once (each with its own sha256 stream)


def run_jobs(jobs: list[MatrixJob], source, outputs: list, journal, workers: int, progress,
             files: list | None = None, *, verify_source_hash: bool = False) -> None:
    """Read every source file (or those in `files`, in the source's order) front to back; each decoded matrix
    goes to every output in `outputs` that still needs its layer.

    Up to min(MAX_READERS, workers) files are read at once, each by its own thread with its own sha256 stream,
    together at most READ_BUDGET bytes ahead of the workers. `journal` decides what is already done (layers, fully
    hashed source files); each output that still needs layer L (journal.needing) gets begin_layer(L) -> consumer
    (put_matrix / finish / abort) and layer_finished(L, result). verify_source_hash: hash a file even when a Hugging Face cache blob name gives
    its sha256, and refuse it when they differ (stream.known_sha256)."""
    one_pass = _Pass(jobs, source, outputs, journal, workers, progress)
    files = [p for p in source.files() if (files is None or p in files) and not one_pass.file_done(p)]
    source.ensure_local(files)
    readers = max(1, min(MAX_READERS, workers, len(files)))
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool, \
                ThreadPoolExecutor(max_workers=readers, thread_name_prefix="ktconvert-read") as read_pool:
            one_pass.pool = pool
            reads = [read_pool.submit(one_pass.read_file, path, verify_source_hash) for path in files]
            try:
                with profile.span("wait.readers"):
                    wait(reads, return_when=FIRST_EXCEPTION)
                one_pass.stop_on_error(reads)
            except BaseException:
                one_pass.failed.set()
                raise
            one_pass.drain()
    except BaseException:
        one_pass.abort()
        raise
    if one_pass.tracker.remaining:
        raise InputError("some layers had no expert data in the source files", expected="every MoE layer",
                         found=f"layers {sorted(one_pass.tracker.remaining)} unfinished")


class _Pass:
    """The state of one run_jobs call shared by its reading threads: layer tracker, consumers, finishing layers,
    all behind one lock; the read budget."""

    def __init__(self, jobs: list[MatrixJob], source, outputs: list, journal, workers: int, progress):
        self.source, self.outputs, self.journal, self.workers, self.progress = source, outputs, journal, workers, progress
        self.tracker = _LayerTracker(jobs)
        self.grouped = jobs_by_file(jobs)
        self.consumers: dict[int, list] = {}
        self.finishing: dict[int, Future] = {}
        self.lock = threading.RLock()
        self.budget = _ByteBudget(READ_BUDGET)
        self.failed = threading.Event()
        self.fault = FaultInjector.from_env()
        self.pool: ThreadPoolExecutor | None = None

    def file_done(self, path) -> bool:
        """The file was hashed to its end before and all its layers are done: counted, not read again."""
        file_jobs = self.grouped.get(path, [])
        if not (self.journal.source_digest(self.source.relative_name(path))
                and all(self.journal.layer_done(j.layer) for j in file_jobs)):
            return False
        for job in file_jobs:
            self.tracker.submitted(job.layer, None)
        return True

    def read_file(self, path, verify_source_hash: bool) -> None:
        """One reading thread: the file front to back, each job handed to the workers, the file's digest
        journalled at its end."""
        name = self.source.relative_name(path)
        with HashingFileReader(path, known_sha256(path), verify=verify_source_hash) as reader:
            for job in self.grouped.get(path, []):
                if self.failed.is_set():
                    return
                self._read_job(reader, job)
            digest = reader.finish()
        with self.lock:
            self.journal.finish_source(name, {"bytes": digest.bytes, "sha256": digest.sha256})

    def _read_job(self, reader: HashingFileReader, job: MatrixJob) -> None:
        if self.journal.layer_done(job.layer):
            reader.skip_to(job.offset + job.nbytes)
            with self.lock:
                self.tracker.submitted(job.layer, None)
            return
        self.budget.acquire(job.nbytes)
        try:
            raw = reader.read_range(job.offset, job.nbytes)
            self._throttle()
            future = self.pool.submit(self._work, job, raw)
        except BaseException:
            self.budget.release(job.nbytes)
            raise
        future.add_done_callback(lambda _: self.budget.release(job.nbytes))
        with self.lock:
            self.tracker.submitted(job.layer, future)
            self._schedule_ready()

    def _consumers_for(self, layer: int) -> list:
        with self.lock:
            if layer not in self.consumers:
                self.consumers[layer] = [(self.outputs[i], self.outputs[i].begin_layer(layer))
                                         for i in self.journal.needing(layer)]
            return self.consumers[layer]

    def _work(self, job: MatrixJob, raw) -> None:
        targets = self._consumers_for(job.layer)
        with profile.span("decode", job.nbytes):
            matrices = self.source.decode(job, raw)
        for proj, w in matrices.items():
            where = f"{job_tensor(job)} (layer {job.layer}, expert {job.expert}, {proj})"
            for _, consumer in targets:
                consumer.put_matrix(proj, job.expert, w, where)
        self.progress.advance(job.nbytes)
        self.fault.tick()

    def _finish(self, layer: int) -> list:
        return [(out, consumer.finish()) for out, consumer in self.consumers[layer]]

    def _schedule_ready(self) -> None:
        """(lock held) Layers whose jobs all completed start finishing; finished ones are reported."""
        for layer in self.tracker.ready():
            if not self.journal.layer_done(layer):
                self.finishing[layer] = self.pool.submit(self._finish, layer)
        self._record_finished()

    def _record_finished(self) -> None:
        for layer in sorted(self.finishing):
            if self.finishing[layer].done():
                for out, result in self.finishing.pop(layer).result():
                    out.layer_finished(layer, result)
                self.consumers.pop(layer, None)
                self.progress.advance(0, items=1, detail=f"layer {layer}")

    def _throttle(self) -> None:
        """Bound memory: at most 2 jobs per worker in flight. A failed job stops the run here, not at the end."""
        with self.lock:
            futures = [f for fs in self.tracker.futures.values() for f in fs]
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        pending = [f for f in futures if not f.done()]
        if len(pending) >= 2 * self.workers:
            with profile.span("wait.workers"):
                wait(pending, return_when=FIRST_COMPLETED)

    def stop_on_error(self, reads: list[Future]) -> None:
        """Re-raise the first reading thread's error (the others stop at their next job)."""
        for future in reads:
            if future.done() and future.exception() is not None:
                self.failed.set()
                raise future.exception()
        for future in reads:
            future.result()

    def drain(self) -> None:
        """Wait for the workers, finish the remaining layers, report them."""
        with self.lock:
            futures = [f for fs in self.tracker.futures.values() for f in fs]
        with profile.span("wait.workers"):
            wait(futures)
        with self.lock:
            self._schedule_ready()
            finishing = list(self.finishing.values())
        with profile.span("wait.workers"):
            wait(finishing)
        with self.lock:
            self._record_finished()

    def abort(self) -> None:
        self.failed.set()
        with self.lock:
            for layer_consumers in self.consumers.values():
                for _, consumer in layer_consumers:
                    consumer.abort()


class _ByteBudget:
    """At most `limit` bytes held at once (one request larger than the limit is let through alone)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self.cond:
            if self.held and self.held + nbytes > self.limit:
                with profile.span("wait.read_budget"):
                    self.cond.wait_for(lambda: not self.held or self.held + nbytes <= self.limit)
            self.held += nbytes

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()


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


class FaultInjector:
    """Crash testing: KTCONVERT_FAULT_AFTER_JOBS=N makes the process SIGKILL itself after N converted matrices,
    exactly like a power cut or the OOM killer (no cleanup, no exception handlers). With KTCONVERT_FAULT_ONCE=PATH
    only the first process to get there dies (it creates PATH; a retried worker then runs to the end)."""

    def __init__(self, after: int | None, once: str | None = None):
        self.after, self.once = after, once
        self.count = 0
        self.lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "FaultInjector":
        value = os.environ.get("KTCONVERT_FAULT_AFTER_JOBS")
        return cls(int(value) if value else None, os.environ.get("KTCONVERT_FAULT_ONCE"))

    def tick(self) -> None:
        if self.after is None:
            return
        with self.lock:
            self.count += 1
            if self.count >= self.after and self._first():
                os.kill(os.getpid(), signal.SIGKILL)

    def _first(self) -> bool:
        if self.once is None:
            return True
        try:
            os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            self.after = None
            return False
        return True

"""The conversion loop: the one place that walks over a checkpoint's expert matrices.

    for each group of source files holding the same layers (read_order), several groups at once, every file of
    the group front to back (every byte hashed once, each file on its own sha256 thread; an LFS shard of a
    Hugging Face cache snapshot not at all: its blob name is its sha256), the matrices in name order:
        decode one expert matrix to BF16 -> every output's consumer of that layer writes it
        a layer whose last matrix is written is finished (files renamed into place) and journalled

Memory: at most two jobs per worker in flight (one matrix each), at most READ_BUDGET bytes read ahead by all
reading threads together, at most stream.HASH_BUDGET bytes queued for the sha256 threads; independent of layers
and experts. Bytes: every output tensor has a fixed place, so neither the reading order nor the thread count
changes a byte. The outputs (``output.Output``) decide what a matrix becomes; this module only schedules.
"""
from __future__ import annotations

import functools
import os
import signal
import threading
from collections import defaultdict
from contextlib import ExitStack
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from ktconvert.util import profile
from ktconvert.errors import InputError
from ktconvert.formats.stream import ByteBudget, HashingFileReader, MatrixJob, jobs_by_file, known_sha256
from ktconvert.run.read_order import merged_jobs, read_groups


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

    def finish_source(self, name: str, digest: dict, seen: dict | None = None) -> None:
        for j in self.journals:
            j.finish_source(name, digest, seen)


READ_BUDGET = 128 << 20   # bytes of source read ahead of the workers, all reading threads together
MAX_READERS = 4           # groups of source files read at once (each file with its own sha256 stream)


def run_jobs(jobs: list[MatrixJob], source, outputs: list, journal, workers: int, progress,
             files: list | None = None, *, verify_source_hash: bool = False) -> None:
    """Read every source file (or those in `files`) front to back; each decoded matrix goes to every output in
    `outputs` that still needs its layer.

    The files are read in groups (``read_order.read_groups``: the files holding the same layers), up to
    min(MAX_READERS, workers) groups at once, each by one thread that keeps every file of its group open, each
    file with its own sha256 stream, and hands the group's matrices out in name order (``read_order.merged_jobs``:
    the order of the outputs' files); all together at most READ_BUDGET bytes ahead of the workers. `journal`
    decides what is already done (layers, fully hashed source files); each output that still needs layer L
    (journal.needing) gets begin_layer(L) -> consumer (put_matrix / finish / abort) and layer_finished(L, result).
    verify_source_hash: hash a file even when a Hugging Face cache blob name gives its sha256, and refuse it when
    they differ (stream.known_sha256)."""
    one_pass = _Pass(jobs, source, outputs, journal, workers, progress)
    files = [p for p in source.files() if (files is None or p in files) and not one_pass.file_done(p)]
    source.ensure_local(files)
    groups = read_groups(files, one_pass.layers_of(files))
    one_pass.groups = iter(groups)
    readers = max(1, min(MAX_READERS, workers, len(groups)))
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool, \
                ThreadPoolExecutor(max_workers=readers, thread_name_prefix="ktconvert-read") as read_pool:
            one_pass.pool = pool
            reads = [read_pool.submit(one_pass.read_groups, verify_source_hash) for _ in range(readers)]
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
    """The state of one run_jobs call shared by its reading threads and workers: layer tracker, consumers, jobs in
    flight, finishing layers, the first error, all behind one lock; the read budget."""

    def __init__(self, jobs: list[MatrixJob], source, outputs: list, journal, workers: int, progress):
        self.source, self.outputs, self.journal = source, outputs, journal
        self.workers, self.progress = workers, progress
        self.tracker = _LayerTracker(jobs)
        self.grouped = jobs_by_file(jobs)
        self.consumers: dict[int, list] = {}
        self.finishing: dict[int, Future] = {}
        self.active = 0                             # jobs submitted and not finished
        self.error: BaseException | None = None     # the first failed job's exception
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)   # a job finished
        self.budget = ByteBudget(READ_BUDGET)
        self.failed = threading.Event()
        self.fault = FaultInjector.from_env()
        self.pool: ThreadPoolExecutor | None = None
        self.groups = iter(())

    def file_done(self, path) -> bool:
        """The file was hashed to its end before and all its layers are done: counted, not read again."""
        file_jobs = self.grouped.get(path, [])
        if not (self.journal.source_digest(self.source.relative_name(path))
                and all(self.journal.layer_done(j.layer) for j in file_jobs)):
            return False
        for job in file_jobs:
            self.tracker.settled(job.layer)
        return True

    def layers_of(self, files: list) -> dict:
        """{file: the layers still to be written whose matrices it holds}."""
        return {path: {j.layer for j in self.grouped.get(path, []) if not self.journal.layer_done(j.layer)}
                for path in files}

    def read_groups(self, verify_source_hash: bool) -> None:
        """One reading thread: groups of files as they come, until none is left or a reader failed."""
        while not self.failed.is_set():
            with self.lock:
                group = next(self.groups, None)
            if group is None:
                return
            self.read_group(group, verify_source_hash)

    def read_group(self, group: list, verify_source_hash: bool) -> None:
        """Every file of `group` open, each read front to back, the jobs in name order; a file's digest is
        journalled as soon as its last job was read."""
        left = {path: len(self.grouped.get(path, [])) for path in group}
        with ExitStack() as stack:
            readers = {path: stack.enter_context(HashingFileReader(path, known_sha256(path),
                                                                   verify=verify_source_hash)) for path in group}
            for path in [p for p in group if not left[p]]:
                self._finish_file(path, readers[path])
            for job in merged_jobs([self.grouped.get(path, []) for path in group]):
                if self.failed.is_set():
                    return
                self._read_job(readers[job.file], job)
                left[job.file] -= 1
                if not left[job.file]:
                    self._finish_file(job.file, readers[job.file])

    def _finish_file(self, path, reader: HashingFileReader) -> None:
        digest = reader.finish()
        with self.lock:
            self.journal.finish_source(self.source.relative_name(path),
                                       digest.entry(),
                                       {"head_sha256": digest.head_sha256, "stat": list(digest.identity)})

    def _read_job(self, reader: HashingFileReader, job: MatrixJob) -> None:
        if self.journal.layer_done(job.layer):
            reader.skip_to(job.offset + job.nbytes)
            with self.lock:
                self.tracker.settled(job.layer)
            return
        self.budget.acquire(job.nbytes)
        try:
            raw = reader.read_range(job.offset, job.nbytes)
            self._throttle()
            with self.lock:
                self.active += 1
            self.pool.submit(self._run_job, job, raw)
        except BaseException:
            self.budget.release(job.nbytes)
            raise
        with self.lock:
            self._schedule_ready()

    def _run_job(self, job: MatrixJob, raw) -> None:
        """(a worker) The job, then its bookkeeping: the first error kept, budget, jobs in flight, the layer's count."""
        try:
            self._work(job, raw)
        except BaseException as exc:
            with self.lock:
                self.error = self.error or exc
        finally:
            self.budget.release(job.nbytes)
            with self.lock:
                self.active -= 1
                self.tracker.settled(job.layer)
                self.changed.notify_all()

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
        stored = functools.cache(functools.partial(self.source.stored_arrays, job, raw))
        for proj, w in matrices.items():
            where = f"{job_tensor(job)} (layer {job.layer}, expert {job.expert}, {proj})"
            for _, consumer in targets:
                consumer.put_matrix(proj, job.expert, w, where, stored=stored)
        self.progress.advance(job.nbytes, items=1)      # items: expert matrices, which move with the bytes
        self.fault.tick()

    def _finish(self, layer: int) -> list:
        return [(out, consumer.finish()) for out, consumer in self.consumers[layer]]

    def _schedule_ready(self) -> None:
        """(lock held) Layers whose jobs all completed start finishing; finished ones are reported. A failed job
        is raised here: nothing more is finished."""
        if self.error is not None:
            raise self.error
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
                self.progress.advance(0, detail=f"layer {layer} written")

    def _throttle(self) -> None:
        """Bound memory: at most 2 jobs per worker in flight. A failed job stops the run here, not at the end."""
        with self.changed:
            if self.active >= 2 * self.workers and self.error is None:
                with profile.span("wait.workers"):
                    self.changed.wait_for(lambda: self.active < 2 * self.workers or self.error is not None)
            if self.error is not None:
                raise self.error

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
        with self.changed:
            with profile.span("wait.workers"):
                self.changed.wait_for(lambda: self.active == 0)
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


def job_tensor(job: MatrixJob) -> str:
    """'file: tensor' (with the expert slice of a fused tensor) for messages."""
    return f"{job.file.name}: {job.tensor or '?'}" + (f"[{job.index0}]" if job.index0 is not None else "")


class _LayerTracker:
    """Counts each layer's jobs not yet settled (completed or skipped); a layer is ready when none is left."""

    def __init__(self, jobs: list[MatrixJob]):
        self.remaining: dict[int, int] = defaultdict(int)
        for job in jobs:
            self.remaining[job.layer] += 1
        self._ready: list[int] = []

    def settled(self, layer: int) -> None:
        self.remaining[layer] -= 1
        if not self.remaining[layer]:
            del self.remaining[layer]
            self._ready.append(layer)

    def ready(self) -> list[int]:
        """The layers whose last job settled since the last call, sorted."""
        done, self._ready = sorted(self._ready), []
        return done


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

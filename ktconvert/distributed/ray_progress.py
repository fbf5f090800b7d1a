"""The progress of a Ray run without a single point of failure: a small actor the tasks report to, which the
driver reads without ever waiting on it, and the tasks' side of it.

``start_board`` places the ProgressBoard (no CPU) on the driver's node where it can and has Ray restart it as often
as it dies; the tasks (``BoardProgress``) report their absolute counts, so a restarted board is fed again by the
next reports, and a lost one costs a task nothing. ``BoardWatch`` is the driver's view: the totals the board last
sent, one line when it is lost or unreachable, after which the driver counts the parts that finished.
"""
from __future__ import annotations

import time
import uuid

from ktconvert.distributed.ray_runtime import note_fault
from ktconvert.util.progress import Progress

POLL_SECONDS = 0.5
SILENT_SECONDS = 30          # a board that has not answered for this long is said to be unreachable


def start_board(ray):
    """The ProgressBoard actor of one run: no CPU, on the driver's node where it can (soft affinity: elsewhere
    when that node cannot take it), restarted by Ray as often as it dies (``max_restarts=-1``); named
    ktconvert-progress-... (as Ray's actor listings show it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(ProgressBoard).options(
        name=f"ktconvert-progress-{uuid.uuid4().hex[:12]}", num_cpus=0, max_restarts=-1, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote()


class BoardWatch:
    """The driver's view of the ProgressBoard: ``poll`` never blocks; it returns the last totals the board sent
    ({part: (bytes, layers)}), asking it again once it answered. When the board is lost (Ray gave up on it, or
    it is restarting) or has not answered for SILENT_SECONDS (its node frozen) one line says so and the run goes
    on (progress then counts finished parts); a board Ray restarts is asked again, and is fed again by the tasks'
    next reports. A board Ray gave up on for good is not asked again."""

    def __init__(self, ray, board, progress):
        self.ray, self.board, self.progress = ray, board, progress
        self.pending, self.last, self.told, self.asked = None, {}, False, 0.0

    def poll(self) -> dict:
        if self.board is None:
            return self.last
        try:
            if self.pending is None:
                self.pending, self.asked = self.board.totals.remote(), time.monotonic()
            ready, _ = self.ray.wait([self.pending], timeout=0)
            if ready:
                ref, self.pending = self.pending, None
                self.last = self.ray.get(ref)
            elif time.monotonic() - self.asked > SILENT_SECONDS:
                self._tell(f"not answering for {SILENT_SECONDS} s")
        except self.ray.exceptions.ActorDiedError as exc:
            self._lost(exc, for_good=True)
        except self.ray.exceptions.RayError as exc:
            self._lost(exc, for_good=False)
        return self.last

    def _lost(self, exc, for_good: bool) -> None:
        self.pending = None
        if for_good:
            self.board = None
        self._tell(f"lost ({type(exc).__name__})")

    def _tell(self, what: str) -> None:
        if not self.told:
            self.told = True
            note_fault(f"progress actor {what}; the run goes on, its progress counts the parts that finished",
                       self.progress)


class ProgressBoard:
    """Ray actor: the bytes and layers each part reported so far (a retried part reports afresh)."""

    def __init__(self):
        self.parts: dict[int, tuple[int, int]] = {}

    def report(self, part: int, nbytes: int, layers: int) -> None:
        self.parts[part] = (nbytes, layers)

    def totals(self) -> dict[int, tuple[int, int]]:
        return dict(self.parts)


class BoardProgress(Progress):
    """A task's progress: its counters sent to the ProgressBoard every `interval` seconds and at the end (a board
    that is gone loses them: progress is never worth failing a part for)."""

    def __init__(self, board, part: int, interval: float = POLL_SECONDS):
        super().__init__(interval=interval)
        self.board, self.part = board, part

    def _on_advance(self, nbytes: int, due: bool) -> None:
        if due:
            self._send()

    def _on_done(self, status: str) -> None:
        self._send()

    def _send(self) -> None:
        try:
            self.board.report.remote(self.part, self.bytes_done, self.items_done)
        except Exception:         # noqa: BLE001  a lost board (whatever Ray raises for it) must not fail the part
            pass

"""Where a conversion's time goes (``ktconvert cpu|gpu|convert --profile``): wall and core seconds per kind of work.

    profile.enable()                      # the command line does this for --profile; off by default
    with profile.span("read", nbytes): ...           # any thread; a no-op (one global read) when disabled
    report = profile.disable()            # {"wall_s", "core_s", "kinds": {kind: {wall_s, core_s, bytes, calls}}}

A span's wall time is summed over the threads that ran it (several workers make it exceed the run's wall time);
its core time is the thread's CPU time (user + system, ``time.thread_time``) spent inside it, so read-ahead waits,
sleeps and lock waits count as wall, not core. Spans nest: a span's figures exclude the spans opened inside it on
the same thread (self time), so the kinds add up; the process's core time inside no span is reported as
``other`` (Python glue, allocation, threads' start-up). Kinds are
dotted names, the first part the group: ``read``, ``hash.source``, ``decode``, ``quantize.cpu``,
``quantize.gpu``, ``write``, ``hash.tensor``, ``hash.file``, ``hash.git``, ``read.output`` (output bytes read back
to hash them: ordered_hash), ``fsync``, ``finalize``, ``import``,
``wait.*`` (a thread blocked on others: its wall time is idle time of that thread, not work); ``startup`` is the
process before profiling began (interpreter, imports, option parsing).

Nothing here imports the rest of the package, so every module may use it.
"""
from __future__ import annotations

import os
import resource
import threading
import time


class _Totals:
    __slots__ = ("wall", "core", "nbytes", "calls")

    def __init__(self):
        self.wall = self.core = 0.0
        self.nbytes = self.calls = 0


class Profiler:
    """Accumulates spans per kind from any thread (one lock per addition)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kinds: dict[str, _Totals] = {}
        self.t0 = time.perf_counter()
        self.core0 = _process_core_s()
        self.startup = (_process_age_s(), self.core0)   # interpreter start, imports, option parsing

    def add(self, kind: str, wall: float, core: float, nbytes: int = 0) -> None:
        with self.lock:
            totals = self.kinds.get(kind)
            if totals is None:
                totals = self.kinds[kind] = _Totals()
            totals.wall += wall
            totals.core += core
            totals.nbytes += nbytes
            totals.calls += 1

    def report(self) -> dict:
        """{"wall_s", "core_s" (process, user + system since enable), "kinds": {kind: {"wall_s", "core_s", "bytes",
        "calls"}}} with "other" = process core time outside every span."""
        wall, core = time.perf_counter() - self.t0, _process_core_s() - self.core0
        with self.lock:
            kinds = {k: {"wall_s": round(t.wall, 4), "core_s": round(t.core, 4), "bytes": t.nbytes, "calls": t.calls}
                     for k, t in sorted(self.kinds.items())}
        spanned = sum(v["core_s"] for v in kinds.values())
        kinds["other"] = {"wall_s": 0.0, "core_s": round(max(core - spanned, 0.0), 4), "bytes": 0, "calls": 0}
        kinds["startup"] = {"wall_s": round(self.startup[0], 4), "core_s": round(self.startup[1], 4), "bytes": 0,
                            "calls": 1}
        return {"wall_s": round(wall + self.startup[0], 4), "core_s": round(core + self.startup[1], 4),
                "cores": os.cpu_count(), "kinds": kinds}


_stack = threading.local()    # per thread: [wall, core] of the children of each open span


class _Span:
    __slots__ = ("profiler", "kind", "nbytes", "wall", "core", "children")

    def __init__(self, profiler: Profiler, kind: str, nbytes: int):
        self.profiler, self.kind, self.nbytes = profiler, kind, nbytes

    def __enter__(self) -> "_Span":
        frames = getattr(_stack, "frames", None)
        if frames is None:
            frames = _stack.frames = []
        self.children = [0.0, 0.0]
        frames.append(self.children)
        self.wall, self.core = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        wall, core = time.perf_counter() - self.wall, time.thread_time() - self.core
        frames = _stack.frames
        frames.pop()
        if frames:
            frames[-1][0] += wall
            frames[-1][1] += core
        self.profiler.add(self.kind, wall - self.children[0], core - self.children[1], self.nbytes)


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> "_NoSpan":
        return self

    def __exit__(self, *exc) -> None:
        return None


_NO_SPAN = _NoSpan()
_active: Profiler | None = None


def span(kind: str, nbytes: int = 0):
    """Context manager timing one piece of work of `kind` (`nbytes` processed, for the GB/s column)."""
    profiler = _active
    return _NO_SPAN if profiler is None else _Span(profiler, kind, nbytes)


def enabled() -> bool:
    return _active is not None


def enable() -> Profiler:
    """Start collecting (a fresh profiler; the process's core time is counted from here)."""
    global _active
    _active = Profiler()
    return _active


def disable() -> dict | None:
    """Stop collecting; the report of what was collected (None when it was not enabled)."""
    global _active
    profiler, _active = _active, None
    return None if profiler is None else profiler.report()


def _process_age_s() -> float:
    """Seconds since this process started (Linux: /proc/self/stat; elsewhere 0)."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def _process_core_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def render(report: dict) -> str:
    """The report as a table: kind, wall s (summed over threads), core s, share of the process's core time, GB
    processed and GB/s per core second."""
    total_core = report["core_s"] or 1e-9
    lines = [f"profile: wall {report['wall_s']:.2f} s, core {report['core_s']:.2f} s on {report['cores']} cores "
             f"({report['core_s'] / max(report['wall_s'], 1e-9):.2f} cores busy)",
             f"{'kind':<16}{'wall s':>9}{'core s':>9}{'core %':>8}{'GB':>8}{'GB/core-s':>11}{'calls':>9}"]
    for kind, v in sorted(report["kinds"].items(), key=lambda kv: -kv[1]["core_s"]):
        gb = v["bytes"] / 1e9
        rate = f"{gb / v['core_s']:.2f}" if gb and v["core_s"] > 1e-6 else ""
        lines.append(f"{kind:<16}{v['wall_s']:>9.2f}{v['core_s']:>9.2f}{100 * v['core_s'] / total_core:>7.1f}%"
                     f"{(f'{gb:.2f}' if gb else ''):>8}{rate:>11}{v['calls']:>9}")
    return "\n".join(lines)

"""Progress reporting for long operations (convert, publish, download, bundle).

The CLI builds a reporter with `make_progress` and hands it to library code, which only calls four methods:

    with make_progress(quiet=False, json_lines=False) as progress:
        progress.start(total_bytes, total_items, "convert")   # a new phase; may be called again for the next phase
        progress.advance(nbytes, items=1, detail="layer 3")    # thread-safe
        progress.message("resuming: 12 of 40 layers done")
    # close() runs on exit: a final line / event with totals and elapsed time

Renderers, chosen once:
* ``quiet=True`` or ``KTCONVERT_NO_PROGRESS=1``: nothing (messages too).
* ``json_lines=True``: one JSON object per line on stderr: ``{"event": "start"|"progress"|"message"|"done", ...}``
  with ``label, bytes, total_bytes, items, total_items, elapsed_s`` (+ ``detail`` / ``text``). "progress" events are
  throttled to one per interval (``KTCONVERT_PROGRESS_INTERVAL`` seconds, default 1).
* stderr is a terminal: a tqdm bar in bytes, items and the last detail in the postfix.
* otherwise (CI logs): a plain line per interval (default 10 s): ``label: 45.0% 1.20 GiB/2.67 GiB, 3/10 items, ...``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

ENV_DISABLE = "KTCONVERT_NO_PROGRESS"
ENV_INTERVAL = "KTCONVERT_PROGRESS_INTERVAL"


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class Progress:
    """Counting core shared by every renderer; this base class renders nothing (the quiet reporter).

    `draws_bars`: True only for the terminal renderer; callers running third-party clients (hub uploads) switch
    those clients' own bars off when it is False so CI logs and JSON-lines output stay clean.
    """

    draws_bars = False

    def __init__(self, stream=None, interval: float = 1.0):
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.label = ""
        self.total_bytes = 0
        self.total_items = 0
        self.bytes_done = 0
        self.items_done = 0
        self.detail = ""
        self._t0 = time.monotonic()
        self._last_emit = 0.0
        self._lock = threading.Lock()
        self._active = False

    # public API ------------------------------------------------------------------------------------------
    def start(self, total_bytes: int = 0, total_items: int = 0, label: str = "") -> None:
        """Begin a phase of `total_bytes` bytes and `total_items` items (0 = unknown). Ends the previous phase."""
        with self._lock:
            if self._active:
                self._finish_phase()
            self.label = label
            self.total_bytes = int(total_bytes or 0)
            self.total_items = int(total_items or 0)
            self.bytes_done = 0
            self.items_done = 0
            self.detail = ""
            self._t0 = time.monotonic()
            self._last_emit = self._t0
            self._active = True
            self._on_start()

    def advance(self, nbytes: int = 0, items: int = 0, detail: str = "") -> None:
        """Count `nbytes` bytes and `items` items done; `detail` names what finished (file, layer)."""
        with self._lock:
            if not self._active:
                self._active = True
                self._t0 = time.monotonic()
                self._last_emit = self._t0
                self._on_start()
            self.bytes_done += int(nbytes)
            self.items_done += int(items)
            if detail:
                self.detail = detail
            now = time.monotonic()
            due = now - self._last_emit >= self.interval
            if due:
                self._last_emit = now
            self._on_advance(int(nbytes), due)

    def message(self, text: str) -> None:
        """A one-line notice (resume state, skipped files) shown between progress updates."""
        with self._lock:
            self._on_message(str(text))

    def close(self) -> None:
        """End the current phase (final line / event); safe to call twice."""
        with self._lock:
            if self._active:
                self._finish_phase()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # helpers for renderers -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def snapshot(self) -> dict:
        """The counters as a plain dict (what the JSON events carry)."""
        return {"label": self.label, "bytes": self.bytes_done, "total_bytes": self.total_bytes,
                "items": self.items_done, "total_items": self.total_items,
                "elapsed_s": round(self.elapsed(), 3)}

    def _finish_phase(self) -> None:
        self._active = False
        self._on_done()

    def _on_start(self) -> None:
        pass

    def _on_advance(self, nbytes: int, due: bool) -> None:
        pass

    def _on_message(self, text: str) -> None:
        pass

    def _on_done(self) -> None:
        pass


class JsonLinesProgress(Progress):
    """Machine-readable events, one JSON object per line."""

    def _emit(self, event: str, **extra) -> None:
        record = {"event": event, **self.snapshot(), **extra}
        self.stream.write(json.dumps(record, sort_keys=True) + "\n")
        self.stream.flush()

    def _on_start(self) -> None:
        self._emit("start")

    def _on_advance(self, nbytes: int, due: bool) -> None:
        if due:
            self._emit("progress", detail=self.detail)

    def _on_message(self, text: str) -> None:
        self.stream.write(json.dumps({"event": "message", "label": self.label, "text": text}, sort_keys=True) + "\n")
        self.stream.flush()

    def _on_done(self) -> None:
        self._emit("done")


class PlainProgress(Progress):
    """Periodic plain lines for logs that are not a terminal (CI)."""

    def _line(self) -> str:
        parts = []
        if self.total_bytes:
            pct = 100.0 * self.bytes_done / self.total_bytes
            parts.append(f"{pct:.1f}% {human_bytes(self.bytes_done)}/{human_bytes(self.total_bytes)}")
        else:
            parts.append(human_bytes(self.bytes_done))
        if self.total_items or self.items_done:
            total = f"/{self.total_items}" if self.total_items else ""
            parts.append(f"{self.items_done}{total} items")
        elapsed = self.elapsed()
        if elapsed > 0 and self.bytes_done:
            rate = self.bytes_done / elapsed
            parts.append(f"{human_bytes(rate)}/s")
            if self.total_bytes > self.bytes_done and rate > 0:
                parts.append(f"eta {int((self.total_bytes - self.bytes_done) / rate)}s")
        parts.append(f"{elapsed:.1f}s")
        text = ", ".join(parts)
        if self.detail:
            text += f" [{self.detail}]"
        return f"{self.label or 'progress'}: {text}"

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _on_start(self) -> None:
        total = f" ({human_bytes(self.total_bytes)}" + (f", {self.total_items} items)" if self.total_items else ")") \
            if self.total_bytes else (f" ({self.total_items} items)" if self.total_items else "")
        self._write(f"{self.label or 'progress'}: started{total}")

    def _on_advance(self, nbytes: int, due: bool) -> None:
        if due:
            self._write(self._line())

    def _on_message(self, text: str) -> None:
        self._write(f"{self.label}: {text}" if self.label else text)

    def _on_done(self) -> None:
        self._write(self._line() + " done")


class TqdmProgress(Progress):
    """A tqdm bar in bytes on a terminal; items and the last detail in the postfix."""

    draws_bars = True

    def __init__(self, stream=None, interval: float = 0.2):
        super().__init__(stream, interval)
        self._bar = None

    def _on_start(self) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=self.total_bytes or None, desc=self.label or None, unit="B", unit_scale=True,
                         unit_divisor=1024, file=self.stream, dynamic_ncols=True, leave=True)

    def _postfix(self) -> str:
        items = ""
        if self.total_items or self.items_done:
            items = f"{self.items_done}/{self.total_items}" if self.total_items else str(self.items_done)
        return " ".join(p for p in (items, self.detail) if p)

    def _on_advance(self, nbytes: int, due: bool) -> None:
        if self._bar is None:
            return
        self._bar.update(nbytes)
        if due:
            self._bar.set_postfix_str(self._postfix(), refresh=False)

    def _on_message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")

    def _on_done(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.close()
            self._bar = None


def _interval(default: float) -> float:
    raw = os.environ.get(ENV_INTERVAL)
    if raw is None:
        return default
    try:
        return max(0.0, float(raw))
    except ValueError:
        return default


def choose_progress(quiet: bool = False, json_lines: bool = False, stream=None) -> Progress:
    """The reporter for this process: quiet / JSON lines / tqdm on a terminal / plain periodic lines."""
    stream = stream if stream is not None else sys.stderr
    if quiet or os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return Progress(stream)
    if json_lines:
        return JsonLinesProgress(stream, _interval(1.0))
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return TqdmProgress(stream, _interval(0.2))
    return PlainProgress(stream, _interval(10.0))


@contextlib.contextmanager
def make_progress(quiet: bool = False, json_lines: bool = False, stream=None):
    """Context manager yielding a `Progress` (see module docstring); closes it on exit, also on error."""
    progress = choose_progress(quiet=quiet, json_lines=json_lines, stream=stream)
    try:
        yield progress
    finally:
        progress.close()

"""Progress reporting for long operations (convert, publish, download, bundle).

The CLI builds a reporter with `make_progress` and hands it to library code, which only calls four methods:

    with make_progress(quiet=False, json_lines=False) as progress:
        progress.start(total_bytes, total_items, "convert", unit="matrices")   # a new phase (what items count)
        progress.advance(nbytes, items=1, detail="layer 3")    # thread-safe
        progress.message("resuming: 12 of 40 layers done")
    # on exit: a final line / event with totals and elapsed time, saying how the phase ended (done, interrupted
    # by Ctrl-C, failed by an exception)

Renderers, chosen once:
* ``quiet=True`` or ``KTCONVERT_NO_PROGRESS=1``: nothing (messages too).
* ``json_lines=True``: one JSON object per line on stderr: ``{"event": "start"|"progress"|"message"|"done"|
  "interrupted"|"failed", ...}`` with ``label, bytes, total_bytes, items, total_items, unit, elapsed_s`` (+ ``eta_s``
  on "progress", ``detail`` / ``text``). "progress" events are throttled to one per interval
  (``KTCONVERT_PROGRESS_INTERVAL`` seconds, default 1); none repeats the counters of the event that ends the phase
  (a phase at its totals says so once, in its end event). A phase ends with exactly one of done / interrupted /
  failed.
* stderr is a terminal: a tqdm bar in bytes, items and the last detail in the postfix.
* otherwise (CI logs): a plain line per interval (default 10 s): ``label: 45.0% 1.20 GiB/2.67 GiB, 3/10 layers,
  ...`` (items named by the phase's ``unit``; a phase that counts no bytes shows none); the last line of a phase ends
  in ``done``, ``interrupted`` or ``failed``. The terminal bar fits its label to the width (rate and ETA stay).

Rate and ETA count from the first bytes reported (``advance``), not from ``start``: what runs before the first piece
of work (imports of torch / compressed-tensors, opening the source) does not skew them.

Third-party output: inside `make_progress`, quiet and JSON-lines runs are exact (stderr holds our JSON lines or
nothing): progress bars (tqdm, huggingface_hub, transformers), log lines (``logging``, llmcompressor's and
compressed-tensors' loguru loggers, which write to stdout) and Python warnings are switched off. Plain-line runs switch
off the bars and the loguru loggers; a terminal run leaves third-party output alone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import warnings

ENV_DISABLE = "KTCONVERT_NO_PROGRESS"
ENV_INTERVAL = "KTCONVERT_PROGRESS_INTERVAL"
DONE, INTERRUPTED, FAILED = "done", "interrupted", "failed"   # how a phase ended

# Switches third-party libraries read from the environment when they are imported (the CLI imports them inside
# make_progress). "bars": progress bars; "loguru": llmcompressor's / compressed-tensors' loggers; "logs": the rest.
_SILENCING_ENV = {
    "bars": {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
    "loguru": {"LLM_COMPRESSOR_LOG_DISABLED": "true", "COMPRESSED_TENSORS_LOG_DISABLED": "true"},
    "logs": {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"},
}
_LOGURU_LIBRARIES = ("llmcompressor", "compressed_tensors")


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
    `silences`: which third-party output make_progress switches off while this reporter is in use (see
    quiet_third_party).
    """

    draws_bars = False
    silences = frozenset({"bars", "loguru", "logs"})
    clock = staticmethod(time.monotonic)   # seconds; tests put a fake clock on an instance

    def __init__(self, stream=None, interval: float = 1.0):
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.label = ""
        self.total_bytes = 0
        self.total_items = 0
        self.unit = "items"
        self.bytes_done = 0
        self.items_done = 0
        self.detail = ""
        self._t0 = self.clock()
        self._work_t0: float | None = None    # when the first bytes were reported (the rate clock)
        self._work_bytes0 = 0
        self._last_emit = 0.0
        self._lock = threading.Lock()
        self._active = False

    # public API ------------------------------------------------------------------------------------------
    def start(self, total_bytes: int = 0, total_items: int = 0, label: str = "", unit: str = "items") -> None:
        """Begin a phase of `total_bytes` bytes and `total_items` items (0 = unknown; `unit` names what an item is:
        "layers", "files", "matrices"). Ends the previous phase."""
        with self._lock:
            if self._active:
                self._finish_phase()
            self.label = label
            self.total_bytes = int(total_bytes or 0)
            self.total_items = int(total_items or 0)
            self.unit = unit or "items"
            self.bytes_done = 0
            self.items_done = 0
            self.detail = ""
            self._t0 = self.clock()
            self._work_t0 = None
            self._last_emit = self._t0
            self._active = True
            self._on_start()

    def advance(self, nbytes: int = 0, items: int = 0, detail: str = "") -> None:
        """Count `nbytes` bytes and `items` items done; `detail` names what finished (file, layer)."""
        with self._lock:
            if not self._active:
                self._active = True
                self._t0 = self.clock()
                self._work_t0 = None
                self._last_emit = self._t0
                self._on_start()
            if self._work_t0 is None and nbytes:
                self._work_t0, self._work_bytes0 = self.clock(), self.bytes_done + int(nbytes)
                self._on_work_started()
            self.bytes_done += int(nbytes)
            self.items_done += int(items)
            if detail:
                self.detail = detail
            now = self.clock()
            due = now - self._last_emit >= self.interval
            if due:
                self._last_emit = now
            self._on_advance(int(nbytes), due)

    def message(self, text: str) -> None:
        """A one-line notice (resume state, skipped files) shown between progress updates."""
        with self._lock:
            self._on_message(str(text))

    def close(self, status: str = DONE) -> None:
        """End the current phase with a final line / event saying `status` (DONE, INTERRUPTED, FAILED); safe to
        call twice."""
        with self._lock:
            if self._active:
                self._finish_phase(status)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close the phase as done, or as interrupted (KeyboardInterrupt) / failed (any other exception)."""
        if exc_type is None:
            self.close(DONE)
        else:
            self.close(INTERRUPTED if issubclass(exc_type, KeyboardInterrupt) else FAILED)

    # helpers for renderers -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self._t0

    def rate(self) -> float | None:
        """Bytes per second since the first bytes were reported (None before a second report)."""
        if self._work_t0 is None:
            return None
        seconds, nbytes = self.clock() - self._work_t0, self.bytes_done - self._work_bytes0
        return nbytes / seconds if seconds > 0 and nbytes > 0 else None

    def eta(self) -> float | None:
        """Seconds left at rate() (None when unknown)."""
        rate = self.rate()
        if rate is None or not self.total_bytes or self.bytes_done >= self.total_bytes:
            return None
        return (self.total_bytes - self.bytes_done) / rate

    def snapshot(self) -> dict:
        """The counters as a plain dict (what the JSON events carry)."""
        return {"label": self.label, "bytes": self.bytes_done, "total_bytes": self.total_bytes,
                "items": self.items_done, "total_items": self.total_items, "unit": self.unit,
                "elapsed_s": round(self.elapsed(), 3)}

    def at_totals(self) -> bool:
        """Every known total reached (what the phase's end event then says)."""
        known = [(done, total) for done, total in ((self.bytes_done, self.total_bytes),
                                                   (self.items_done, self.total_items)) if total]
        return bool(known) and all(done >= total for done, total in known)

    def _finish_phase(self, status: str = DONE) -> None:
        self._active = False
        self._on_done(status)

    def _on_start(self) -> None:
        pass

    def _on_work_started(self) -> None:
        pass

    def _on_advance(self, nbytes: int, due: bool) -> None:
        pass

    def _on_message(self, text: str) -> None:
        pass

    def _on_done(self, status: str) -> None:
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
        if due and not self.at_totals():       # at its totals the phase's end event says it, once
            eta = self.eta()
            self._emit("progress", detail=self.detail, eta_s=None if eta is None else round(eta, 1))

    def _on_message(self, text: str) -> None:
        self.stream.write(json.dumps({"event": "message", "label": self.label, "text": text}, sort_keys=True) + "\n")
        self.stream.flush()

    def _on_done(self, status: str) -> None:
        self._emit(status)


class PlainProgress(Progress):
    """Periodic plain lines for logs that are not a terminal (CI)."""

    silences = frozenset({"bars", "loguru"})

    def _line(self) -> str:
        parts = []
        if self.total_bytes:
            pct = 100.0 * self.bytes_done / self.total_bytes
            parts.append(f"{pct:.1f}% {human_bytes(self.bytes_done)}/{human_bytes(self.total_bytes)}")
        elif self.bytes_done or not (self.total_items or self.items_done):
            parts.append(human_bytes(self.bytes_done))
        elif self.total_items:                      # a phase counting items only (expert-stats: layers)
            parts.append(f"{100.0 * self.items_done / self.total_items:.1f}%")
        if self.total_items or self.items_done:
            total = f"/{self.total_items}" if self.total_items else ""
            parts.append(f"{self.items_done}{total} {self.unit}")
        rate, eta = self.rate(), self.eta()
        if rate is not None:
            parts.append(f"{human_bytes(rate)}/s")
        if eta is not None:
            parts.append(f"eta {int(eta)}s")
        parts.append(f"{self.elapsed():.1f}s")
        text = ", ".join(parts)
        if self.detail:
            text += f" [{self.detail}]"
        return f"{self.label or 'progress'}: {text}"

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _on_start(self) -> None:
        items = f"{self.total_items} {self.unit}"
        total = f" ({human_bytes(self.total_bytes)}" + (f", {items})" if self.total_items else ")") \
            if self.total_bytes else (f" ({items})" if self.total_items else "")
        self._write(f"{self.label or 'progress'}: started{total}")

    def _on_advance(self, nbytes: int, due: bool) -> None:
        if due:
            self._write(self._line())

    def _on_message(self, text: str) -> None:
        self._write(f"{self.label}: {text}" if self.label else text)

    def _on_done(self, status: str) -> None:
        self._write(f"{self._line()} {status}")


class TqdmProgress(Progress):
    """A tqdm bar in bytes on a terminal; items and the last detail in the postfix."""

    draws_bars = True
    silences = frozenset()

    def __init__(self, stream=None, interval: float = 0.2, ncols: int | None = None):
        super().__init__(stream, interval)
        self._bar = None
        self._ncols = ncols                 # None: the terminal's width, followed as it changes
        self._by_items = False              # a phase counting no bytes: the bar counts its items
        self._items_shown = 0

    def _on_start(self) -> None:
        from tqdm.auto import tqdm

        width = self._ncols or shutil.get_terminal_size((80, 24)).columns
        self._by_items = not self.total_bytes and bool(self.total_items)
        self._items_shown = 0
        if self._by_items:
            unit = dict(unit=f" {self.unit}")
        else:
            unit = dict(unit="B", unit_scale=True, unit_divisor=1024)
        self._bar = tqdm(total=(self.total_items if self._by_items else self.total_bytes) or None,
                         desc=fit_label(self.label, width - BAR_STATS_WIDTH) or None, file=self.stream,
                         dynamic_ncols=self._ncols is None, ncols=self._ncols, leave=True, **unit)

    def _postfix(self) -> str:
        items = ""
        if (self.total_items or self.items_done) and not self._by_items:
            items = f"{self.items_done}/{self.total_items}" if self.total_items else str(self.items_done)
            items += f" {self.unit}"
        return items or self.detail         # the count when there is one: the line must fit its width

    def _on_advance(self, nbytes: int, due: bool) -> None:
        if self._bar is None:
            return
        if self._by_items:
            self._bar.update(self.items_done - self._items_shown)
            self._items_shown = self.items_done
        else:
            self._bar.update(nbytes)
        if due:
            self._bar.set_postfix_str(self._postfix(), refresh=False)

    def _on_message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")

    def _on_work_started(self) -> None:
        if self._bar is not None:
            self._bar.unpause()   # tqdm's rate clock starts now, not when the bar was drawn

    def _on_done(self, status: str) -> None:
        if self._bar is not None:
            postfix = self._postfix() if status == DONE else " ".join(p for p in (self._postfix(), status) if p)
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.close()
            self._bar = None


BAR_STATS_WIDTH = 62     # what a tqdm byte bar needs beside its label: percent, a short bar, sizes, time, rate, ETA


def fit_label(label: str, width: int) -> str:
    """`label` in at most `width` characters (at least 12): a label joining several outputs with " + " becomes
    "<its first word> N outputs", anything else is cut with "…"."""
    width = max(12, width)
    if len(label) <= width:
        return label
    parts = label.split(" + ")
    if len(parts) > 1:
        short = f"{parts[0].split(' ')[0]} {len(parts)} outputs"
        if len(short) <= width:
            return short
    return label[:width - 1] + "…"


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
    """Context manager yielding a `Progress` (see module docstring). On exit the phase is closed as done, or as
    interrupted (KeyboardInterrupt) / failed (any other exception), which then propagates. Third-party output is
    switched off as the reporter's `silences` say for the duration."""
    progress = choose_progress(quiet=quiet, json_lines=json_lines, stream=stream)
    with quiet_third_party(progress.silences), progress:
        yield progress


@contextlib.contextmanager
def quiet_third_party(kinds=frozenset({"bars", "loguru", "logs"})):
    """Switch third-party output off while the block runs. kinds: "bars" (tqdm, huggingface_hub and transformers
    progress bars), "loguru" (llmcompressor's and compressed-tensors' loggers, which write to stdout), "logs"
    (every `logging` record and every Python warning).

    Libraries imported inside the block read the environment switches; those already imported are switched through
    their own APIs. Everything but the loguru loggers is restored on exit (those stay off for the process: loguru
    cannot say whether a library was enabled before).
    """
    kinds = frozenset(kinds)
    env = {key: value for kind in sorted(kinds) for key, value in _SILENCING_ENV.get(kind, {}).items()}
    saved_env = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    saved_logging = logging.root.manager.disable
    with contextlib.ExitStack() as stack:
        if "bars" in kinds:
            stack.enter_context(_loaded_library_bars_off())
        if "loguru" in kinds and "loguru" in sys.modules:
            from loguru import logger

            for library in _LOGURU_LIBRARIES:
                logger.disable(library)
        if "logs" in kinds:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            logging.disable(logging.CRITICAL)
        try:
            yield
        finally:
            logging.disable(saved_logging)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@contextlib.contextmanager
def _loaded_library_bars_off():
    """huggingface_hub's and transformers' own bar switches, for whichever of them is already imported."""
    restore = []
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if not are_progress_bars_disabled():
            disable_progress_bars()
            restore.append(enable_progress_bars)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.append(hf_logging.enable_progress_bar)
    try:
        yield
    finally:
        for switch_back in restore:
            switch_back()

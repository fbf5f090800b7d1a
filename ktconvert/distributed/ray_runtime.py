"""The driver's side of Ray, whatever runs on it: joining a cluster, and where Ray's own output goes.

* ``connect``: ``ray.init`` started from the folder holding the installed ktconvert package. Ray puts the driver's
  current folder first on every worker's ``sys.path`` (Ray 2.60, ``worker.connect``: ``py_driver_sys_path``), so a
  run started from a folder holding another ``ktconvert`` (a checkout) would have every task import that one; from
  the package's own folder the workers find the package the driver runs, or, on a node without that folder, the
  one installed there (the pre-flight checks it is the same version: ``ktconvert.distributed.preflight``).
  ``shut_down_after``: a run that joined Ray itself leaves it at its end, while Ray's output is still logged.
* ``ray_output``: while a run is on Ray, Ray's messages (the raylet's fault reports, which Ray 2.60 prints on the
  driver's stdout through ``ray._private.worker.print_to_stdstream``, and the ``ray`` logger's records) go to a log
  file (the parts folder's ``ray.log``), with the driver's own fault notices (``note_fault``) and the error lines
  the driver's Ray core (C++) writes on stderr (``native_lines_to``). Each fault is one line on the run's progress
  (stderr) naming that file: the first message of a burst (one fault's reports arrive together: a raylet's
  termination, its node marked dead, the parts started again, a lock taken over); stdout carries only the result,
  so ``--json`` stays JSON after any fault. Messages that arrive after the run go to the last log too, never to
  stdout. Runs without a parts folder (GPTQ, batch) use ``temp_log`` (``route_to_log`` where there is no progress
  to tell: GPTQ's stream).

``import ray`` happens inside the functions only.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import ktconvert

RAY_LOG = "ray.log"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NATIVE_LOG = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWEF] \d+ \d+\] ")
BURST_SECONDS = 60       # the messages of one fault arrive within this: one line on the progress for all of them
_sink: dict = {"log": None, "progress": None, "said": None}    # where Ray's messages go now (ray_output)
_sink_lock = threading.Lock()


def connect(address: str | None):
    """The ray module, connected to `address` (or the cluster this process already joined, or a new local one);
    Ray started from the package's folder (the module docstring)."""
    import ray

    if not ray.is_initialized():
        with package_folder():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    return ray


def ray_initialized() -> bool:
    """Whether this process has joined a Ray cluster (``ray.init``)."""
    import ray

    return ray.is_initialized()


@contextmanager
def shut_down_after(ray, joined_here: bool):
    """The block, then, when `joined_here` (this run joined Ray: ``connect`` on a process not yet joined),
    ``ray.shutdown()``: inside ``ray_output`` what Ray's core says as it stops (the tasks it could not report after
    a fault) goes to the log, not to stderr after the run's last line."""
    try:
        yield
    finally:
        if joined_here:
            ray.shutdown()


@contextmanager
def package_folder():
    """The current folder set to the one holding the installed ktconvert package while the block runs."""
    here = os.getcwd()
    os.chdir(Path(ktconvert.__file__).resolve().parent.parent)
    try:
        yield
    finally:
        os.chdir(here)


def temp_log() -> Path:
    """The Ray log of a run without a parts folder: ktconvert-ray-PID.log in the temporary folder."""
    return Path(tempfile.gettempdir()) / f"ktconvert-ray-{os.getpid()}.log"


def route_to_log(log) -> Path:
    """Ray's raylet messages to file `log` from now on (none to stdout); returns `log`."""
    import ray._private.worker as ray_worker      # Ray 2.60 prints the raylet's messages through it

    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    if getattr(ray_worker.print_to_stdstream, "__module__", "") != __name__:
        ray_worker.print_to_stdstream = _to_log
    with _sink_lock:
        _sink["log"] = log
    return log


@contextmanager
def ray_output(log, progress):
    """Ray's messages to file `log` (created with its folder) while the block runs, the ``ray`` logger's records
    there too; each fault said in one line on `progress` naming `log` (``note_fault``)."""
    log = route_to_log(log)
    logger = logging.getLogger("ray")
    handler = logging.FileHandler(log)
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False
    with _sink_lock:
        _sink.update(progress=progress, said=None)
    try:
        with native_lines_to(log):
            yield log
    finally:
        with _sink_lock:
            _sink["progress"] = None
        logger.handlers, logger.propagate = saved
        handler.close()


@contextmanager
def native_lines_to(log):
    """While the block runs, this process's stderr (file descriptor 2) read through a pipe: lines in the format of
    Ray's native (C++) log (``[2026-01-01 10:00:00,000 E 123 456] file.cc:12: ...``, which the driver's Ray core
    writes there whatever its log file says, e.g. one per task it cannot report after a node's death) appended to
    `log`, every other byte passed on to the real stderr as it comes."""
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError):                 # no stderr to read through
        yield
        return
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump():                                   # never stops reading before the pipe ends: a writer would block
        held = b""                                # an unfinished line that may be a native one
        try:
            fh = open(log, "ab")
        except OSError:                           # no log to write: every line goes on to stderr
            fh = None
        try:
            while chunk := os.read(read, 1 << 16):
                lines = (held + chunk).splitlines(keepends=True)
                held = lines.pop() if not lines[-1].endswith(b"\n") else b""
                if held and not held.startswith(b"["):
                    lines, held = lines + [held], b""     # a progress bar's \r update goes out at once
                for line in lines:
                    if not (fh is not None and _NATIVE_LOG.match(line) and _append(fh, b"(driver) " + line)):
                        _write(real, line)
            _write(real, held)
        finally:
            if fh is not None:
                fh.close()
            os.close(read)

    thread = threading.Thread(target=pump, name="ktconvert-ray-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)                          # the pipe's last writer closed: the pump ends
        thread.join(timeout=10)
        if not thread.is_alive():                 # else a process started meanwhile holds the pipe: the pump goes
            os.close(real)                        # on passing its lines to stderr


def _append(fh, line: bytes) -> bool:
    """`line` appended to the open log `fh`; False where the log cannot be written."""
    try:
        fh.write(line)
        fh.flush()
        return True
    except OSError:
        return False


def _write(fd: int, data: bytes) -> None:
    """`data` written whole to `fd` (a stderr that is gone loses it)."""
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


def note_fault(text: str, progress) -> None:
    """A fault notice of the driver (a lost progress actor, a part started again, a lock taken over): inside
    ``ray_output``, appended to its log and said on its progress, in one line naming the log, only when it opens a
    burst (no line said in the last BURST_SECONDS: one fault's raylet reports and notices arrive together);
    elsewhere `text` on `progress`."""
    with _sink_lock:
        active = _sink["progress"] is not None
    if active:
        _to_log({"lines": [text], "pid": "ktconvert"})
    else:
        progress.message(text)


def _to_log(data: dict, ignore_prefix: bool = False) -> None:
    """``print_to_stdstream``'s replacement: the lines appended to the current log; the first one said as in
    ``note_fault`` (nothing when no run has set a log: Ray printed nothing to ktconvert's stdout either)."""
    lines = [_ANSI.sub("", str(line)) for line in data.get("lines", [])]
    now = time.monotonic()
    with _sink_lock:
        log, progress, said = _sink["log"], _sink["progress"], _sink.get("said")
        opens = progress is not None and (said is None or now - said > BURST_SECONDS)
        if opens:
            _sink["said"] = now
    if log is None or not lines:
        return
    try:
        with open(log, "a", encoding="utf-8") as fh:
            fh.writelines(f"({data.get('pid', 'ray')}) {line}\n" for line in lines)
    except OSError:
        pass                                      # a log that cannot be written must not stop the run
    first = next((line.strip() for line in lines if line.strip()), "")
    if opens and first:
        if data.get("pid") != "ktconvert":      # a raylet's report: its first line, cut
            first = f"Ray: {first[:160]}{'...' if len(first) > 160 else ''}"
        progress.message(f"{first} (details: {log})")

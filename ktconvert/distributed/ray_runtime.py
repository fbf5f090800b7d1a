"""The driver's side of Ray, whatever runs on it: joining a cluster, and where Ray's own output goes.

* ``connect``: ``ray.init`` started from the folder holding the installed ktconvert package. Ray puts the driver's
  current folder first on every worker's ``sys.path`` (Ray 2.60, ``worker.connect``: ``py_driver_sys_path``), so a
  run started from a folder holding another ``ktconvert`` (a checkout) would have every task import that one; from
  the package's own folder the workers find the package the driver runs, or, on a node without that folder, the
  one installed there (the pre-flight checks it is the same version: ``ktconvert.distributed.preflight``).
* ``ray_output``: while a run is on Ray, Ray's messages (the raylet's fault reports, which Ray 2.60 prints on the
  driver's stdout through ``ray._private.worker.print_to_stdstream``, and the ``ray`` logger's records) go to a log
  file (the parts folder's ``ray.log``), and each raylet message becomes one line on the run's progress
  (stderr) naming that file: stdout carries only the result, so ``--json`` stays JSON after any fault. Messages
  that arrive after the run go to the last log too, never to stdout. Runs without a parts folder (GPTQ, batch)
  use ``temp_log`` (``route_to_log`` where there is no progress to tell: GPTQ's stream).

``import ray`` happens inside the functions only.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import ktconvert

RAY_LOG = "ray.log"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_sink: dict = {"log": None, "progress": None}      # where Ray's messages go now (ray_output)
_sink_lock = threading.Lock()


def connect(address: str | None):
    """The ray module, connected to `address` (or the cluster this process already joined, or a new local one);
    Ray started from the package's folder (the module docstring)."""
    import ray

    if not ray.is_initialized():
        with package_folder():
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    return ray


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
    """Ray's messages to file `log` (created with its folder) while the block runs, each raylet message also one
    line on `progress` (``progress.message``) naming `log`; the ``ray`` logger's records to `log` only."""
    log = route_to_log(log)
    logger = logging.getLogger("ray")
    handler = logging.FileHandler(log)
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False
    with _sink_lock:
        _sink["progress"] = progress
    try:
        yield log
    finally:
        with _sink_lock:
            _sink["progress"] = None
        logger.handlers, logger.propagate = saved
        handler.close()


def _to_log(data: dict, ignore_prefix: bool = False) -> None:
    """``print_to_stdstream``'s replacement: the lines appended to the current log, the first one as a progress
    message naming it (nothing when no run has set a log: Ray printed nothing to ktconvert's stdout either)."""
    lines = [_ANSI.sub("", str(line)) for line in data.get("lines", [])]
    with _sink_lock:
        log, progress = _sink["log"], _sink["progress"]
    if log is None or not lines:
        return
    try:
        with open(log, "a", encoding="utf-8") as fh:
            fh.writelines(f"({data.get('pid', 'ray')}) {line}\n" for line in lines)
    except OSError:
        pass                                      # a log that cannot be written must not stop the run
    first = next((line.strip() for line in lines if line.strip()), "")
    if progress is not None and first:
        progress.message(f"Ray: {first[:160]}{'...' if len(first) > 160 else ''} (details: {log})")

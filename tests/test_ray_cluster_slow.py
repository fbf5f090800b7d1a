"""Faults on a real local Ray cluster: three ``ray start`` nodes on 127.0.0.1 (a head and two workers of 1 CPU,
each with its own temporary folder and ports), the CLI run against it as a user runs it (``--executor ray
--ray-address ... --json``), and while its parts run:

* the node hosting the progress actor, and the driver's node (the head), killed: SIGKILL on its raylet and
  workers (the head's GCS lives on);
* a worker node running a part frozen (SIGSTOP on its raylet and workers), Ray's health checks shortened so that
  it declares the node dead within about 6 s (the driver then starts its part again within NODE_CHECK_SECONDS).

Each run ends byte-identical to the single-process run, or fails with one ``error:`` line naming the log after
which an immediately started ``--resume --quiet`` ends byte-identical (stderr empty); stdout is one JSON document
whenever a run succeeds, stderr holds only progress lines (no traceback, no line of Ray's), one of them per fault.
The parts are slowed down on the nodes (a sitecustomize on the nodes' PYTHONPATH sleeps in every progress report of
a part) so that the faults land while parts run; the driver is not slowed. Every process the test started is
killed at the end (its nodes' process groups and the raylets' workers), none other.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from trees import tree

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install 'ktconvert[ray]')")
psutil = pytest.importorskip("psutil", reason="the fault injection finds a node's processes with psutil")

MODEL = dict(layers=7, experts=8, hidden=256, intermediate=512)      # deepseek_v3: MoE layers 1..6
CPU = ["--method", "amxint4", "--numa", "2"]
PARTS = 3
SLOW_S = 0.25               # sleep of a part's task per progress report (matrix): a part then runs for ~12 s
HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
          "RAY_health_check_failure_threshold": "5", "RAY_health_check_initial_delay_ms": "1000"}

SLOW_SITE = '''
import importlib.abc, importlib.util, os, sys, time

class _SlowParts(importlib.abc.MetaPathFinder):
    """Once ktconvert.distributed.ray_progress is imported (in a part's task), every progress report of a part
    sleeps SLOW_PART_S seconds first."""

    def find_spec(self, name, path, target=None):
        if name != "ktconvert.distributed.ray_progress":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            advance = module.BoardProgress._on_advance

            def slow(self, nbytes, due):
                time.sleep(float(os.environ["SLOW_PART_S"]))
                advance(self, nbytes, due)

            module.BoardProgress._on_advance = slow

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SLOW_PART_S"):
    sys.meta_path.insert(0, _SlowParts())
'''


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Node:
    """One ``ray start`` node: its process group (every process it started, workers included) and temp folder."""

    def __init__(self, pgid: int, temp_dir: Path, head: bool):
        self.pgid, self.temp_dir, self.head = pgid, temp_dir, head
        self.signalled: list = []

    def processes(self) -> list:
        """The node's live processes: its process group and the raylet's descendants (Ray's workers run in
        sessions of their own)."""
        found = {}
        for proc in psutil.process_iter(["pid", "name"]):
            try:
                if os.getpgid(proc.pid) == self.pgid:
                    found[proc.pid] = proc
                    if proc.info["name"] == "raylet":
                        found.update((child.pid, child) for child in proc.children(recursive=True))
            except (ProcessLookupError, psutil.Error):
                pass
        return list(found.values())

    def raylet_and_workers(self) -> list:
        """The raylet and its descendants (workers, agents); [] once the raylet is gone."""
        raylet = next((p for p in self.processes() if p.name() == "raylet"), None)
        return [] if raylet is None else [raylet] + raylet.children(recursive=True)

    def signal(self, sig: int) -> list:
        """`sig` to the raylet and its workers (remembered, for ``stop``); the processes that got it."""
        procs = self.raylet_and_workers()
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        self.signalled += procs
        return procs

    def hosts(self, pid: int) -> bool:
        return any(proc.pid == pid for proc in self.processes())

    def stop(self) -> None:
        """Every process of the node (and any it was sent a signal to) woken, a frozen one too, and killed; its
        temp folder removed."""
        procs = self.processes() + self.signalled
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for proc in procs:
                try:
                    if proc.is_running():           # the same process (pid and start time), not a new one
                        proc.send_signal(sig)
                except psutil.Error:
                    pass
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class LocalCluster:
    """A head and `workers` nodes started with ``ray start`` (1 CPU, 80 MiB object store each) in their own process
    groups, with `env` (on top of os.environ) and Ray's token authentication off (Ray 2.60)."""

    def __init__(self, workers: int, env: dict):
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **env}
        self.env.pop("RAY_ADDRESS", None)
        self.nodes: list[Node] = []
        self.address = None
        try:
            self._start(head=True)
            for _ in range(workers):
                self._start(head=False)
            self.wait_alive(workers + 1)
        except BaseException:
            self.stop()
            raise

    def _start(self, head: bool) -> None:
        temp_dir = Path(tempfile.mkdtemp(prefix="kr"))       # short: Ray's socket paths must stay under 108 bytes
        ports = free_ports(8)
        command = [str(Path(sys.executable).with_name("ray")), "start", "--num-cpus", "1",
                   "--object-store-memory", str(80 << 20), "--temp-dir", str(temp_dir),
                   "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
                   "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
                   "--min-worker-port", "0", "--max-worker-port", "0",
                   "--dashboard-agent-listen-port", str(ports[2]), "--dashboard-agent-grpc-port", str(ports[3]),
                   "--runtime-env-agent-port", str(ports[4]), "--metrics-export-port", str(ports[5])]
        if head:
            command += ["--head", "--port", str(ports[6]), "--include-dashboard", "false",
                        "--dashboard-port", str(ports[7])]
        else:
            command += ["--address", self.address]
        starter = subprocess.Popen(command, env=self.env, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        self.nodes.append(Node(starter.pid, temp_dir, head))
        out, _ = starter.communicate(timeout=120)
        assert starter.returncode == 0, out[-2000:]
        if head:
            self.address = f"127.0.0.1:{ports[6]}"

    def alive(self) -> int:
        done = subprocess.run([sys.executable, "-c", "import ray; ray.init(address=%r, logging_level='ERROR'); "
                               "print(sum(n['Alive'] for n in ray.nodes()))" % self.address],
                              env=self.env, capture_output=True, text=True, timeout=120)
        return int(done.stdout.strip() or 0)

    def wait_alive(self, n: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while self.alive() != n:
            assert time.monotonic() < end, f"{n} nodes never alive"
            time.sleep(1)

    def node_of(self, pid: int) -> Node | None:
        return next((node for node in self.nodes if node.hosts(pid)), None)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("cluster") / "ds", "deepseek_v3", **MODEL)


@pytest.fixture(scope="module")
def single(source, tmp_path_factory):
    """The reference: the single-process run of the same options."""
    out = tmp_path_factory.mktemp("single") / "out"
    done = subprocess.run([str(Path(sys.executable).with_name("ktconvert")), "cpu", str(source), str(out), *CPU,
                           "--json", "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def cluster(tmp_path):
    """A head and two worker nodes whose parts are slowed down (SLOW_SITE), with short health checks; every
    process stopped after the test, a frozen one too."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    path = os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    nodes = LocalCluster(2, {"PYTHONPATH": path, "SLOW_PART_S": str(SLOW_S), **HEALTH})
    yield nodes
    nodes.stop()


class Run:
    """The CLI converting `source` into `out` on `cluster` (``--parts 3 --json``, plain progress on stderr), started
    from `cwd` without the nodes' test variables."""

    def __init__(self, cluster: LocalCluster, source: Path, out: Path, *extra: str):
        self.cluster, self.out, self.parts = cluster, out, out.with_name(out.name + ".parts")
        self.env = {k: v for k, v in cluster.env.items() if k not in ("PYTHONPATH", "SLOW_PART_S")}
        if os.environ.get("PYTHONPATH"):
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.command = [str(Path(sys.executable).with_name("ktconvert")), "cpu", str(source), str(out), *CPU,
                        "--executor", "ray", "--ray-address", cluster.address, "--parts", str(PARTS), "--json",
                        *extra]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command, env=self.env, cwd=out.parent, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def records(self) -> list[dict]:
        """The task records of the parts started so far."""
        folder = self.parts / ".ktconvert-tasks" / self.out.name
        found = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass                                        # being written
        return found

    def wait_for(self, what, timeout: float = 120):
        """`what()` once it is true; fails when the run ended or `timeout` passed first."""
        end = time.monotonic() + timeout
        while not (found := what()):
            assert self.proc.poll() is None, f"the run ended first: {self.proc.communicate()}"
            assert time.monotonic() < end, "timed out"
            time.sleep(0.2)
        return found

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


def check_outcome(run: Run, single: Path, faults: int) -> dict:
    """The faulted run ended byte-identical, or failed with one error line and an immediately started --resume
    (``--json --quiet``: stdout one JSON document, stderr empty) ended byte-identical. On stderr: only progress
    lines (no traceback, no line of Ray's), `faults` of them a fault notice naming the parts folder's ray.log, and
    on failure one last ``error:`` line naming it too. Returns the timings."""
    rc, out, err = run.finish()
    timings = {"run_s": round(time.monotonic() - run.t0, 1), "rc": rc}
    log = f"(details: {run.parts / 'ray.log'})"
    lines = err.splitlines()
    assert "Traceback" not in err, err
    label = f"{PARTS} parts on Ray: convert AMXINT4 T=2: "
    if rc:
        assert lines and lines[-1].startswith("error: ") and str(run.parts / "ray.log") in lines[-1], err
        lines = lines[:-1]
    else:
        assert isinstance(json.loads(out), dict)
        assert tree(run.out) == tree(single)
    assert all(line.startswith(label) for line in lines), err
    assert len([line for line in lines if line.endswith(log)]) == faults, err
    if rc:
        t0 = time.monotonic()
        done = subprocess.run(run.command + ["--resume", "--quiet"], env=run.env, cwd=run.out.parent,
                              capture_output=True, text=True, timeout=300)
        timings["resume_s"] = round(time.monotonic() - t0, 1)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert isinstance(json.loads(done.stdout), dict)
        assert tree(run.out) == tree(single)
    return timings


def board_node(cluster: LocalCluster):
    """The node whose processes include the progress actor (None before it runs)."""
    return next((node for node in cluster.nodes
                 if any("ProgressBoard" in " ".join(p.cmdline()) for p in node.raylet_and_workers())), None)


@pytest.mark.parametrize("target", ["progress actor", "driver"])
def test_node_killed_mid_run(cluster, source, single, tmp_path, target):
    """SIGKILL on the raylet and workers, once every part runs, of the node hosting the progress actor (the
    driver's node where Ray could place it there, else another), or of the driver's node (the head: the driver's
    raylet is gone, its run fails in one line and --resume, connected to another node, finishes it)."""
    run = Run(cluster, source, tmp_path / "out")
    run.wait_for(lambda: len(run.records()) == PARTS)
    host = run.wait_for(lambda: board_node(cluster)) if target == "progress actor" else cluster.nodes[0]
    assert host.signal(signal.SIGKILL)
    timings = check_outcome(run, single, faults=1)
    print(f"\nkill the {'head' if host.head else 'worker'} node ({target}): {timings}")


def test_frozen_worker_node_does_not_fail_the_run_on_the_lock(cluster, source, single, tmp_path):
    """SIGSTOP on the raylet and workers of a worker node running a part: Ray gives up on the node (short health
    checks) and the part, started again elsewhere, takes its lock over."""
    run = Run(cluster, source, tmp_path / "out")
    records = run.wait_for(lambda: len(run.records()) == PARTS and run.records())
    node = next(n for r in records if (n := cluster.node_of(r["pid"])) is not None and not n.head)
    assert node.signal(signal.SIGSTOP)
    timings = check_outcome(run, single, faults=1)
    print(f"\nfreeze a worker node running a part: {timings}")

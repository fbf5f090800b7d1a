"""Faults around a Ray run, simulated on one host: the progress actor killed (the run ends byte-identical, one line
said), a part's lock held by a process on another host (named as such) or by one Ray gave up on (taken over), a
finished part of another ktconvert version or of other options (converted again), a node of another version or
without SRC or whose --parts-dir the driver cannot see (refused before any part runs, naming the node, exit 3),
Ray's fault reports kept off stdout (in the parts folder's ray.log), and Ray started from the package's folder
(a folder holding another ``ktconvert`` does not shadow it on the workers); and the resources tasks declare (GPTQ
steps against docs/scale.md's hand-computed DeepSeek-V3 figures, batch jobs, the default --parts).

The lock, stale-part, pre-flight, output and resource checks run without Ray (fast); the others on the two-node
local cluster of conftest's ``cluster``. The reference of every byte comparison is the single-process run."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ktconvert import api
from ktconvert.distributed import preflight as preflight_module
from ktconvert.distributed import ray_runtime
from ktconvert.distributed.parts import (PART_NAME, lock_state, read_task_record, stale_reason, task_record_path,
                                         write_task_record)
from ktconvert.distributed.preflight import NodeError, check_node, check_reports
from ktconvert.formats.out_manifest import JOURNAL_NAME, LOCK_NAME, package_versions
from ktconvert.util.progress import Progress

from trees import tree

MODEL = dict(layers=4, experts=4, hidden=128, intermediate=256)   # deepseek_v3: layer 0 dense, MoE layers 1..3
CPU = dict(method="amxint4", numa=2)

ME = {"host": socket.gethostname(), "pid": os.getpid(), "node_id": "n-live", "task_id": "t-retry"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("faults") / "ds", "deepseek_v3", **MODEL)


@pytest.fixture(scope="module")
def single(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "out"
    api.convert_cpu(source, out, **CPU)
    return out


class Notes(Progress):
    """A quiet progress that keeps its messages."""

    def __init__(self):
        super().__init__()
        self.notes: list[str] = []

    def _on_message(self, text: str) -> None:
        self.notes.append(text)


@pytest.fixture
def held(tmp_path):
    """hold(holder, folder=tmp_path/layers-1-1): part folder `folder` whose lock this test holds (flock on its own
    open file, as another process would; "PID HOST" in it, as lock_folder writes) with `holder` as its task
    record; the descriptor closed after the test."""
    fds = []

    def hold(holder: dict, folder: Path | None = None) -> Path:
        folder = folder or tmp_path / "layers-1-1"
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, f"{holder['pid']} {holder['host']}\n".encode(), 0)     # as run.output.lock_folder writes it
        fds.append(fd)
        write_task_record(folder, holder)
        return folder

    yield hold
    for fd in fds:
        os.close(fd)


# ---------------------------------------------------------------- locks (no Ray)

def test_lock_of_a_live_holder_on_another_host_is_named_as_such(held):
    folder = held({"host": "node-b.example", "pid": 4242, "node_id": "n-live", "task_id": "t-other"})
    state, text = lock_state(folder, ME, lambda: {"n-live"})
    assert state == "held" and "held by pid 4242 on host node-b.example" in text and "t-other" in text
    assert (folder / LOCK_NAME).exists()


@pytest.mark.parametrize("holder, why", [
    ({"host": "node-b.example", "pid": 4242, "node_id": "n-dead", "task_id": "t-other"}, "node is dead"),
    ({"host": "node-b.example", "pid": 4242, "node_id": "n-live", "task_id": "t-retry"}, "earlier attempt"),
])
def test_lock_of_a_holder_ray_gave_up_on_is_taken_over(held, holder, why):
    folder = held(holder)
    inode = os.stat(folder / LOCK_NAME).st_ino
    state, text = lock_state(folder, ME, lambda: {"n-live"})
    assert state == "taken" and why in text and "pid 4242 on host node-b.example" in text
    assert not (folder / LOCK_NAME).exists()            # the stale holder keeps a lock on a file no longer there
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the next holder gets a new lock at once
        assert os.fstat(fd).st_ino != inode
    finally:
        os.close(fd)


def test_lock_of_a_dead_pid_on_this_host_is_taken_over_and_one_without_record_is_named(held, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = held({"host": socket.gethostname(), "pid": int(dead.stdout), "node_id": "", "task_id": ""})
    assert lock_state(folder, ME, lambda: set())[0] == "taken"
    task_record_path(folder).unlink()
    folder = held({"host": "", "pid": 77})               # a lock a plain `--layers` run holds: no task record
    task_record_path(folder).unlink()
    state, text = lock_state(folder, ME, lambda: set())
    assert state == "held" and "pid 77" in text and "no task record" in text
    assert lock_state(tmp_path / "nothing-here", ME, lambda: set()) == ("free", "")


# ---------------------------------------------------------------- stale parts (no Ray)

@pytest.fixture
def part(source, tmp_path):
    """A finished part (layers 1-1) and the journal options the Ray driver plans for this conversion."""
    from ktconvert.run.inputs import open_input
    from ktconvert.run.local import plan_outputs

    folder = tmp_path / "part"
    api.convert_cpu(source, folder, layers="1-1", **CPU)
    planned = plan_outputs(open_input(str(source), in_part=True), [(tmp_path / "out", CPU)], threads=1)[0]
    return folder, planned.journal_options()


def test_finished_part_of_another_version_or_options_is_stale(part):
    folder, options = part
    assert stale_reason(folder, options) is None
    assert "--method" in stale_reason(folder, {**options, "method": "amxint8"})
    record = json.loads((folder / PART_NAME).read_text())
    record["manifest"]["packages"]["ktconvert"] = "0.0.1"
    (folder / PART_NAME).write_text(json.dumps(record))
    why = stale_reason(folder, options)
    assert "ktconvert 0.0.1" in why and package_versions()["ktconvert"] in why


def test_unfinished_part_needs_a_task_record_of_this_version(part):
    folder, options = part
    (folder / PART_NAME).unlink()
    (folder / JOURNAL_NAME).write_text(json.dumps({"options": {**options, "part": [1]}, "layers": {}, "sources": {}}))
    assert "unknown ktconvert version" in stale_reason(folder, options)      # no record: another version's
    write_task_record(folder, {"host": "h", "pid": 1})
    assert read_task_record(folder)["packages"] == package_versions()
    assert stale_reason(folder, options) is None
    assert stale_reason(folder, options, versions={"numpy": "0"}).endswith("this is numpy 0")


# ---------------------------------------------------------------- pre-flight (no Ray)

@pytest.fixture
def node_context(monkeypatch):
    """check_node run in this process as node "n-1" would run it."""
    ray = pytest.importorskip("ray")

    class Context:
        def get_node_id(self):
            return "n-1"

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())


def test_preflight_names_the_node_and_what_to_fix(node_context, source, tmp_path):
    files = {str(p): p.stat().st_size for p in sorted(source.glob("*.safetensors"))}
    versions = package_versions()
    good = check_node(str(source), files, str(tmp_path / "parts"), "nonce")
    assert good["problems"] == [] and good["versions"] == versions
    check_reports([good], versions, tmp_path / "parts", "nonce")           # nothing to say
    # a node-local --parts-dir: the node's marker is not where the driver reads (the one there is an old run's)
    local = check_node(str(source), files, str(tmp_path / "node-local"), "nonce-2")
    with pytest.raises(NodeError, match="not visible to the driver") as info:
        check_reports([local], versions, tmp_path / "parts", "nonce-2")
    assert info.value.exit_code == 3 and f"node {socket.gethostname()} (id n-1)" in str(info.value)
    # SRC missing there, a file of another size, another version
    missing = check_node(str(tmp_path / "no-model"), files, str(tmp_path / "parts"), "nonce")
    first = next(iter(files))
    other = check_node(str(source), {first: files[first] + 1}, str(tmp_path / "parts"), "nonce")
    old = {**good, "versions": {**versions, "ktconvert": "0.0.1"}}
    with pytest.raises(NodeError) as info:
        check_reports([missing, other, old], versions, tmp_path / "parts", "nonce")
    text = str(info.value)
    assert "3 of 3 nodes" in text and "no-model is not there" in text
    assert f"{files[first]} bytes there, {files[first] + 1} on the driver" in text
    assert "ktconvert 0.0.1" in text and "install the driver's on every node" in text
    # a node where the native library does not load (a stale or missing build), while the driver's does
    assert good["native"] == check_node(str(source), files, None, "n")["native"]
    stale = {**good, "native": "_ktnative.so: ABI version 0, expected 1 (rebuild)"}
    with pytest.raises(NodeError, match="native library does not load there") as info:
        check_reports([stale], versions, tmp_path / "parts", "nonce", driver_native="loaded")
    assert "ABI version 0" in str(info.value) and "1 of 1 nodes" in str(info.value)
    check_reports([stale], versions, tmp_path / "parts", "nonce", driver_native="not built")  # the driver's neither


# ---------------------------------------------------------------- Ray's output and import path (no Ray cluster)

def test_ray_messages_go_to_the_log_one_line_per_fault_none_to_stdout(tmp_path, capfd, monkeypatch):
    """One fault's reports (a raylet's termination twice, as two of its workers report it; its node marked dead;
    the driver's own notes; a line of the driver's Ray core on stderr) all in ray.log, one line on the progress;
    a fault after BURST_SECONDS gets its own line; nothing on stdout, other stderr passed on."""
    ray_worker = pytest.importorskip("ray._private.worker")
    progress = Notes()
    clock = [1000.0]
    monkeypatch.setattr(ray_runtime.time, "monotonic", lambda: clock[0])
    native = "[2026-11-28 17:04:36,554 E 27882 27955] task_manager.cc:1545: Failed to push error to driver\n"

    def report(*lines):
        ray_worker.print_to_stdstream({"lines": list(lines), "pid": "raylet", "is_err": False}, ignore_prefix=False)

    with ray_runtime.ray_output(tmp_path / "parts" / "ray.log", progress) as log:
        report("\x1b[33mRaylet is terminated. Termination is unexpected.\x1b[0m", "Last 20 lines:")
        report("Raylet is terminated. Termination is unexpected.")
        os.write(2, native.encode())
        os.write(2, b"not Ray's\n")
        clock[0] += 10
        report("The node with node id: n1 has been marked dead")
        ray_runtime.note_fault("part p: started again", progress)
        clock[0] += ray_runtime.BURST_SECONDS + 1
        report("A worker died or was killed")
    report("after the run")
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == "not Ray's\n"
    lines = log.read_text().splitlines(keepends=True)
    assert lines.count("(driver) " + native) == 1               # written by the stderr pump: order not kept
    assert [line for line in lines if not line.startswith("(driver)")] == [
        "(raylet) Raylet is terminated. Termination is unexpected.\n", "(raylet) Last 20 lines:\n",
        "(raylet) Raylet is terminated. Termination is unexpected.\n",
        "(raylet) The node with node id: n1 has been marked dead\n", "(ktconvert) part p: started again\n",
        "(raylet) A worker died or was killed\n", "(raylet) after the run\n"]
    assert progress.notes == [f"Ray: Raylet is terminated. Termination is unexpected. (details: {log})",
                              f"Ray: A worker died or was killed (details: {log})"]
    ray_runtime.note_fault("outside a run", progress)          # no log: said as it is
    assert progress.notes[-1] == "outside a run"


def test_stderr_read_through_the_pipe_when_its_log_cannot_be_written(tmp_path, capfd, monkeypatch):
    """The stderr pump never stops reading before the run ends: with a log it cannot append to, Ray's core lines
    and every other line (more than a pipe holds) reach stderr, and the block ends (no writer left blocked)."""
    from ktconvert.distributed.ray_runtime import native_lines_to

    native = b"[2026-11-28 17:04:36,554 E 27882 27955] task_manager.cc:1545: Failed to push error to driver\n"
    with native_lines_to(tmp_path / "no-such-folder" / "ray.log"):
        os.write(2, native)
        for i in range(2000):                     # ~140 KB: more than a pipe's buffer
            os.write(2, b"line %05d of the run's own stderr\n" % i)
    err = capfd.readouterr().err
    assert err.count("of the run's own stderr") == 2000 and native.decode() in err


def test_lock_taken_by_a_frozen_process_of_a_dead_node_is_taken_over(tmp_path):
    """A part's lock taken by lock_folder in another process, that process stopped (SIGSTOP, as on a frozen node):
    named with its pid and host while its node lives, taken over once its node is dead."""
    import signal

    folder = tmp_path / "layers-1-1"
    folder.mkdir()
    code = ("import sys, time; from ktconvert.run.output import lock_folder; lock_folder(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n"
        os.kill(child.pid, signal.SIGSTOP)
        state, text = lock_state(folder, ME, lambda: {"n-live"})
        assert state == "held" and f"pid {child.pid} on host {socket.gethostname()} (no task record" in text
        write_task_record(folder, {"host": socket.gethostname(), "pid": child.pid, "node_id": "n-frozen",
                                   "task_id": "t-first"})
        assert lock_state(folder, ME, lambda: {"n-live", "n-frozen"})[0] == "held"
        state, text = lock_state(folder, ME, lambda: {"n-live"})
        assert state == "taken" and f"pid {child.pid} on host {socket.gethostname()}" in text
        assert "its Ray node is dead" in text and not (folder / LOCK_NAME).exists()
    finally:
        child.kill()
        child.wait()


def test_ray_starts_from_the_package_folder(monkeypatch, tmp_path):
    ray = pytest.importorskip("ray")
    import ktconvert

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(os.getcwd()))
    monkeypatch.chdir(tmp_path)
    ray_runtime.connect(None)
    assert seen == [str(Path(ktconvert.__file__).resolve().parent.parent)] and os.getcwd() == str(tmp_path)


def test_progress_board_that_stops_answering_is_said_once_and_never_waited_on(monkeypatch):
    ray = pytest.importorskip("ray")
    from ktconvert.distributed import ray_progress

    class Frozen:                    # a board on a frozen node: asked, never answers
        class totals:
            @staticmethod
            def remote():
                return "ref"

    class FakeRay:
        exceptions = ray.exceptions

        @staticmethod
        def wait(refs, timeout):
            assert timeout == 0                   # the driver never waits on the board
            return [], refs

    monkeypatch.setattr(ray_progress, "SILENT_SECONDS", -1)
    progress = Notes()
    watch = ray_progress.BoardWatch(FakeRay(), Frozen(), progress)
    assert [watch.poll() for _ in range(3)] == [{}, {}, {}]
    assert progress.notes == ["progress actor not answering for -1 s; the run goes on, its progress counts the "
                              "parts that finished"]


# ---------------------------------------------------------------- on the local cluster

def test_progress_actor_killed_does_not_end_the_run(cluster, source, single, tmp_path, monkeypatch):
    import ray

    from ktconvert.distributed import ray_convert

    real = ray_convert.start_board

    def killed(ray_module):
        board = real(ray_module)
        ray.get(board.totals.remote())
        ray.kill(board, no_restart=True)
        return board

    monkeypatch.setattr(ray_convert, "start_board", killed)
    progress = Notes()
    ray_convert.convert_on_ray(source, [(tmp_path / "out", CPU)], parts=2, progress=progress)
    assert tree(tmp_path / "out") == tree(single)
    lost = [n for n in progress.notes if "progress actor lost" in n]
    assert len(lost) == 1 and "ActorDiedError" in lost[0]
    assert progress.bytes_done == progress.total_bytes > 0 and progress.items_done == progress.total_items == 3


def test_node_hosting_the_progress_actor_removed_mid_run(cluster, source, single, tmp_path, monkeypatch):
    """The progress actor on a third node (no CPU: no part runs there), that node removed (its raylet killed) once
    the actor answered: Ray restarts the actor on another node, the run ends as a single run."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ktconvert.distributed import ray_convert
    from ktconvert.distributed.ray_progress import ProgressBoard

    extra = cluster.add_node(num_cpus=0, object_store_memory=80 << 20)
    cluster.wait_for_nodes()

    def on_extra(ray_module):
        board = ray.remote(ProgressBoard).options(
            num_cpus=0, max_restarts=-1, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(extra.node_id, soft=True)).remote()
        ray.get(board.totals.remote())
        cluster.remove_node(extra, allow_graceful=False)
        return board

    monkeypatch.setattr(ray_convert, "start_board", on_extra)
    progress = Notes()
    ray_convert.convert_on_ray(source, [(tmp_path / "out", CPU)], parts=2, progress=progress)
    assert tree(tmp_path / "out") == tree(single)
    assert progress.bytes_done == progress.total_bytes > 0 and progress.items_done == progress.total_items == 3


def test_node_of_another_version_is_refused_before_any_part(cluster, source, tmp_path, monkeypatch):
    from ktconvert.distributed.ray_convert import convert_on_ray

    monkeypatch.setattr(preflight_module, "package_versions", lambda: {**package_versions(), "ktconvert": "9.9"})
    with pytest.raises(NodeError) as info:
        convert_on_ray(source, [(tmp_path / "out", CPU)], parts=2)
    assert info.value.exit_code == 3 and "2 of 2 nodes" in str(info.value) and "ktconvert 9.9" in str(info.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.parts" / "out").exists()


def test_stale_part_redone_and_foreign_lock_named_then_taken_over(cluster, source, single, tmp_path, held):
    import ray

    from ktconvert.distributed.ray_convert import PartFailed, convert_on_ray

    convert_on_ray(source, [(tmp_path / "first", CPU)], parts=3, parts_dir=tmp_path / "parts")
    stale = tmp_path / "parts" / "first" / "layers-2-2"
    record = json.loads((stale / PART_NAME).read_text())
    record["manifest"]["packages"]["ktconvert"] = "0.0.1"
    (stale / PART_NAME).write_text(json.dumps(record))
    # the same parts folder for OUT "first" again: the other version's part is converted again, on every rerun
    progress = Notes()
    convert_on_ray(source, [(tmp_path / "again" / "first", CPU)], parts=3, parts_dir=tmp_path / "parts",
                   progress=progress)
    assert tree(tmp_path / "again" / "first") == tree(single)
    redone = [n for n in progress.notes if "converting it again" in n]
    assert len(redone) == 1 and str(stale) in redone[0] and "ktconvert 0.0.1" in redone[0]
    assert json.loads((stale / PART_NAME).read_text())["manifest"]["packages"] == package_versions()
    # a part whose lock a live task on another host holds: the run fails naming that host
    live = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))[0]
    folder = held({"host": "node-b.example", "pid": 4242, "node_id": live, "task_id": "t-other"},
                  tmp_path / "parts" / "out" / "layers-1-1")
    run = lambda progress=None: convert_on_ray(source, [(tmp_path / "out", CPU)], parts=3,  # noqa: E731
                                               parts_dir=tmp_path / "parts", progress=progress)
    with pytest.raises(PartFailed, match="held by pid 4242 on host node-b.example") as info:
        run()
    assert str(folder) in str(info.value) and not (tmp_path / "out" / "ktconvert.json").exists()
    # ... once Ray has given up on that node, its lock is taken over and the run ends as a single run
    write_task_record(folder, {"host": "node-b.example", "pid": 4242, "node_id": "f" * 56, "task_id": "t-other"})
    progress = Notes()
    run(progress)
    assert tree(tmp_path / "out") == tree(single)
    assert [n for n in progress.notes if "taken over: its Ray node is dead" in n and "node-b.example" in n], \
        progress.notes


# ---------------------------------------------------------------- resources as data (no Ray)

def test_gptq_task_memory_matches_the_documented_deepseek_figures():
    """docs/scale.md's table for DeepSeek-V3 (H 7168, I 2048, 256 experts; 32 samples x 2048 tokens), computed by
    hand there: capture 0.5 GB + 2.1 GB / N, propagate 0.5 + 45 + 2.2 GB / N, owner 2.5 GB + 45 GB / N (what a
    step holds; a task declares a process's base more)."""
    from types import SimpleNamespace

    from ktconvert.cpu.sizes import PROCESS_BASE_BYTES
    from ktconvert.distributed.ray_gptq import default_workers, shipped_per_layer, task_memory

    info = SimpleNamespace(hidden=7168, intermediate=2048, n_experts=256)
    tokens, squares = 32 * 2048, 32 * 2048 ** 2
    for n in (1, 8):
        memory = task_memory(info, tokens, squares, n)
        for step, documented in (("capture_slice", 0.5 + 2.1 / n), ("propagate_slice", 0.5 + 45 + 2.2 / n),
                                 ("solve_experts", 2.5 + 45 / n)):
            assert (memory[step] - PROCESS_BASE_BYTES) / 1e9 == pytest.approx(documented, rel=0.15), (step, n)
    # per layer: 0.94 GB x N of captures to the owners, 22.5 GB x N of written experts to the slices
    assert shipped_per_layer(info, tokens, 8) / 1e9 == pytest.approx(8 * (0.94 + 22.5), rel=0.05)
    # 2 nodes of 64 CPUs and 100 GB: the largest task (propagate, about 46 GB) twice per node
    assert default_workers(info, tokens, squares, [{"CPU": 64, "memory": 100e9}] * 2) == 4
    assert default_workers(info, tokens, squares, [{"CPU": 1, "memory": 10e9}]) == 1


def test_batch_job_declares_the_cpus_it_converts_with_and_its_plan_memory(source, tmp_path):
    from ktconvert.cpu import sizes
    from ktconvert.distributed.batch_ray import job_resources
    from ktconvert.run.inputs import open_input

    job = {"name": "j", "source": str(source), "outputs": [
        {"out": str(tmp_path / "a"), "cpu": {"method": "amxint4", "numa": 2}, "bundle": None, "publish": []},
        {"out": str(tmp_path / "b"), "cpu": {"method": "amxint4", "numa": 1, "threads": 3}, "bundle": None,
         "publish": []}]}
    job, resources = job_resources(job, cpus=8)
    assert [o["cpu"]["threads"] for o in job["outputs"]] == [3, 3] and resources["num_cpus"] == 3
    opened = open_input(str(source)).source
    info = opened.info
    expected = max(sizes.peak_ram(opened, info.hidden, info.intermediate, numa, 3)["peak_ram_bytes"]
                   for numa in (2, 1))
    assert resources["memory"] == expected > 0
    _, resources = job_resources({**job, "source": str(tmp_path / "missing")}, cpus=8)
    assert resources["memory"] == 0            # the job fails in its task, with the local batch's error


@pytest.mark.slow
def test_cli_from_a_folder_holding_a_checkout_named_ktconvert_gives_json(source, single, tmp_path):
    """`ktconvert ... --executor ray --json` started from a folder holding a `ktconvert` package that cannot be
    imported (a stand-in for another checkout), on a Ray it starts itself: every task imports the installed
    package, stdout is exactly one JSON document, and the output is the single run's."""
    shadow = tmp_path / "cwd" / "ktconvert"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the shadowing checkout was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [str(Path(sys.executable).with_name("ktconvert")), "cpu", str(source), str(tmp_path / "out"),
               "--method", "amxint4", "--numa", "2", "--executor", "ray", "--parts", "2", "--json", "--quiet"]
    done = subprocess.run(command, cwd=shadow.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert isinstance(json.loads(done.stdout), dict)
    assert "Traceback" not in done.stderr
    assert tree(tmp_path / "out") == tree(single)


def test_default_parts_count_what_the_nodes_run_at_once_by_cpus_and_memory():
    from ktconvert.distributed.ray_convert import default_parts

    nodes = [{"Resources": {"CPU": 16, "memory": 40e9}}, {"Resources": {"CPU": 4, "memory": 400e9}}]
    # 8 CPUs and 10 GB a part: the first node holds 2 (CPUs) ... 4 (memory) -> 2, the second 0 (CPUs)
    assert default_parts(nodes, {"num_cpus": 8, "memory": 10e9}, 61) == 2
    # 1 CPU and 10 GB: the first node 4 (memory), the second 4 (CPUs)
    assert default_parts(nodes, {"num_cpus": 1, "memory": 10e9}, 61) == 8
    assert default_parts(nodes, {"num_cpus": 1, "memory": 1e9}, 3) == 3           # at most one per layer
    assert default_parts(nodes, {"num_cpus": 32, "memory": 1e9}, 3) == 1

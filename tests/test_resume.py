"""Crash and resume: a conversion killed with SIGKILL at random points leaves nothing that looks complete, and
`--resume` then produces exactly the bytes of an uninterrupted run, manifest included."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MODEL_KW = dict(layers=6, experts=8)   # deepseek_v3: 1 dense + 5 MoE layers -> 120 expert matrices


def _cli(*args, env_extra=None, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, KTCONVERT_NO_PROGRESS="1", **(env_extra or {}))
    cmd = [sys.executable, "-c", "from ktconvert.cli.main import main; main()", *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_nothing_looks_complete(out: Path, reference: dict[str, bytes]) -> None:
    """After a crash: no manifest; every visible output file is byte-identical to the finished one (files are
    renamed into place only when complete); partial data lives only under temporary names."""
    assert not (out / "ktconvert.json").exists()
    for rel, data in _tree(out).items():
        name = Path(rel).name
        if name.startswith(".") or ".partial" in rel:
            continue
        assert rel in reference, f"unexpected file {rel}"
        assert data == reference[rel], f"{rel} is visible but differs from the finished file"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("deepseek_v3", **MODEL_KW)


@pytest.fixture(scope="module")
def references(model, tmp_path_factory):
    refs = {}
    for layout in ("safetensors", "kt"):
        out = tmp_path_factory.mktemp("clean") / layout
        _cli("cpu", model, out, "--method", "amxint4", "--numa", "2", "--layout", layout)
        refs[layout] = _tree(out)
    return refs


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_kill_at_random_points_then_resume(model, references, tmp_path, layout):
    rng = random.Random(1234 if layout == "safetensors" else 99)
    points = sorted(rng.sample(range(1, 120), 6 if layout == "safetensors" else 4))
    for n in points:
        out = tmp_path / f"kill{n}"
        proc = _cli("cpu", model, out, "--method", "amxint4", "--numa", "2", "--layout", layout,
                    env_extra={"KTCONVERT_FAULT_AFTER_JOBS": str(n)}, check=False)
        assert proc.returncode == -signal.SIGKILL, (n, proc.stderr)
        _assert_nothing_looks_complete(out, references[layout])
        refused = _cli("cpu", model, out, "--method", "amxint4", "--numa", "2", "--layout", layout, check=False)
        assert refused.returncode != 0 and "--resume" in refused.stderr
        _cli("cpu", model, out, "--method", "amxint4", "--numa", "2", "--layout", layout, "--resume")
        assert _tree(out) == references[layout], f"resume after a kill at job {n} differs from a clean run"


def test_repeated_kills_and_a_timed_kill(model, references, tmp_path):
    out = tmp_path / "chain"
    for n in (7, 31, 55):  # each resumed run dies again, further along
        proc = _cli("cpu", model, out, "--method", "amxint4", "--numa", "2", "--resume" if n != 7 else "--quiet",
                    env_extra={"KTCONVERT_FAULT_AFTER_JOBS": str(n)}, check=False)
        assert proc.returncode == -signal.SIGKILL
        _assert_nothing_looks_complete(out, references["safetensors"])
    # a kill from outside at an arbitrary moment (not at a job boundary)
    env = dict(os.environ, KTCONVERT_NO_PROGRESS="1")
    cmd = [sys.executable, "-c", "from ktconvert.cli.main import main; main()", "cpu", str(model), str(out),
           "--method", "amxint4", "--numa", "2", "--resume"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(random.Random(5).uniform(0.3, 1.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if not (out / "ktconvert.json").exists():
        _assert_nothing_looks_complete(out, references["safetensors"])
    _cli("cpu", model, out, "--method", "amxint4", "--numa", "2", "--resume")
    assert _tree(out) == references["safetensors"]


def test_resume_refuses_changed_options(model, tmp_path):
    out = tmp_path / "o"
    proc = _cli("cpu", model, out, "--method", "amxint4", "--numa", "2",
                env_extra={"KTCONVERT_FAULT_AFTER_JOBS": "20"}, check=False)
    assert proc.returncode == -signal.SIGKILL
    proc = _cli("cpu", model, out, "--method", "amxint4", "--numa", "1", "--resume", check=False)
    assert proc.returncode != 0
    assert "different options" in proc.stderr and "numa" in proc.stderr


def test_resume_redoes_a_damaged_finished_layer(model, references, tmp_path):
    out = tmp_path / "o"
    proc = _cli("cpu", model, out, "--method", "amxint4", "--numa", "2",
                env_extra={"KTCONVERT_FAULT_AFTER_JOBS": "80"}, check=False)
    assert proc.returncode == -signal.SIGKILL
    shards = sorted(out.glob("model-*.safetensors"))
    assert shards, "expected at least one finished layer before the kill"
    with open(shards[0], "r+b") as fh:  # truncate a finished shard: resume must notice and redo that layer
        fh.truncate(1000)
    _cli("cpu", model, out, "--method", "amxint4", "--numa", "2", "--resume")
    assert _tree(out) == references["safetensors"]

"""Progress reporters: JSON-lines events, plain CI lines, tqdm on a terminal, quiet / KTCONVERT_NO_PROGRESS; how a
phase ends (done / interrupted / failed), rate and ETA, and third-party output kept off quiet and JSON-lines runs."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading

import pytest

from ktconvert.util.progress import make_progress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_events(monkeypatch):
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    stream = io.StringIO()
    with make_progress(json_lines=True, stream=stream) as progress:
        progress.start(300, 3, "convert")
        progress.advance(100, 1, "layer 0")
        progress.message("resuming")
        progress.advance(200, 2, "layer 2")
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    # the phase at its totals is said once, by "done" (before: a "progress" event with the same counters first)
    assert [e["event"] for e in events] == ["start", "progress", "message", "done"]
    assert events[1]["bytes"] == 100 and events[1]["detail"] == "layer 0" and events[1]["unit"] == "items"
    assert events[2]["text"] == "resuming"
    assert (events[-1]["bytes"], events[-1]["items"], events[-1]["total_bytes"]) == (300, 3, 300)


def test_plain_lines_when_not_a_terminal(monkeypatch):
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    stream = io.StringIO()
    with make_progress(stream=stream) as progress:
        progress.start(2048, 2, "upload")
        progress.advance(1024, 1, "a.kt")
        progress.advance(1024, 1, "b.kt")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("upload: started (2.00 KiB, 2 items)")
    assert "50.0% 1.00 KiB/2.00 KiB, 1/2 items" in lines[1] and "[a.kt]" in lines[1]
    assert lines[-1].endswith("done") and "100.0%" in lines[-1]
    assert "\r" not in stream.getvalue()


def test_plain_lines_are_throttled(monkeypatch):
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "3600")
    stream = io.StringIO()
    with make_progress(stream=stream) as progress:
        progress.start(1000, 1000, "x")
        for _ in range(1000):
            progress.advance(1, 1)
    assert len(stream.getvalue().splitlines()) == 2  # started + done


def test_tqdm_on_a_terminal():
    stream = FakeTty()
    with make_progress(stream=stream) as progress:
        progress.start(4096, 1, "bundle")
        progress.advance(4096, 1, "f")
    assert "bundle" in stream.getvalue() and "4.00k" in stream.getvalue()


def test_quiet_and_env_switch_everything_off(monkeypatch):
    stream = io.StringIO()
    with make_progress(quiet=True, json_lines=True, stream=stream) as progress:
        progress.start(10, 1, "x")
        progress.advance(10, 1)
        progress.message("hello")
    monkeypatch.setenv("KTCONVERT_NO_PROGRESS", "1")
    with make_progress(json_lines=True, stream=stream) as progress:
        progress.start(10, 1, "x")
        progress.message("hello")
    assert stream.getvalue() == ""
    assert progress.bytes_done == 0


def test_advance_is_thread_safe(monkeypatch):
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    with make_progress(stream=io.StringIO()) as progress:
        progress.start(8 * 500, 8 * 500, "threads")

        def work():
            for _ in range(500):
                progress.advance(1, 1)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (progress.bytes_done, progress.items_done) == (4000, 4000)


# ---------------------------------------------------------------------------------------------- how a phase ends

@pytest.mark.parametrize("raised, word", [(KeyboardInterrupt, "interrupted"), (RuntimeError, "failed")])
def test_a_stopped_phase_never_says_done(monkeypatch, raised, word):
    """Ctrl-C (or an error) after the last byte, e.g. while the outputs are hashed: 100 %, but not done."""
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    plain, lines = io.StringIO(), io.StringIO()
    for stream, json_lines in ((plain, False), (lines, True)):
        with pytest.raises(raised):
            with make_progress(json_lines=json_lines, stream=stream) as progress:
                progress.start(100, 1, "convert")
                progress.advance(100, 1, "layer 0")
                raise raised()
    last = plain.getvalue().splitlines()[-1]
    assert last.startswith("convert: 100.0%") and last.endswith(f" {word}") and "done" not in last
    events = [json.loads(line)["event"] for line in lines.getvalue().splitlines()]
    assert events == ["start", word]          # 100 % is said by the end event, once


def test_cli_ctrl_c_prints_interrupted_not_done(tmp_path, monkeypatch):
    """The CLI's progress and its exit: the conversion is interrupted after its last byte."""
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    def interrupted_convert(src, out, progress, **options):
        progress.start(100, 1, "convert AMXINT4 T=1")
        progress.advance(100, 1, "layer 0")
        raise KeyboardInterrupt

    monkeypatch.setattr("ktconvert.api.convert_cpu", interrupted_convert)
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    result = CliRunner().invoke(cli, ["cpu", str(tmp_path), str(tmp_path / "out"), "--method", "amxint4"])
    lines = result.stderr.splitlines()
    assert result.exit_code == 130
    assert lines[-2].startswith("convert AMXINT4 T=1: 100.0%") and lines[-2].endswith(" interrupted")
    # the last line names the command that continues (issue 30; before: just "interrupted")
    assert lines[-1] == (f"interrupted; to continue: ktconvert cpu {tmp_path} {tmp_path / 'out'} --method amxint4 "
                         f"--resume")
    assert not any(line.endswith("done") for line in lines)


# ---------------------------------------------------------------------------------------------- rate and ETA

class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_eta_counts_from_the_first_work_not_from_start(monkeypatch):
    """100 s of imports after start(), then 100 B/s: the ETA is what the remaining bytes take at 100 B/s."""
    monkeypatch.setenv("KTCONVERT_PROGRESS_INTERVAL", "0")
    clock = FakeClock()
    plain, lines = io.StringIO(), io.StringIO()
    for stream, json_lines in ((plain, False), (lines, True)):
        with make_progress(json_lines=json_lines, stream=stream) as progress:
            progress.clock = clock
            progress.start(1000, 10, "gpu")
            clock.now += 100.0          # importing torch / compressed-tensors
            progress.advance(100, 1)    # first piece of work done
            clock.now += 1.0
            progress.advance(100, 1)    # 100 B in 1 s: 800 B left -> 8 s
    assert "eta 8s" in plain.getvalue().splitlines()[2]
    assert "100 B/s" in plain.getvalue().splitlines()[2]
    progress_events = [json.loads(line) for line in lines.getvalue().splitlines()][1:3]
    assert [e["eta_s"] for e in progress_events] == [None, 8.0]


# ---------------------------------------------------------------------------------------------- third-party output

THIRD_PARTY = """
import logging, sys, warnings
from ktconvert.util.progress import make_progress

with make_progress(quiet=sys.argv[1] == "quiet", json_lines=sys.argv[1] == "json") as progress:
    progress.start(10, 1, "x")
    from tqdm import tqdm
    from huggingface_hub.utils import tqdm as hf_tqdm
    for bar in (tqdm, hf_tqdm):
        for _ in bar(range(3), desc="third-party bar"):
            pass
    logging.getLogger("transformers").warning("third-party log line")
    warnings.warn("third-party warning")
    progress.advance(10, 1)
print("result")
"""


def _run_third_party(mode: str):
    env = {k: v for k, v in os.environ.items() if k not in ("KTCONVERT_NO_PROGRESS", "TQDM_DISABLE")}
    return subprocess.run([sys.executable, "-c", THIRD_PARTY, mode], capture_output=True, text=True, env=env,
                          timeout=120)


def assert_only_our_json(stderr: str) -> list[dict]:
    events = [json.loads(line) for line in stderr.splitlines()]     # fails on any line that is not JSON
    assert all(e["event"] in ("start", "progress", "message", "done") for e in events), events
    return events


def test_quiet_and_json_progress_silence_third_party_output():
    plain = _run_third_party("plain")      # the control: the libraries do write, when we let them
    assert "third-party log line" in plain.stderr and "third-party warning" in plain.stderr
    quiet = _run_third_party("quiet")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "result\n", "")
    json_run = _run_third_party("json")
    assert json_run.returncode == 0 and json_run.stdout == "result\n"
    assert [e["event"] for e in assert_only_our_json(json_run.stderr)] == ["start", "done"]


@pytest.fixture
def hub_with_tiny_model(tmp_path, tiny_model):
    from ktconvert.ops.hub_standin.server import HubServer

    server = HubServer(tmp_path / "hub-root").start()
    server.store.seed("hf", "org/tiny", tiny_model("qwen3_moe", layers=2, experts=4, hidden=128, intermediate=128))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KTCONVERT_", "TQDM_"))}
    env.update(HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="hf_test_token_7f3a",
               KTCONVERT_HUB_CACHE=str(tmp_path / "dl"), KTCONVERT_CACHE=str(tmp_path / "cache"),
               KTCONVERT_PROGRESS_INTERVAL="0")
    yield env
    server.stop()


def test_hub_source_download_json_progress_and_quiet_are_exact(tmp_path, hub_with_tiny_model):
    """`ktconvert cpu hf://...` downloads through huggingface_hub from the local stand-in, then converts."""
    cmd = [sys.executable, "-m", "ktconvert.cli.main", "cpu", "hf://org/tiny"]
    for flag in ("--json-progress", "--quiet"):
        out = tmp_path / f"out{flag}"
        result = subprocess.run(cmd + [str(out), "--method", "amxint4", flag], capture_output=True, text=True,
                                env=hub_with_tiny_model, timeout=300)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"wrote {out}") and len(result.stdout.splitlines()) == 1
        if flag == "--quiet":
            assert result.stderr == ""
        else:
            assert assert_only_our_json(result.stderr)[-1]["event"] == "done"


@pytest.mark.slow
@pytest.mark.parametrize("command, flag", [(["cpu", "--method", "amxint4", "--quant", "gptq"], "--json-progress"),
                                           (["gpu", "--quant", "gptq"], "--quiet")])
def test_gptq_json_progress_and_quiet_are_exact(tmp_path, tiny_model, command, flag):
    """GPTQ loads llmcompressor (loguru lines on stdout), transformers and tqdm bars ("Linearizing experts")."""
    pytest.importorskip("llmcompressor")
    model = tiny_model("qwen3_moe", layers=1, experts=4, hidden=128, intermediate=256)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": list(range(3 + i, 20 + 3 * i))}) + "\n" for i in range(2)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KTCONVERT_", "TQDM_", "LLM_COMPRESSOR_"))}
    out = tmp_path / "out"
    args = [command[0], str(model), str(out), *command[1:], "--calibration", str(calib), flag]
    result = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *args], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out}") and len(result.stdout.splitlines()) == 1, result.stdout
    if flag == "--quiet":
        assert result.stderr == ""
    else:
        assert_only_our_json(result.stderr)

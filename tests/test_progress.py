"""Progress reporters: JSON-lines events, plain CI lines, tqdm on a terminal, quiet / KTCONVERT_NO_PROGRESS."""
from __future__ import annotations

import io
import json
import threading

from ktconvert.progress import make_progress


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
    assert [e["event"] for e in events] == ["start", "progress", "message", "progress", "done"]
    assert events[1]["bytes"] == 100 and events[1]["detail"] == "layer 0"
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

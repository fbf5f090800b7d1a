"""Hostile files at every place ktconvert reads: FIFOs and devices are refused before they are opened (opening a FIFO
for reading blocks until a writer comes), and every JSON document is bounded in size and depth (a header nested
200 000 levels was a RecursionError traceback). Issue 14, items 4 and 5."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ktconvert.errors import InputError, KtConvertError, OutputError, VerifyError
from ktconvert.util.safe_read import MAX_DEPTH, parse_json, read_json

DEEP = "[" * 200_000 + "]" * 200_000


def _returns(fn, fifos=(), timeout: float = 10.0):
    """Run fn() in a thread and return ("ok", result) or ("raised", exc). A call still blocked after `timeout` (in
    open() of a FIFO) is released by opening the FIFOs for writing, and the test fails."""
    box: dict = {}

    def target():
        try:
            box["ok"] = fn()
        except BaseException as exc:  # noqa: BLE001  (reported to the test)
            box["raised"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked for {timeout}s on a non-regular file")
    return ("ok", box["ok"]) if "ok" in box else ("raised", box["raised"])


def _refused(fn, fifos=(), error=InputError, needles=("not a regular file",)) -> str:
    kind, value = _returns(fn, fifos)
    assert kind == "raised" and isinstance(value, error), (kind, value)
    msg = str(value)
    for needle in needles:
        assert needle in msg, msg
    assert "\n" not in msg
    return msg


def _model(tmp_path: Path) -> Path:
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path / "m", "qwen3_moe", layers=1, experts=2, hidden=128, intermediate=128)


# ---------------------------------------------------------------- FIFOs and devices (item 4)

@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "model.safetensors.index.json", "shard"])
def test_fifo_in_a_checkpoint_is_refused(tmp_path, name):
    from ktconvert.formats.safetensors_reader import Checkpoint

    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3_moe"}')
    if name == "shard":
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
        name = "model-00001-of-00001.safetensors"
    elif name != "model.safetensors":
        (root / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
        (root / name).unlink(missing_ok=True)
    fifo = root / name
    os.mkfifo(fifo)
    msg = _refused(lambda: Checkpoint.open(root), [fifo])
    assert name in msg and "FIFO" in msg


def test_fifo_or_device_given_as_the_source(tmp_path):
    from ktconvert.formats.sources import open_source

    for name in ("model.safetensors", "model.gguf"):
        fifo = tmp_path / name
        os.mkfifo(fifo)
        _refused(lambda: open_source(fifo), [fifo])
    if os.path.exists("/dev/null"):
        dev = tmp_path / "dev" / "model.safetensors"
        dev.parent.mkdir()
        dev.symlink_to("/dev/null")
        _refused(lambda: open_source(dev.parent), needles=("not a regular file", "device"))
        _refused(lambda: open_source(dev), needles=("not a regular file", "device"))


def test_fifo_gguf_part_is_refused(tmp_path):
    from ktconvert.formats.gguf_source import read_header

    fifo = tmp_path / "x.gguf"
    os.mkfifo(fifo)
    _refused(lambda: read_header(fifo), [fifo])


def test_fifo_manifest_journal_bundle_and_job_file(tmp_path):
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.ops.batch import load_jobs
    from ktconvert.ops.bundle import verify_bundle

    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "ktconvert.json")
    _refused(lambda: load_manifest(out), [out / "ktconvert.json"])
    os.mkfifo(tmp_path / "b.tar.zst")
    _refused(lambda: verify_bundle(tmp_path / "b.tar.zst"), [tmp_path / "b.tar.zst"])
    os.mkfifo(tmp_path / "jobs.toml")
    _refused(lambda: load_jobs(tmp_path / "jobs.toml"), [tmp_path / "jobs.toml"])


def test_cli_inspect_of_a_fifo_checkpoint_exits_3(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3_moe"}')
    os.mkfifo(root / "model.safetensors")
    env = {**os.environ, "KTCONVERT_NO_PROGRESS": "1"}
    env.pop("KTCONVERT_DEBUG", None)
    try:
        run = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", "inspect", str(root)], env=env,
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("ktconvert inspect hung on a FIFO")
    assert run.returncode == 3, run.stderr
    assert run.stderr.count("\n") == 1 and "not a regular file" in run.stderr


# ---------------------------------------------------------------- the JSON loader itself (item 5)

def test_depth_cap_is_exact_and_ignores_brackets_in_strings():
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, what="x") is not None
    with pytest.raises(InputError, match=f"deeper than {MAX_DEPTH}"):
        parse_json("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), what="x")
    tricky = {"k": "[[[[{{{{" * 100, "q": 'quote \\" and [ \\\\', "n": [{"a": ["]]]]"]}]}
    assert parse_json(json.dumps(tricky), what="x") == tricky
    nested_dicts = "".join('{"a":' for _ in range(MAX_DEPTH + 1)) + "1" + "}" * (MAX_DEPTH + 1)
    with pytest.raises(InputError, match="deeper"):
        parse_json(nested_dicts, what="x")


def test_size_cap_and_error_class():
    with pytest.raises(InputError, match="larger than 10 bytes"):
        parse_json(b'{"a": "0123456789"}', what="thing", max_bytes=10)
    with pytest.raises(VerifyError, match="not valid JSON"):
        parse_json(b"{nope", what="thing", error=VerifyError)
    with pytest.raises(InputError, match="not valid UTF-8"):
        parse_json(b'{"a": "\xff"}', what="thing")
    with pytest.raises(InputError, match="deeper"):
        parse_json(DEEP, what="thing")


def test_read_json_checks_size_before_reading(tmp_path):
    big = tmp_path / "config.json"
    with open(big, "wb") as fh:
        fh.truncate(1 << 40)                       # sparse: 1 TiB that must never be read
    msg = _refused(lambda: read_json(big, what="config.json", max_bytes=1 << 20), needles=("larger than",))
    assert "config.json" in msg


# ---------------------------------------------------------------- every parse site (item 5)

def _deep_header_file(path: Path) -> Path:
    text = ('{"a": ' + DEEP + "}").encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return path


def test_deep_safetensors_header(tmp_path):
    from ktconvert.formats.safetensors_reader import parse_header

    msg = _refused(lambda: parse_header(_deep_header_file(tmp_path / "model.safetensors")), needles=("deeper",))
    assert "model.safetensors" in msg


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_deep_config_and_index(tmp_path, name):
    from ktconvert.formats.safetensors_reader import Checkpoint

    root = tmp_path / "m"
    root.mkdir()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    (root / name).write_text('{"a": ' + DEEP + "}")
    assert name in _refused(lambda: Checkpoint.open(root), needles=("deeper",))


def test_deep_output_manifest_and_journal(tmp_path):
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.run.journal import JOURNAL_NAME, Journal

    out = tmp_path / "out"
    out.mkdir()
    (out / "ktconvert.json").write_text('{"files": ' + DEEP + "}")
    _refused(lambda: load_manifest(out), needles=("ktconvert.json", "deeper"))
    (out / JOURNAL_NAME).write_text('{"options": ' + DEEP + "}")
    _refused(lambda: Journal.start(out, {"method": "amxint4"}, resume=True), error=OutputError, needles=("deeper",))


def test_deep_bundle_manifest(tmp_path):
    import io
    import tarfile

    import zstandard

    from ktconvert.ops.bundle import unbundle, verify_bundle

    data = ('{"files": ' + DEEP + "}").encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("ktconvert.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (tmp_path / "deep.tar.zst").write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    report = verify_bundle(tmp_path / "deep.tar.zst")      # a fault inside a bundle: a failed verification (4)
    assert not report["ok"] and "ktconvert.json" in report["problems"][0] and "deeper" in report["problems"][0]
    _refused(lambda: unbundle(tmp_path / "deep.tar.zst", tmp_path / "dest"), error=VerifyError, needles=("deeper",))
    assert not (tmp_path / "dest").exists()


def test_deep_calibration_line(tmp_path):
    from ktconvert.gptq.calibration import read_jsonl

    path = tmp_path / "calib.jsonl"
    path.write_text('{"text": "ok"}\n{"text": ' + DEEP + "}\n")
    _refused(lambda: read_jsonl(path), needles=("calib.jsonl", "line 2", "deeper"))


def _many_tensor_shard(path: Path, count: int, entry=None) -> Path:
    """A valid .safetensors file of `count` one-element BF16 tensors (entry(i): the header value instead)."""
    header = {f"t.{i}": entry(i) if entry else {"dtype": "BF16", "shape": [1], "data_offsets": [2 * i, 2 * i + 2]}
              for i in range(count)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(2 * count))
    return path


def test_header_with_too_many_tensors_is_refused_before_parsing(tmp_path, monkeypatch):
    """A header of 10^6 tensors (under the 100 MB header limit) was parsed in 28-67 s at 1.1 GB and accepted;
    more than MAX_TENSORS per file is refused from the raw bytes (counted objects), in about a second."""
    import time

    from ktconvert.util import safe_read
    from ktconvert.formats.safetensors_reader import MAX_TENSORS, parse_header

    count = MAX_TENSORS + 2          # MAX_TENSORS + 1 objects may be tensors and __metadata__
    shard = _many_tensor_shard(tmp_path / "many.safetensors", count)
    monkeypatch.setattr(safe_read.json, "loads", lambda *a, **k: pytest.fail("the header was parsed"))
    start = time.monotonic()
    with pytest.raises(InputError) as info:
        parse_header(shard)
    assert time.monotonic() - start < 5
    assert str(info.value) == (f"many.safetensors: safetensors header lists more tensors than ktconvert reads from "
                               f"one file; expected at most {MAX_TENSORS} tensors, found {count} entries "
                               f"(JSON objects) in a header of {shard.stat().st_size - 8 - 2 * count} "
                               "bytes (hint: split the checkpoint into shards)")


def test_header_with_too_many_entries_of_no_object(tmp_path, monkeypatch):
    """Entries that are not objects pass the count of objects: the parsed header's length is checked before any
    entry is."""
    from ktconvert.formats import safetensors_reader

    monkeypatch.setattr(safetensors_reader, "MAX_TENSORS", 100)
    shard = _many_tensor_shard(tmp_path / "flat.safetensors", 102, entry=lambda i: i)
    with pytest.raises(InputError, match="lists more tensors than ktconvert reads.*found 102 entries \\(hint"):
        safetensors_reader.parse_header(shard)
    ok = _many_tensor_shard(tmp_path / "ok.safetensors", 100)
    assert len(safetensors_reader.parse_header(ok).tensors) == 100

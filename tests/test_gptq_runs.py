"""A `--quant gptq` run as the user sees it (issue 12): calibration problems stop it before OUT exists, a failure
after some layers leaves an OUT that --resume finishes to the bytes of an uninterrupted run, the CPU path reports
progress per layer, and text samples without a tokenizer get one line saying what is needed."""
from __future__ import annotations

import io
import json
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

import ktconvert  # noqa: E402
from ktconvert.errors import InputError  # noqa: E402
from ktconvert.util.progress import JsonLinesProgress  # noqa: E402

CPU = dict(method="amxint4", numa=1, quant="gptq")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3_moe", layers=2, experts=4, hidden=128, intermediate=128)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, model, calibration):
    """An uninterrupted CPU GPTQ run at one thread: (OUT, its JSON-lines progress events)."""
    out, stream = tmp_path_factory.mktemp("whole") / "out", io.StringIO()
    with JsonLinesProgress(stream, interval=0) as progress:
        ktconvert.convert_cpu(model, out, **CPU, calibration=calibration, progress=progress, threads=1)
    return out, [json.loads(line) for line in stream.getvalue().splitlines()]


def files_of(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("text, message", [("\n\n", "holds no samples"),
                                           ('{"input_ids": []}', "non-empty list"),
                                           ('{"input_ids": [1, 99999]}', "outside the vocabulary")])
@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_unusable_calibration_fails_before_out_exists(tmp_path, model, kind, text, message):
    calib = tmp_path / "bad.jsonl"
    calib.write_text(text + "\n")
    out = tmp_path / "out"
    with pytest.raises(InputError, match=message) as err:
        if kind == "cpu":
            ktconvert.convert_cpu(model, out, **CPU, calibration=calib)
        else:
            ktconvert.convert_gpu(model, out, experts="w4a16", quant="gptq", calibration=calib)
    assert "bad.jsonl" in str(err.value)
    assert not out.exists()


def test_failed_run_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, model, calibration, whole,
                                                                  monkeypatch):
    """Layer 1 fails: OUT keeps layer 0 and its journal, the error says --resume / --force, and --resume writes
    exactly the files of a run that never failed. A failure in layer 0 leaves no OUT at all."""
    from ktconvert.gptq import cpu as gptq_cpu

    write_layer = gptq_cpu.write_layer

    def failing_at(layer):
        def write(writer, method, result):
            if result.layer == layer:
                raise InputError("disk on fire", file="test")
            write_layer(writer, method, result)
        return write

    first = tmp_path / "first"
    monkeypatch.setattr(gptq_cpu, "write_layer", failing_at(0))
    with pytest.raises(InputError, match="disk on fire"):
        ktconvert.convert_cpu(model, first, **CPU, calibration=calibration)
    assert not first.exists()

    out = tmp_path / "out"
    monkeypatch.setattr(gptq_cpu, "write_layer", failing_at(1))
    with pytest.raises(InputError, match="disk on fire") as err:
        ktconvert.convert_cpu(model, out, **CPU, calibration=calibration)
    assert f"{out} keeps the layers finished so far: --resume continues, --force starts over" in str(err.value)
    assert ".ktconvert-journal.json" in {p.name for p in out.iterdir()}
    assert not (out / "ktconvert.json").exists()
    monkeypatch.setattr(gptq_cpu, "write_layer", write_layer)
    ktconvert.convert_cpu(model, out, **CPU, calibration=calibration, resume=True, threads=2)
    assert files_of(out) == files_of(whole[0])


@pytest.mark.slow
def test_failed_gpu_run_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, model, calibration, monkeypatch):
    """The GPU checkpoint's GPTQ path through the same write_in_layer_order (~50 s: the slow group)."""
    from ktconvert.gpu import gptq as gpu_gptq

    options = dict(experts="w4a16", quant="gptq", calibration=calibration)
    ktconvert.convert_gpu(model, tmp_path / "whole", **options)
    quantize_layer = gpu_gptq.quantize_layer_gptq

    def failing_in_layer_1(source, layer, *args, **kwargs):
        if layer == 1:
            raise InputError("disk on fire", file="test")
        return quantize_layer(source, layer, *args, **kwargs)

    out = tmp_path / "out"
    monkeypatch.setattr(gpu_gptq, "quantize_layer_gptq", failing_in_layer_1)
    with pytest.raises(InputError, match="--resume continues, --force starts over"):
        ktconvert.convert_gpu(model, out, **options)
    monkeypatch.setattr(gpu_gptq, "quantize_layer_gptq", quantize_layer)
    ktconvert.convert_gpu(model, out, **options, resume=True)
    assert files_of(out) == files_of(tmp_path / "whole")


def test_cpu_gptq_reports_progress_per_layer(whole):
    """One phase over the two MoE layers' source bytes, advanced per layer, ended by "done"."""
    events = whole[1]
    # the last layer's 100 % is said once, by "done" (issue 30)
    assert [e["event"] for e in events] == ["start", "progress", "done"]
    assert {e["label"] for e in events} == {"cpu AMXINT4 gptq"} and {e["unit"] for e in events} == {"layers"}
    expert_bytes = 2 * 4 * 3 * 128 * 128 * 2                  # layers x experts x projections x [I, H] BF16
    assert events[0]["total_items"] == 2 and events[0]["total_bytes"] == expert_bytes
    assert (events[1]["items"], events[1]["detail"]) == (1, "layer 0")
    assert events[-1]["bytes"] == expert_bytes and events[-1]["items"] == 2


def test_text_calibration_without_a_tokenizer_says_what_is_needed(tmp_path, model):
    from ktconvert.gptq.calibration import load_samples

    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    calib = tmp_path / "prompts.jsonl"
    calib.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n" + json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(InputError) as err:
        load_samples(calib, bare)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"prompts.jsonl sample 2 is text, and {bare} has no tokenizer")
    assert f"a tokenizer.json in {bare}" in message and '{"input_ids": [...]}' in message

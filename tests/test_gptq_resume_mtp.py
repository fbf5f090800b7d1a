"""Issue 15 item 5, GPTQ part: ``--quant gptq`` with ``--include-mtp`` and ``--resume``, CPU and GPU.

MTP rule (gptq/stream.py): an MTP layer is calibrated as one more decoder layer after the last one, on the hidden
states that layer produces. The golden side is independent of that code path: the same checkpoint rewritten with
the MTP layer's tensors moved to ``model.layers.{num_hidden_layers}`` and num_hidden_layers + 1 (the safetensors
library reads and writes the tensors), which transformers builds and the stream runs as an ordinary decoder layer.

Resume: a run interrupted after layer 1 of a 3-layer model and resumed gives the files of an uninterrupted run,
byte for byte, ktconvert.json included, whether the stream state saved with the journal is at the last finished
layer, older than it, or gone.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
st_torch = pytest.importorskip("safetensors.torch")


def _calibration(tmp_path, n: int = 4, length: int = 24):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": torch.randint(4, 500, (length,), generator=g).tolist()}) + "\n"
                            for _ in range(n)))
    return path


def _mtp_as_decoder_layer(model, out, n_layers: int):
    """`model` with its (one) MTP layer moved to decoder layer n_layers: its decoder tensors renamed, the MTP
    head's own tensors (eh_proj / enorm / hnorm / shared_head / mtp.fc / norms) dropped, config.json with one more
    hidden layer and no MTP layer."""
    shutil.copytree(model, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    prefixes = {f"model.layers.{n_layers}.": f"model.layers.{n_layers}.", "mtp.layers.0.": f"model.layers.{n_layers}."}
    head = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    tensors = {}
    for shard in sorted(model.glob("*.safetensors")):
        for name, value in st_torch.load_file(str(shard)).items():
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is None and name.startswith("mtp."):
                continue
            if prefix is not None:
                rest = name[len(prefix):]
                if rest.startswith(head):
                    continue
                name = prefixes[prefix] + rest
            tensors[name] = value
    st_torch.save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = n_layers + 1
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        config.pop(key, None)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"] + ["full_attention"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _payload_bytes(payloads: dict) -> dict:
    def flat(value):
        if isinstance(value, dict):
            return b"".join(flat(value[k]) for k in sorted(value))
        if isinstance(value, (list, tuple)):
            return b"".join(flat(v) for v in value)
        return np.ascontiguousarray(value).tobytes()

    return {key: flat(value) for key, value in payloads.items()}


def _quantizer(kind: str):
    from ktconvert.gptq.cpu import AmxQuantizer
    from ktconvert.gptq.loop import GpuQuantizer

    return AmxQuantizer(4, 1, selection=None) if kind == "amx" else GpuQuantizer(4, 128, "static", "mse")


@pytest.mark.parametrize("arch,kind", [("deepseek_v3", "amx"),
                                       pytest.param("deepseek_v3", "gpu", marks=pytest.mark.slow),
                                       pytest.param("qwen3_next", "amx", marks=pytest.mark.slow)])
def test_mtp_layer_is_calibrated_as_one_more_decoder_layer(tiny_model, tmp_path, arch, kind):
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gptq.calibration import load_samples
    from ktconvert.gptq.loop import GptqOptions, LayerStream

    model = tiny_model(arch, mtp=1)
    n_layers = HFSource.open(model).info.n_layers
    golden_model = _mtp_as_decoder_layer(model, tmp_path / "as-decoder", n_layers)
    samples = load_samples(_calibration(tmp_path), model)
    ours = {r.layer: r for r in LayerStream(model, samples, _quantizer(kind), GptqOptions(),
                                            mtp_layers=(n_layers,)).layers_results()}
    golden = {r.layer: r for r in LayerStream(golden_model, samples, _quantizer(kind),
                                              GptqOptions()).layers_results()}
    assert sorted(ours) == sorted(golden) and n_layers in ours
    for layer in ours:
        assert ours[layer].tokens == golden[layer].tokens, layer
        assert ours[layer].fallback == golden[layer].fallback == [], layer   # GPTQ ran on every expert
        assert _payload_bytes(ours[layer].payloads) == _payload_bytes(golden[layer].payloads), layer


def test_cpu_gptq_with_include_mtp_converts_and_verifies(tiny_model, tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli
    from ktconvert.formats.out_manifest import load_manifest

    model = tiny_model("deepseek_v3", mtp=1)
    out = tmp_path / "out"
    args = ["cpu", str(model), str(out), "--method", "amxint4", "--numa", "1", "--quant", "gptq",
            "--calibration", str(_calibration(tmp_path)), "--min-tokens", "1", "--include-mtp", "--quiet"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    manifest = load_manifest(out)
    assert manifest["model"]["layers"] == [1, 2, 3] and "3" in manifest["gptq"]["layers"]
    mtp = manifest["gptq"]["layers"]["3"]
    # every next-n expert got calibration tokens: GPTQ ran and was judged on held-out tokens
    assert mtp["gptq"] + mtp["mse"] == manifest["model"]["experts"], mtp
    assert set(mtp["because"]) <= {"data_free"}, mtp
    verified = CliRunner().invoke(cli, ["verify", str(out), "--source", str(model), "--json"])
    assert verified.exit_code == 0, verified.output


# ---------------------------------------------------------------------------------------------- resume

def _tree(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class _Interrupted(BaseException):
    """Stands in for a kill: nothing catches it on the way out."""


def _interrupt_after_layer_1(monkeypatch, saved_at: str) -> None:
    """Make the next run stop right after layer 1 is journalled; the stream state then holds layer 1's output
    ("layer 1"), layer 0's ("layer 0": the save after layer 1 never happened) or nothing ("none")."""
    from ktconvert.gptq import resume
    from ktconvert.run.output import Output

    finished, save = Output.layer_finished, resume.StreamState.save

    def layer_finished(self, layer, result):
        finished(self, layer, result)
        if layer == 1 and saved_at != "layer 1":
            if saved_at == "none":
                (self.out_dir / resume.STREAM_STATE_NAME).unlink(missing_ok=True)
            raise _Interrupted

    def saving(self, stream, summaries, force=False):
        save(self, stream, summaries, force=force)
        if stream.done == 1:
            raise _Interrupted

    monkeypatch.setattr(resume, "SAVE_EVERY_S", 0.0)
    monkeypatch.setattr(Output, "layer_finished", layer_finished)
    monkeypatch.setattr(resume.StreamState, "save", saving)


def _record_work(monkeypatch) -> dict:
    """{"run": layers the stream runs, "written": layers the output writes} of the next run."""
    from ktconvert.gptq.loop import LayerStream
    from ktconvert.run.output import Output

    work = {"run": [], "written": []}
    process, finished = LayerStream.process_layer, Output.layer_finished

    def process_layer(self, L, layer):
        work["run"].append(L)
        return process(self, L, layer)

    def layer_finished(self, layer, result):
        work["written"].append(layer)
        return finished(self, layer, result)

    monkeypatch.setattr(LayerStream, "process_layer", process_layer)
    monkeypatch.setattr(Output, "layer_finished", layer_finished)
    return work


def _resumed_equals_uninterrupted(tmp_path, monkeypatch, convert, saved_at: str) -> dict:
    """Run `convert(out, resume)` uninterrupted, then interrupted after layer 1 and resumed; asserts the two
    folders are byte-identical and returns the resumed run's work (_record_work)."""
    from ktconvert.formats.out_manifest import JOURNAL_NAME, STREAM_STATE_NAME

    convert(tmp_path / "whole", False)
    with monkeypatch.context() as patch:
        _interrupt_after_layer_1(patch, saved_at)
        with pytest.raises(_Interrupted):
            convert(tmp_path / "parts", False)
    assert (tmp_path / "parts" / JOURNAL_NAME).is_file()
    assert (tmp_path / "parts" / STREAM_STATE_NAME).is_file() == (saved_at != "none")
    with monkeypatch.context() as patch:
        work = _record_work(patch)
        convert(tmp_path / "parts", True)
    assert _tree(tmp_path / "parts") == _tree(tmp_path / "whole")
    return work


RESUMED_WORK = {"layer 1": [2], "layer 0": [1, 2], "none": [0, 1, 2]}


@pytest.mark.parametrize("saved_at", ["layer 1", pytest.param("layer 0", marks=pytest.mark.slow),
                                      pytest.param("none", marks=pytest.mark.slow)])
def test_cpu_gptq_resume_after_layer_1_is_byte_identical(tiny_model, tmp_path, monkeypatch, saved_at):
    from ktconvert.api import convert_cpu

    model, calibration = tiny_model("qwen3_moe", layers=3), _calibration(tmp_path)

    def convert(out, resume):
        convert_cpu(model, out, method="amxint4", numa=1, quant="gptq", calibration=calibration, min_tokens=1,
                    resume=resume)

    work = _resumed_equals_uninterrupted(tmp_path, monkeypatch, convert, saved_at)
    assert work == {"run": RESUMED_WORK[saved_at], "written": [2]}


@pytest.mark.slow
def test_cpu_gptq_resume_with_mtp_is_byte_identical(tiny_model, tmp_path, monkeypatch):
    """DeepSeek-V3: dense layer 0, MoE layers 1 and 2, next-n layer 3; interrupted after layer 1."""
    from ktconvert.api import convert_cpu

    model, calibration = tiny_model("deepseek_v3", mtp=1), _calibration(tmp_path)

    def convert(out, resume):
        convert_cpu(model, out, method="amxint8", numa=1, quant="gptq", calibration=calibration, min_tokens=1,
                    include_mtp=True, resume=resume)

    work = _resumed_equals_uninterrupted(tmp_path, monkeypatch, convert, "layer 1")
    assert work == {"run": [2, 3], "written": [2, 3]}


@pytest.mark.parametrize("saved_at", ["layer 1", pytest.param("layer 0", marks=pytest.mark.slow)])
def test_gpu_gptq_resume_after_layer_1_is_byte_identical(tiny_model, tmp_path, monkeypatch, saved_at):
    from ktconvert.api import convert_gpu

    model = tiny_model("qwen3_moe", layers=3, hidden=128, intermediate=128)
    calibration = _calibration(tmp_path)

    def convert(out, resume):
        convert_gpu(model, out, experts="w4a16", quant="gptq", linears="bf16", calibration=calibration,
                    resume=resume)

    work = _resumed_equals_uninterrupted(tmp_path, monkeypatch, convert, saved_at)
    assert work == {"run": RESUMED_WORK[saved_at], "written": [2]}


def test_resume_with_other_calibration_is_refused(tiny_model, tmp_path, monkeypatch):
    from ktconvert.api import convert_cpu
    from ktconvert.errors import ResumeMismatchError

    model = tiny_model("qwen3_moe", layers=3)
    calibration = _calibration(tmp_path)

    def convert(out, resume):
        convert_cpu(model, out, method="amxint4", numa=1, quant="gptq", calibration=calibration, resume=resume)

    with monkeypatch.context() as patch:
        _interrupt_after_layer_1(patch, "layer 1")
        with pytest.raises(_Interrupted):
            convert(tmp_path / "parts", False)
    lines = calibration.read_text().splitlines()
    calibration.write_text("\n".join(lines[1:] + lines[:1]) + "\n")    # same path, other samples order
    with pytest.raises(ResumeMismatchError, match="calibration samples differ"):
        convert(tmp_path / "parts", True)


@pytest.mark.slow
def test_gpu_gptq_with_include_mtp_calibrates_the_mtp_layer(tiny_model, tmp_path):
    """The next-n layer of a GPU checkpoint written with --include-mtp is GPTQ (not RTN) and verifies."""
    from ktconvert.api import convert_gpu
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gpu.experts import quantize_expert_rtn
    from ktconvert.verification.run import verify

    model = tiny_model("deepseek_v3", mtp=1)
    out = tmp_path / "gpu"
    convert_gpu(model, out, experts="w4a16", quant="gptq", linears="bf16", include_mtp=True,
                calibration=_calibration(tmp_path))
    assert json.loads((out / "ktconvert.json").read_text())["model"]["layers"] == [1, 2, 3]
    written = {}
    for shard in out.glob("*.safetensors"):
        written.update(st_torch.load_file(str(shard)))
    source = HFSource.open(model)
    differs = 0
    for e in range(source.info.n_experts):
        for proj in ("gate", "up", "down"):
            packed = written[f"model.layers.3.mlp.experts.{e}.{proj}_proj.weight_packed"].numpy()
            rtn = quantize_expert_rtn(getattr(source.read_expert(3, e), proj), 4, 128)["weight_packed"]
            differs += not np.array_equal(packed, rtn)
    assert differs > 0          # RTN would equal quantize_expert_rtn everywhere
    report = verify(out, source=str(model), experts="all")
    assert report["ok"], report["problems"]

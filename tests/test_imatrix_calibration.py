"""``--method llamafile --calibration FILE``: the importance matrix computed from calibration tokens
(ktconvert.gptq.imatrix), written into OUT as llama-imatrix's GGUF and used as ``--imatrix`` uses one.

Golden values: an independent forward of the same checkpoint, transformers' own ``from_pretrained`` model in
float32 (its fused experts module, not the calibration stream's linearised one), with a hook on each MoE layer's
experts module taking its input hidden states and routed choices; the sums of squares per column per expert and the
token counts are then computed here in plain torch (gate/up: the routed tokens' hidden states; down: act(gate) * up
of that expert's own weights), as llama.cpp's imatrix.cpp collects a MUL_MAT_ID tensor. The quantized bytes are
held to the run of the same conversion with ``--imatrix`` of the written file (quant.imatrix's path, itself
checked against llama.cpp by tests/test_imatrix.py).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
gguf = pytest.importorskip("gguf")

from ktconvert import native  # noqa: E402
from ktconvert.native import ggml_quant as native_ggml  # noqa: E402

SHAPE = dict(hidden=256, intermediate=256, experts=4, layers=2)
needs_native = pytest.mark.skipif(not native.available() or not native_ggml.supports("Q4_K"),
                                  reason="the native ggml quantizer with an importance matrix is not built")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("imc") / "qwen3", "qwen3_moe", **SHAPE)


def _calibration(path, seed: int, lengths=(24, 19, 30)):
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"input_ids": rng.integers(4, 200, n).tolist()}) + "\n" for n in lengths))
    return path


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    return _calibration(tmp_path_factory.mktemp("imc-cal") / "calib.jsonl", 0)


@pytest.fixture(scope="module")
def calibrated(model, calib, tmp_path_factory):
    """OUT of `cpu --method llamafile --ggml-type Q4_K --calibration calib.jsonl`."""
    from ktconvert import api

    out = tmp_path_factory.mktemp("imc-out") / "out"
    api.convert_cpu(model, out, method="llamafile", ggml_type="Q4_K", calibration=str(calib))
    return out


def _reference(model_dir, calib_path):
    """{GGUF name: (in_sum2 float64 [E, n], counts int64 [E])} from transformers' own float32 model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    captured: dict[int, list] = {}
    handles = []
    moe = {L: layer.mlp.experts for L, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")}
    for L, experts in moe.items():
        handles.append(experts.register_forward_pre_hook(
            lambda _m, args, L=L: captured.setdefault(L, []).append((args[0].detach(), args[1].detach()))))
    samples = [json.loads(line)["input_ids"] for line in calib_path.read_text().splitlines() if line.strip()]
    with torch.no_grad():
        for ids in samples:
            hf(torch.tensor([ids]))
    for h in handles:
        h.remove()
    out = {}
    torch.set_grad_enabled(False)
    for L, experts in moe.items():
        n_exp, inter = experts.num_experts, experts.intermediate_dim
        sums = {"gate": np.zeros((n_exp, experts.hidden_dim)), "down": np.zeros((n_exp, inter))}
        counts = np.zeros(n_exp, np.int64)
        for hidden, top_k in captured[L]:
            for e in range(n_exp):
                tokens = (top_k == e).any(dim=-1)
                x = hidden[tokens]
                gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                act = experts.act_fn(gate) * up
                sums["gate"][e] += (x.double() ** 2).sum(0).numpy()
                sums["down"][e] += (act.double() ** 2).sum(0).numpy()
                counts[e] += int(tokens.sum())
        for proj in ("gate", "up", "down"):
            out[f"blk.{L}.ffn_{proj}_exps.weight"] = (sums["down" if proj == "down" else "gate"], counts)
    torch.set_grad_enabled(True)
    return out


def _tensors(path) -> dict:
    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


@needs_native
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sums_and_counts_equal_an_independent_forward(family, model, calib, calibrated, tmp_path):
    """in_sum2 within float32 rounding and counts exactly, of every expert tensor of every MoE layer (DeepSeek-V3:
    a dense first layer, a shared expert, sigmoid routing with its correction bias)."""
    from ktconvert import api
    from ktconvert.examples.tiny import make_tiny_model
    from ktconvert.gptq.imatrix import IMATRIX_NAME

    if family != "qwen3_moe":
        model, calibrated = make_tiny_model(tmp_path / family, family, **SHAPE), tmp_path / "out"
        api.convert_cpu(model, calibrated, method="llamafile", ggml_type="Q4_K", calibration=str(calib))
    found = _tensors(calibrated / IMATRIX_NAME)
    want = _reference(model, calib)
    assert want
    assert set(want) == {name.rsplit(".", 1)[0] for name in found}
    total = sum(len(json.loads(line)["input_ids"]) for line in calib.read_text().splitlines())
    for name, (sum2, counts) in want.items():
        assert found[name + ".in_sum2"].shape == sum2.shape
        np.testing.assert_allclose(found[name + ".in_sum2"], sum2, rtol=1e-5, atol=1e-6, err_msg=name)
        assert found[name + ".counts"].reshape(-1).tolist() == counts.tolist(), name
        assert counts.sum() == total * 2          # qwen3_moe's tiny top-2: every token counted twice
        assert (counts > 0).all()


@needs_native
def test_file_is_llama_imatrix_gguf_and_loads(calibrated, calib):
    """gguf-py reads the file: llama-imatrix's keys and tensor shapes (ne [n_per_row, E] / [1, E]), no
    architecture; quant.imatrix.load accepts it with values in_sum2 / counts; the manifest lists it with its sha256
    and records the calibration."""
    from ktconvert.activation.counts import file_sha256
    from ktconvert.gptq.imatrix import IMATRIX_NAME
    from ktconvert.quant import imatrix

    path = calibrated / IMATRIX_NAME
    reader = gguf.GGUFReader(path)
    assert reader.get_field("general.type").contents() == "imatrix"
    assert reader.get_field("general.architecture") is None
    assert reader.get_field("imatrix.datasets").contents() == [calib.name]
    assert reader.get_field("imatrix.chunk_count").contents() == 3
    shapes = {t.name: list(t.shape) for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight.in_sum2"] == [256, 4]
    assert shapes["blk.1.ffn_down_exps.weight.counts"] == [1, 4]
    loaded = imatrix.load(path)
    name = "blk.1.ffn_down_exps.weight"
    sums, counts = _tensors(path)[name + ".in_sum2"], _tensors(path)[name + ".counts"]
    np.testing.assert_array_equal(loaded.expert(name, 2, 256), (sums[2] / counts[2, 0]).astype(np.float32))
    manifest = json.loads((calibrated / "ktconvert.json").read_text())
    assert manifest["files"][IMATRIX_NAME]["sha256"] == file_sha256(path)
    assert manifest["imatrix_sha256"] == file_sha256(path)
    record = manifest["imatrix_calibration"]
    assert record["calibration_sha256"] == file_sha256(calib) and record["tokens"] == 24 + 19 + 30


@needs_native
def test_experts_are_the_imatrix_runs_bytes(model, calibrated, tmp_path):
    """The expert tensors equal those of `--imatrix OUT/calibration.imatrix` (llama-quantize's path) and differ
    from a run without an importance matrix."""
    from ktconvert import api
    from ktconvert.gptq.imatrix import IMATRIX_NAME

    ours = json.loads((calibrated / "ktconvert.json").read_text())["tensors"]
    api.convert_cpu(model, tmp_path / "imx", method="llamafile", ggml_type="Q4_K",
                    imatrix=str(calibrated / IMATRIX_NAME))
    api.convert_cpu(model, tmp_path / "plain", method="llamafile", ggml_type="Q4_K")
    with_file = json.loads((tmp_path / "imx" / "ktconvert.json").read_text())["tensors"]
    plain = json.loads((tmp_path / "plain" / "ktconvert.json").read_text())["tensors"]
    assert ours == with_file
    assert all(ours[name] != plain[name] for name in ours)


def _cli(*args, code: int = 0) -> str:
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


@pytest.mark.parametrize("extra, words", [
    (["--imatrix", "IMX"], ["--calibration and --imatrix"]),
    (["--ggml-type", "Q8_0"], ["no effect on --ggml-type Q8_0"]),
    (["--ggml-type", "BF16"], ["no effect on --ggml-type BF16"]),
    (["--layers", "0"], ["--layers"]),
    (["--executor", "ray"], ["--executor ray"]),
])
def test_refusals_are_one_line_exit_2(model, calib, tmp_path, extra, words):
    from pathlib import Path

    imx = Path(__file__).parent / "golden" / "gguf" / "tiny-qwen3moe-imatrix.gguf"      # a readable imatrix
    extra = [str(imx) if a == "IMX" else a for a in extra]
    err = _cli("cpu", model, tmp_path / "o", "--method", "llamafile", "--calibration", calib, *extra, code=2)
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "o").exists()


def test_dry_run_says_the_matrix_is_computed_first(model, calib, tmp_path):
    """`--dry-run` names the computed matrix and where it is kept, writes nothing; without --calibration no word."""
    out = _cli("cpu", model, tmp_path / "o", "--method", "llamafile", "--calibration", calib, "--dry-run", code=0)
    assert f"computed first from --calibration {calib.name}" in out and "OUT/calibration.imatrix" in out
    assert not (tmp_path / "o").exists()
    plain = _cli("cpu", model, tmp_path / "o", "--method", "llamafile", "--dry-run", code=0)
    assert "importance matrix" not in plain


def test_calibration_with_another_method_is_refused(model, calib, tmp_path):
    err = _cli("cpu", model, tmp_path / "o", "--method", "bf16", "--calibration", calib, code=2)
    assert "--calibration is only used with --quant gptq or --method llamafile" in err


@needs_native
def test_resume_with_other_calibration_is_refused(model, calib, calibrated, tmp_path, monkeypatch):
    """A run that failed after its first MoE layer was journalled, resumed with another calibration file's contents
    at the same path: refused (ResumeMismatchError, exit 2) naming --calibration; with the same contents it resumes
    (the importance matrix kept, not computed again) to the uninterrupted run's bytes."""
    import shutil

    from ktconvert import api
    from ktconvert.errors import ResumeMismatchError
    from ktconvert.gptq import imatrix as calibrated_imatrix
    from ktconvert.gptq.imatrix import IMATRIX_NAME
    from ktconvert.cpu.output import CpuOutput

    cal, out = tmp_path / "cal.jsonl", tmp_path / "out"
    shutil.copyfile(calib, cal)
    layer_finished = CpuOutput.layer_finished

    def failing(self, layer, result):
        if layer == 1:
            raise RuntimeError("interrupted")
        layer_finished(self, layer, result)

    run = dict(method="llamafile", ggml_type="Q4_K", calibration=str(cal), threads=1)
    with monkeypatch.context() as patch:
        patch.setattr(CpuOutput, "layer_finished", failing)
        with pytest.raises(RuntimeError, match="interrupted"):
            api.convert_cpu(model, out, **run)
    assert (out / IMATRIX_NAME).is_file() and not (out / "ktconvert.json").exists()
    _calibration(cal, 1)
    with pytest.raises(ResumeMismatchError, match="--calibration") as info:
        api.convert_cpu(model, out, resume=True, **run)
    assert info.value.exit_code == 2
    shutil.copyfile(calib, cal)
    with monkeypatch.context() as patch:
        patch.setattr(calibrated_imatrix, "write_imatrix", None)      # not called again: the file is kept
        api.convert_cpu(model, out, resume=True, **run)
    want = json.loads((calibrated / "ktconvert.json").read_text())
    got = json.loads((out / "ktconvert.json").read_text())
    assert got["tensors"] == want["tensors"]
    assert {k: v for k, v in got["files"].items() if k != IMATRIX_NAME} == \
        {k: v for k, v in want["files"].items() if k != IMATRIX_NAME}
    ours, theirs = _tensors(out / IMATRIX_NAME), _tensors(calibrated / IMATRIX_NAME)   # datasets: the file names
    assert all(np.array_equal(ours[name], theirs[name]) for name in theirs) and set(ours) == set(theirs)


@needs_native
def test_num_samples_and_max_length_select_the_tokens(model, calib, tmp_path):
    """--num-samples / --max-length apply as to --quant gptq: the first 2 samples, 10 tokens each."""
    from ktconvert import api
    from ktconvert.gptq.imatrix import IMATRIX_NAME

    out = tmp_path / "out"
    api.convert_cpu(model, out, method="llamafile", calibration=str(calib), num_samples=2, max_length=10)
    record = json.loads((out / "ktconvert.json").read_text())["imatrix_calibration"]
    assert (record["samples"], record["tokens"], record["max_length"]) == (2, 20, 10)
    counts = _tensors(out / IMATRIX_NAME)["blk.0.ffn_up_exps.weight.counts"]
    assert counts.sum() == 20 * 2

"""Issue 15 item 5: MTP layers of every family that has them. Qwen3-Next and Qwen3.5 keep theirs under ``mtp.``
(``mtp.fc``, ``mtp.pre_fc_norm_{embedding,hidden}``, ``mtp.norm``, ``mtp.layers.{k}`` with routed experts, as
vLLM's qwen3_next_mtp / qwen3_5_mtp load them); ``--include-mtp`` converts them as layer num_hidden_layers + k,
like DeepSeek's next-n layers. Expected values are read from the source files with the safetensors library."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ktconvert.errors import ManifestError
from ktconvert.formats.hf_source import HFSource

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def _load_all(folder) -> dict:
    """Every tensor of a checkpoint folder as the safetensors library reads it (BF16 as uint16 bits)."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        for name, t in st_torch.load_file(str(shard)).items():
            out[name] = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    return out


def _bf16_output(model, out, include_mtp: bool) -> dict:
    from ktconvert.cpu.convert import convert_cpu

    convert_cpu(model, out, method="bf16", include_mtp=include_mtp, threads=2)
    return _load_all(out)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe"])
def test_mtp_experts_under_mtp_prefix_convert_with_include_mtp(tiny_model, tmp_path, model_type):
    model = tiny_model(model_type, mtp=1)
    src = HFSource.open(model)
    n_layers = src.info.n_layers
    assert src.info.mtp_layers == (n_layers,) and src.present_mtp_layers() == (n_layers,)
    source = _load_all(model)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"} <= set(source)
    without = _bf16_output(model, tmp_path / "no-mtp", False)
    assert not any(name.startswith(f"model.layers.{n_layers}.") for name in without)
    out = _bf16_output(model, tmp_path / "mtp", True)
    I = src.info.intermediate
    for e in (0, src.info.n_experts - 1):
        got = {p: out[f"model.layers.{n_layers}.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")}
        if model_type == "qwen3_next":          # per-expert, as the hub stores Qwen3-Next's MTP experts
            want = {p: source[f"mtp.layers.0.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")}
        else:                                   # fused [E, 2I, H] + [E, H, I], like Qwen3.5's main layers
            gate_up = source["mtp.layers.0.mlp.experts.gate_up_proj"][e]
            want = {"gate": gate_up[:I], "up": gate_up[I:], "down": source["mtp.layers.0.mlp.experts.down_proj"][e]}
        for p in want:
            np.testing.assert_array_equal(got[p], want[p], f"expert {e} {p}")


def test_mtp_count_from_tensors_when_config_has_none(tiny_model, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_model("qwen3_next", mtp=1), path)
    config = json.loads((path / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (path / "config.json").write_text(json.dumps(config))
    src = HFSource.open(path)
    assert src.info.mtp_layers == (2,) and src.present_mtp_layers() == (2,)
    config["num_nextn_predict_layers"] = 0          # the config says none, yet mtp.layers.0 is there
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestError) as err:
        HFSource.open(path)
    assert "mtp.layers.0." in str(err.value) and "num_nextn_predict_layers = 0" in str(err.value)


def test_gpu_checkpoint_carries_mtp_only_with_include_mtp(tiny_model, tmp_path):
    pytest.importorskip("compressed_tensors")
    from ktconvert.gpu.convert import convert_gpu
    from ktconvert.verification.run import verify

    model = tiny_model("qwen3_next", mtp=1)
    index = {}
    for flag in (False, True):
        out = tmp_path / f"gpu-{flag}"
        convert_gpu(model, out, linears="keep", include_mtp=flag, threads=2)
        index[flag] = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        report = verify(out, source=str(model))
        assert report["ok"], report["problems"]
    assert not any(n.startswith("mtp.") for n in index[False])
    mtp = {n for n in index[True] if n.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.mlp.experts.7.down_proj.weight_packed",
            "mtp.layers.0.mlp.shared_expert.gate_proj.weight"} <= mtp
    assert not any(n.endswith("experts.0.gate_proj.weight") for n in mtp)   # experts quantized, not copied

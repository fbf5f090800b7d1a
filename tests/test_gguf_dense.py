"""Issue 15 item 4: ``--include-dense`` for GGUF sources. Each family's tiny HF checkpoint is written as a GGUF the
way llama.cpp's converter names it (gguf-py's forward TensorNameMap; 2-D weights Q8_0, norms F32), then:
the dense tensors ktconvert reads back carry exactly the HF checkpoint's names, and their values equal gguf-py's
own dequantization (rounded to BF16; F32 as stored); the converted output verifies. Tensors llama.cpp transforms,
and names nothing maps back, are refused naming the tensor and why."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGUFReader, quants  # noqa: E402

from ktconvert.errors import InputError  # noqa: E402
from ktconvert.formats.hf_source import HFSource  # noqa: E402
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

ARCHS = {"qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe", "qwen2_moe": "qwen2moe",
         "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss"}
KEEP_MTP = {"glm4_moe"}          # llama.cpp keeps GLM's nextn layers, drops DeepSeek's
NO_GGUF_NAME = {"qwen2moe": r"^model\.layers\.0\.mlp\.(gate|up|down)_proj"}  # llama.cpp's qwen2moe has no dense MLP


def _model_arch(name: str):
    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)


def _gguf_from_tiny(hf, arch: str, path, keep_mtp: bool, extra=()) -> dict[str, str]:
    """Write tiny HF checkpoint `hf` as a GGUF; returns {ggml name: HF name} of the dense tensors written."""
    src = HFSource.open(hf)
    info, ck = src.info, src.checkpoint
    n_blocks = info.n_layers + (len(info.mtp_layers) if keep_mtp else 0)
    names_map = gguf.get_tensor_name_map(_model_arch(arch), n_blocks)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", n_blocks), ("expert_count", info.n_experts),
                       ("embedding_length", info.hidden), ("expert_feed_forward_length", info.intermediate),
                       ("expert_used_count", info.experts_per_tok), ("expert_shared_count", info.n_shared),
                       ("nextn_predict_layers", n_blocks - info.n_layers)):
        w.add_uint32(f"{arch}.{key}", value)
    routed = src.routed_tensor_names(info.moe_layers + info.mtp_layers)
    dense = {}
    for name in sorted(ck.tensors):
        layer = info.layer_of(name)
        if name in routed or (layer is not None and layer >= n_blocks):
            continue
        ggml_name = names_map.get_name(name.replace("e_score_correction_bias", "e_score_correction.bias"),
                                       try_suffixes=(".weight", ".bias"))
        if ggml_name is None:
            assert re.match(NO_GGUF_NAME.get(arch, "^$"), name), name
            continue
        values = ck.read(name)
        values = bf16_bits_to_f32(values) if ck.tensors[name].dtype == "BF16" else values.astype(np.float32)
        _add(w, ggml_name, values)
        dense[ggml_name] = name
    for layer in info.moe_layers + (info.mtp_layers if keep_mtp else ()):
        experts = [src.read_expert(layer, e) for e in range(info.n_experts)]
        for proj in ("gate", "up", "down"):
            stacked = np.stack([bf16_bits_to_f32(getattr(x, proj)) for x in experts]).astype(np.float16)
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", stacked)
    for name, values in extra:
        _add(w, name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dense


def _add(w, name: str, values: np.ndarray) -> None:
    if values.ndim == 2 and values.shape[1] % 32 == 0:
        w.add_tensor(name, quants.quantize(values, T.Q8_0), raw_dtype=T.Q8_0)
    elif values.ndim >= 2:
        w.add_tensor(name, values.astype(np.float16))
    else:
        w.add_tensor(name, values)


def _reference(path) -> dict[str, np.ndarray]:
    """gguf-py's dequantization of every tensor: BF16 bits (round to nearest even), F32 tensors as stored."""
    out = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        with np.errstate(all="ignore"):
            values = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        out[t.name] = values if t.tensor_type == T.F32 else f32_to_bf16_bits(values)
    return out


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_dense_tensors_get_the_hf_names_and_gguf_py_values(tiny_model, tmp_path, model_type):
    from ktconvert.formats.gguf_source import GGUFSource

    path = tmp_path / "m.gguf"
    written = _gguf_from_tiny(tiny_model(model_type), ARCHS[model_type], path, model_type in KEEP_MTP)
    specs, read = GGUFSource.open(path).dense_tensors()
    assert sorted(name for name, _, _ in specs) == sorted(written.values())
    reference = _reference(path)
    by_hf = {hf: ggml_name for ggml_name, hf in written.items()}
    for name, dtype, shape in specs:
        got, want = read(name), reference[by_hf[name]]
        assert got.shape == shape == want.shape and dtype == ("F32" if want.dtype == np.float32 else "BF16")
        np.testing.assert_array_equal(got, want, name)


def test_include_dense_output_verifies(tiny_model, tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli
    from ktconvert.layouts.naming import dense_key

    path = tmp_path / "m.gguf"
    written = _gguf_from_tiny(tiny_model("glm4_moe"), "glm4moe", path, True)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["cpu", str(path), str(out), "--method", "amxint8", "--numa", "2",
                                      "--include-dense", "--include-mtp", "--quiet"])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {dense_key(hf) for hf in written.values()} <= set(index)
    assert "blk.3.eh_proj.weight" in index and "embed_tokens.weight" in index and "lm_head.weight" in index
    verified = CliRunner().invoke(cli, ["verify", str(out), "--source", str(path), "--hashes", "--json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.output)["ok"]
    layout = json.loads(CliRunner().invoke(cli, ["inspect", str(path), "--json"]).output)["expert_layout"]
    assert layout["form"] == "fused_separate" and layout["tensors"]["down"] == "blk.{L}.ffn_down_exps.weight"
    assert {o["orientation"] for o in layout["orientation"].values()} == {"out"}


def _refused(path) -> InputError:
    from ktconvert.formats.gguf_source import GGUFSource

    with pytest.raises(InputError) as err:
        GGUFSource.open(path).dense_tensors()
    assert err.value.exit_code == 3 and "m.gguf" in str(err.value)
    return err.value


def test_transformed_tensors_are_refused_with_the_reason(tiny_model, tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "m.gguf"
    _gguf_from_tiny(tiny_model("mixtral"), "llama", path, False)          # Mixtral: arch "llama"
    err = _refused(path)
    assert "blk.0.attn_k.weight" in str(err) and "permutes" in str(err)
    path.unlink()
    _gguf_from_tiny(tiny_model("deepseek_v3"), "deepseek2", path, False,
                    extra=[("blk.1.attn_k_b.weight", rng.standard_normal((4, 32, 128)).astype(np.float32))])
    err = _refused(path)
    assert "blk.1.attn_k_b.weight" in str(err) and "attn_kv_b" in str(err)


def test_unknown_tensor_is_refused(tiny_model, tmp_path):
    path = tmp_path / "m.gguf"
    _gguf_from_tiny(tiny_model("qwen3_moe"), "qwen3moe", path, False,
                    extra=[("blk.0.mystery.weight", np.ones((8, 64), np.float32))])
    err = _refused(path)
    assert "blk.0.mystery.weight" in str(err) and "no HF name of family qwen3_moe" in str(err)


def test_qwen3next_dense_is_refused(tmp_path):
    from ktconvert.formats.gguf_source import GGUFSource

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3next")
    for key, value in (("block_count", 1), ("expert_count", 2), ("embedding_length", 64),
                       ("expert_feed_forward_length", 32), ("expert_used_count", 1)):
        w.add_uint32(f"qwen3next.{key}", value)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    for proj, shape in (("gate", (2, 32, 64)), ("up", (2, 32, 64)), ("down", (2, 64, 32))):
        w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", np.zeros(shape, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    GGUFSource.open(path).validate()                                # the experts convert
    err = _refused(path)
    assert "blk.0.attn_norm.weight" in str(err) and "norm weights + 1" in str(err)

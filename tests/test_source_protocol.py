"""The Source protocol outside formats/: stored tensors by name, side files, config.json, a folder for transformers,
header digests, and non-expert linears (how stored, the weight as BF16 bits: FP8 through the FP8 decoder).

Golden values come from other readers: the safetensors library (tensors), the folder listing itself (side files),
hashlib over the file's header bytes (digests), and torch's float8_e4m3fn / bfloat16 casts (FP8 dequantization)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from ktconvert.errors import InputError
from ktconvert.formats.hf_source import HFSource

safetensors = pytest.importorskip("safetensors")


def _st_read(path, name):
    from safetensors.numpy import load_file

    return load_file(str(path))[name]


def test_tensors_by_name_match_the_safetensors_library(tiny_model):
    src = tiny_model("qwen3_moe", dtype="fp32")
    source = HFSource.open(src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert source.tensor_names() == sorted(index)
    name = "model.layers.0.self_attn.q_proj.weight"
    ref = source.tensor(name)
    assert (ref.dtype, ref.file.name) == ("F32", index[name])
    expected = _st_read(src / index[name], name)
    assert source.read_tensor(name).tobytes() == expected.tobytes()
    assert source.tensor("model.no.such.weight") is None
    assert source.tensors_file() == "model.safetensors.index.json"


def test_fused_slice_is_one_expert(tiny_model):
    source = HFSource.open(tiny_model("gpt_oss"))
    name = "model.layers.1.mlp.experts.down_proj"
    whole = source.read_tensor(name)
    assert np.array_equal(source.read_tensor(name, 3), whole[3])


def test_side_files_config_and_model_dir(tiny_model, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3_moe"), src)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / ".hidden").write_text("x")
    (src / "pytorch_model.bin").write_bytes(b"\0")
    (src / "sub").mkdir()
    source = HFSource.open(src)
    listed = {p.name for p in src.iterdir() if p.is_file()} - {".hidden", "pytorch_model.bin",
                                                                 "model.safetensors.index.json"}
    listed = {n for n in listed if not n.endswith(".safetensors")}
    side = source.side_files()
    assert set(side) == listed and "config.json" in side and "chat_template.jinja" in side
    assert all(side[n] == src / n for n in side)
    assert source.config_json() == json.loads((src / "config.json").read_text())
    assert source.model_dir() == src


def test_header_digests_hash_each_header(tiny_model):
    src = tiny_model("qwen3_moe")
    digests = HFSource.open(src).header_digests()
    files = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(digests) == files
    for name in files:
        data = (src / name).read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        assert digests[name] == {"bytes": len(data), "header_sha256": hashlib.sha256(data[:8 + n]).hexdigest()}


def test_stored_linear_kinds(tiny_model):
    float_src = HFSource.open(tiny_model("deepseek_v3"))
    fp8_src = HFSource.open(tiny_model("deepseek_v3", dtype="fp8"))
    module = "model.layers.1.self_attn.q_a_proj"
    assert float_src.stored_linear(module).kind == "float"
    stored = fp8_src.stored_linear(module)
    assert (stored.kind, stored.block, stored.scale.name) == ("fp8-block", (128, 128), module + ".weight_scale_inv")
    assert stored.shape == tuple(fp8_src.tensor(module + ".weight").shape)
    assert fp8_src.stored_linear("model.layers.1.input_layernorm").kind == "float"     # any float .weight
    assert fp8_src.stored_linear("model.no_such").kind == "other"


def test_read_linear_fp8_matches_torch(tiny_model):
    torch = pytest.importorskip("torch")
    source = HFSource.open(tiny_model("deepseek_v3", dtype="fp8"))
    module = "model.layers.1.self_attn.kv_b_proj"
    codes = source.read_tensor(module + ".weight")
    scale = source.read_tensor(module + ".weight_scale_inv")
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    s = torch.from_numpy(scale).repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    expected = (w * s).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(source.read_linear(module), expected)


def test_read_linear_float_is_rounded_bf16(tiny_model):
    torch = pytest.importorskip("torch")
    source = HFSource.open(tiny_model("qwen3_moe", dtype="fp32"))
    module = "model.layers.0.self_attn.o_proj"
    w = torch.from_numpy(source.read_tensor(module + ".weight"))
    expected = w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(source.read_linear(module), expected)


def test_gguf_source_refuses_tensor_reads(tmp_path):
    pytest.importorskip("gguf")
    from ktconvert.formats.sources import open_source

    spec = importlib.util.spec_from_file_location("gguf_make_fixtures",
                                                  Path(__file__).parent / "golden/gguf/make_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    fixtures.write_moe_gguf(tmp_path / "m.gguf", **fixtures.TINY)
    (tmp_path / "tokenizer.json").write_text("{}")
    source = open_source(tmp_path / "m.gguf")
    assert source.config_json() is None
    assert set(source.side_files()) == {"tokenizer.json"}
    for call in (source.tensor_names, lambda: source.read_tensor("x"), lambda: source.stored_linear("x")):
        with pytest.raises(InputError, match="needs a safetensors checkpoint; this input is gguf"):
            call()

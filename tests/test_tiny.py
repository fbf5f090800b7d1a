"""Tiny checkpoints: hub layout, shards + index, determinism, heavy tails, dtypes, and loading with transformers.
Tensors are read back with a minimal safetensors header parser written here from the format spec."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ktconvert.errors import OutputError, UnknownNameError
from ktconvert.examples.tiny import make_tiny_model


def read_header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()[:8]
    (n,) = struct.unpack("<Q", raw)
    header = json.loads(path.read_bytes()[8:8 + n])
    header.pop("__metadata__", None)
    return header, 8 + n


def all_tensors(model: Path) -> dict[str, tuple[Path, dict]]:
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        header, _ = read_header(f)
        out.update({name: (f, meta) for name, meta in header.items()})
    return out


def read_f32(model: Path, name: str) -> np.ndarray:
    f, meta = all_tensors(model)[name]
    _, base = read_header(f)
    start, end = meta["data_offsets"]
    raw = f.read_bytes()[base + start:base + end]
    if meta["dtype"] == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(meta["shape"])
    dtype = {"F32": np.float32, "F16": np.float16}[meta["dtype"]]
    return np.frombuffer(raw, dtype).astype(np.float32).reshape(meta["shape"])


def test_files_shards_and_index(tiny_model):
    path = tiny_model("deepseek_v3")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        assert (path / name).is_file()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = all_tensors(path)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) == 4 and shards[0] == "model-00001-of-00004.safetensors"   # 3 layers + MTP
    assert {n: f.name for n, (f, _) in tensors.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(m["data_offsets"][1] - m["data_offsets"][0]
                                                  for _, m in tensors.values())


def test_deepseek_v3_hub_tensors(tiny_model):
    t = {n: m for n, (_, m) in all_tensors(tiny_model("deepseek_v3")).items()}
    # layer 0 dense (intermediate_size 512), MLA with q_lora_rank 128, kv_lora_rank 128 + rope 16
    assert t["model.layers.0.mlp.gate_proj.weight"]["shape"] == [512, 256]
    assert t["model.layers.0.self_attn.q_b_proj.weight"]["shape"] == [4 * (32 + 16), 128]
    assert t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]["shape"] == [144, 256]
    assert t["model.layers.0.self_attn.kv_b_proj.weight"]["shape"] == [4 * (32 + 32), 128]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in t
    for layer in (1, 2, 3):                     # MoE layers and the MTP layer 3
        assert t[f"model.layers.{layer}.mlp.experts.7.down_proj.weight"]["shape"] == [256, 256]
        assert t[f"model.layers.{layer}.mlp.gate.weight"]["shape"] == [8, 256]
        assert t[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
        assert t[f"model.layers.{layer}.mlp.shared_experts.up_proj.weight"]["shape"] == [256, 256]
    assert t["model.layers.3.eh_proj.weight"]["shape"] == [256, 512]
    assert t["model.layers.3.shared_head.head.weight"]["shape"] == [512, 256]
    assert "model.layers.4.input_layernorm.weight" not in t
    assert t["lm_head.weight"]["dtype"] == "BF16"


@pytest.mark.parametrize("arch, names", [
    ("mixtral", {"model.layers.1.block_sparse_moe.experts.7.w1.weight": [256, 256],
                 "model.layers.1.block_sparse_moe.experts.7.w2.weight": [256, 256]}),
    ("minimax_m2", {"model.layers.0.block_sparse_moe.e_score_correction_bias": [8],
                    "model.layers.0.self_attn.q_norm.weight": [256], "model.layers.0.self_attn.k_norm.weight": [128]}),
    ("gpt_oss", {"model.layers.1.mlp.experts.gate_up_proj": [8, 256, 512],      # [E, H, 2I]
                 "model.layers.1.mlp.experts.down_proj": [8, 256, 256],         # [E, I, H]
                 "model.layers.1.mlp.experts.gate_up_proj_bias": [8, 512], "model.layers.1.self_attn.sinks": [4]}),
    ("qwen3_5_moe", {"model.language_model.layers.0.mlp.experts.gate_up_proj": [8, 512, 256],   # [E, 2I, H]
                     "model.language_model.layers.1.mlp.experts.down_proj": [8, 256, 256],
                     "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": [2 * 2 * 32 + 4 * 32, 256],
                     "model.language_model.layers.1.self_attn.q_proj.weight": [2 * 4 * 64, 256],
                     "model.visual.patch_embed.proj.weight": [64, 3, 2, 14, 14]}),
    ("qwen3_next", {"model.layers.0.linear_attn.in_proj_qkvz.weight": [2 * 2 * 32 + 2 * 4 * 32, 256],
                    "model.layers.1.mlp.shared_expert_gate.weight": [1, 256]}),
    ("qwen2_moe", {"model.layers.0.mlp.down_proj.weight": [256, 512],
                   "model.layers.1.mlp.shared_expert.gate_proj.weight": [512, 256]}),
])
def test_family_layouts(tiny_model, arch, names):
    t = {n: m["shape"] for n, (_, m) in all_tensors(tiny_model(arch)).items()}
    for name, shape in names.items():
        assert t.get(name) == shape, name


def test_deterministic_per_seed(tmp_path):
    kw = dict(arch="qwen3_moe", layers=2, experts=2, hidden=128, intermediate=128)
    a, b, c = (make_tiny_model(tmp_path / n, seed=s, **kw) for n, s in (("a", 5), ("b", 5), ("c", 6)))
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    shards = [n for n in files if n.endswith(".safetensors")]
    assert all((a / n).read_bytes() != (c / n).read_bytes() for n in shards)


def test_heavy_tails(tiny_model):
    w = read_f32(tiny_model("qwen3_moe"), "model.layers.1.mlp.experts.3.gate_proj.weight")
    std = float(w.std())
    assert 0.015 < std < 0.06
    assert float(np.abs(w).max()) / std > 6
    assert 0.003 < float(np.mean(np.abs(w) > 5.5 * 0.02)) < 0.03     # ~0.75 % tail entries (+ scaled rows)
    assert abs(float(w.mean())) < 0.01


def test_dtypes_share_values(tiny_model):
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    bf16 = read_f32(tiny_model("mixtral", layers=1, experts=2), name.replace("mlp", "block_sparse_moe")
                    .replace("down_proj", "w2"))
    fp32 = read_f32(tiny_model("mixtral", layers=1, experts=2, dtype="fp32"),
                    name.replace("mlp", "block_sparse_moe").replace("down_proj", "w2"))
    fp16 = tiny_model("mixtral", layers=1, experts=2, dtype="fp16")
    np.testing.assert_array_equal(bf16, fp32)          # generated on the BF16 grid; fp32 widens exactly
    meta = all_tensors(fp16)["model.layers.0.block_sparse_moe.experts.1.w2.weight"][1]
    assert meta["dtype"] == "F16"
    assert json.loads((fp16 / "config.json").read_text())["torch_dtype"] == "float16"


@pytest.mark.parametrize("arch, dtype", [("deepseek_v3", "bf16"), ("deepseek_v3", "fp8"), ("kimi_k2", "ct-int4"),
                                         ("gpt_oss", "mxfp4"), ("mixtral", "fp32"), ("qwen3_moe", "fp16")])
def test_shards_are_what_safetensors_writes(tiny_model, tmp_path, arch, dtype):
    """The shards are written by ktconvert's own writer (no torch); reference: safetensors itself, loading every
    shard and saving the same tensors and metadata again gives the same bytes."""
    pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tiny_model(arch, dtype=dtype)
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        assert metadata == {"format": "pt"}
        again = tmp_path / shard.name
        save_file(tensors, str(again), metadata=metadata)
        assert again.read_bytes() == shard.read_bytes(), shard.name


def test_overrides_and_layer_types(tiny_model):
    path = tiny_model("qwen3_next", layers=5, experts=4, hidden=128, intermediate=384)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]) == \
        (5, 4, 128, 384)
    assert cfg["layer_types"] == ["linear_attention", "full_attention"] * 2 + ["linear_attention"]
    t = {n: m["shape"] for n, (_, m) in all_tensors(path).items()}
    assert t["model.layers.4.mlp.experts.3.gate_proj.weight"] == [384, 128]
    assert "model.layers.4.linear_attn.out_proj.weight" in t and "model.layers.3.self_attn.q_proj.weight" in t


def test_refuses_nonempty_out_unless_force(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        make_tiny_model(out, "mixtral", layers=1, experts=2)
    make_tiny_model(out, "mixtral", layers=1, experts=2, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not any(p.name.startswith(".m.tmp") for p in tmp_path.iterdir())


def test_unknown_dtype_lists_supported(tmp_path):
    with pytest.raises(UnknownNameError) as err:
        make_tiny_model(tmp_path / "m", "mixtral", dtype="int3")
    assert "bf16" in str(err.value) and "fp16" in str(err.value) and "fp32" in str(err.value)
    assert not (tmp_path / "m").exists()


def test_cli_tiny_model(tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    result = CliRunner().invoke(cli, ["tiny-model", str(tmp_path / "x"), "--arch", "deepseek_v3", "--layers", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "x" / "config.json").read_text())["num_hidden_layers"] == 2


def _load_with_transformers(path: Path, arch: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cls = transformers.AutoModelForImageTextToText if arch == "qwen3_5_moe" else transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True)
    n_layers = model.config.get_text_config().num_hidden_layers
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith(f"model.layers.{n_layers}.")]  # MTP
    assert (sorted(info["missing_keys"]), unexpected, sorted(info["mismatched_keys"])) == ([], [], [])
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok("tok5 tok6").input_ids == [5, 6]
    return model


@pytest.mark.slow      # importing transformers alone takes ~10 s on the 2-core CI machine
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_transformers_loads(tiny_model, arch):
    import torch

    model = _load_with_transformers(tiny_model(arch), arch)
    assert model.dtype == torch.bfloat16
    out = model(torch.tensor([[5, 6, 7]]))
    assert torch.isfinite(out.logits.float()).all()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen2_moe", "qwen3_next", "glm4_moe", "minimax_m2", "mixtral",
                                  "gpt_oss", "qwen3_5_moe"])
def test_transformers_loads_every_family(tiny_model, arch):
    _load_with_transformers(tiny_model(arch), arch)

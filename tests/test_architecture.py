"""Manifests and config resolution. Expected numbers are computed by hand from the tiny configs (manifests/*.toml
[tiny.*.config]) written out by make_tiny_model, not from resolve()."""
from __future__ import annotations

import json

import pytest

from ktconvert.architectures.manifests import component_of, families, load_manifests, manifest_for, resolve
from ktconvert.errors import ManifestError

REQUIRED_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "qwen2_moe", "qwen3_moe", "qwen3_next", "glm4_moe",
                  "minimax_m2", "mixtral", "gpt_oss", "qwen3_5_moe"}

# arch: (n_layers, moe_layers, mtp_layers, n_experts, hidden, intermediate, experts_per_tok, n_shared,
#        shared_intermediate, first_dense, name_prefix)
EXPECTED = {
    # 3 layers, first_k_dense_replace=1, freq 1 -> MoE 1, 2; num_nextn_predict_layers=1 -> MTP 3
    "deepseek_v3": (3, (1, 2), (3,), 8, 256, 256, 2, 1, 256, 1, "model."),
    "kimi_k2": (2, (1,), (), 8, 256, 256, 2, 1, 256, 1, "model."),
    # n_shared_experts=2 -> shared intermediate 2 * 256
    "deepseek_v2": (3, (1, 2), (), 8, 256, 256, 2, 2, 512, 1, "model."),
    # decoder_sparse_step=1, mlp_only_layers=[0]; shared_expert_intermediate_size=512
    "qwen2_moe": (3, (1, 2), (), 8, 256, 256, 2, 1, 512, 1, "model."),
    "qwen3_moe": (2, (0, 1), (), 8, 256, 256, 2, 0, 0, 0, "model."),
    "qwen3_next": (2, (0, 1), (), 8, 256, 256, 2, 1, 256, 0, "model."),
    "glm4_moe": (3, (1, 2), (3,), 8, 256, 256, 2, 1, 256, 1, "model."),
    "minimax_m2": (2, (0, 1), (), 8, 256, 256, 2, 0, 0, 0, "model."),
    "mixtral": (2, (0, 1), (), 8, 256, 256, 2, 0, 0, 0, "model."),
    "gpt_oss": (2, (0, 1), (), 8, 256, 256, 2, 0, 0, 0, "model."),
    "qwen3_5_moe": (2, (0, 1), (), 8, 256, 256, 2, 1, 256, 0, "model.language_model."),
}


def _tensor_names(path) -> list[str]:
    index = path / "model.safetensors.index.json"
    return list(json.loads(index.read_text())["weight_map"])


def test_manifests_load_and_cover_families():
    manifests = load_manifests()
    assert REQUIRED_TYPES <= set(manifests)
    assert manifests["kimi_k2"] is manifests["deepseek_v3"]
    assert manifest_for("gpt_oss").experts.form == "fused"
    assert manifest_for("mixtral").experts.proj == {"gate": "w1", "up": "w3", "down": "w2"}
    assert {"deepseek", "qwen3_5_moe", "minimax_m2"} <= set(families())


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_tiny_config_resolves_to_hand_numbers(tiny_model, arch):
    path = tiny_model(arch)
    config = json.loads((path / "config.json").read_text())
    info = resolve(config, _tensor_names(path))
    got = (info.n_layers, info.moe_layers, info.mtp_layers, info.n_experts, info.hidden, info.intermediate,
           info.experts_per_tok, info.n_shared, info.shared_intermediate, info.first_dense, info.name_prefix)
    assert got == EXPECTED[arch]
    assert info.model_type == arch


def test_rule_first_dense_freq():
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "n_routed_experts": 4, "hidden_size": 64,
              "moe_intermediate_size": 32, "num_experts_per_tok": 2, "first_k_dense_replace": 2, "moe_layer_freq": 2}
    info = resolve(config)
    assert info.moe_layers == (2, 4, 6)
    assert info.mtp_layers == () and info.n_shared == 0 and info.first_dense == 2


def test_rule_sparse_step():
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 8, "num_experts": 4, "hidden_size": 64,
              "moe_intermediate_size": 32, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
              "mlp_only_layers": [3]}
    assert resolve(config).moe_layers == (1, 5, 7)
    config["num_local_experts"] = config.pop("num_experts")      # second key in the manifest's list
    assert resolve(config).n_experts == 4


def test_nested_text_config_and_prefix():
    config = {"model_type": "glm4_moe", "text_config": {
        "num_hidden_layers": 4, "n_routed_experts": 16, "hidden_size": 128, "moe_intermediate_size": 64,
        "num_experts_per_tok": 4, "first_k_dense_replace": 1, "n_shared_experts": 1, "num_nextn_predict_layers": 1}}
    info = resolve(config, ["model.language_model.layers.0.input_layernorm.weight", "lm_head.weight"])
    assert (info.moe_layers, info.mtp_layers, info.n_experts) == ((1, 2, 3), (4,), 16)
    assert info.name_prefix == "model.language_model."
    assert info.expert_names(2, 5)["gate"] == "model.language_model.layers.2.mlp.experts.5.gate_proj.weight"


def test_expert_names_from_manifest_data():
    mixtral = resolve({"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 2, "hidden_size": 8,
                       "intermediate_size": 4, "num_experts_per_tok": 1})
    assert mixtral.expert_names(0, 1) == {"gate": "model.layers.0.block_sparse_moe.experts.1.w1.weight",
                                          "up": "model.layers.0.block_sparse_moe.experts.1.w3.weight",
                                          "down": "model.layers.0.block_sparse_moe.experts.1.w2.weight"}
    oss = resolve({"model_type": "gpt_oss", "num_hidden_layers": 1, "num_local_experts": 2, "hidden_size": 8,
                   "intermediate_size": 4, "experts_per_token": 1})
    assert oss.fused and oss.experts_per_tok == 1
    assert oss.fused_names(0) == {"gate_up": "model.layers.0.mlp.experts.gate_up_proj",
                                  "down": "model.layers.0.mlp.experts.down_proj",
                                  "gate_up_bias": "model.layers.0.mlp.experts.gate_up_proj_bias",
                                  "down_bias": "model.layers.0.mlp.experts.down_proj_bias"}


def test_unknown_model_type_lists_known_and_how_to_add():
    with pytest.raises(ManifestError) as err:
        manifest_for("llama4_moe_x")
    msg = str(err.value)
    assert "llama4_moe_x" in msg and "deepseek_v3" in msg and "qwen3_moe" in msg
    assert "KTCONVERT_MANIFEST_PATH" in msg and "manifests/" in msg


def test_missing_config_key_lists_keys_tried():
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "moe_intermediate_size": 32,
              "num_experts_per_tok": 2}
    with pytest.raises(ManifestError) as err:
        resolve(config)
    assert "n_experts" in str(err.value) and "num_experts, num_local_experts" in str(err.value)
    nested = {"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 2, "num_experts": 4,
                                                           "hidden_size": 64, "num_experts_per_tok": 2}}
    with pytest.raises(ManifestError) as err:
        resolve(nested)
    assert "text_config.moe_intermediate_size, moe_intermediate_size" in str(err.value)


def test_prefix_mismatch_fails():
    config = {"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 2, "hidden_size": 8,
              "intermediate_size": 4, "num_experts_per_tok": 1}
    with pytest.raises(ManifestError, match="layer prefix"):
        resolve(config, ["transformer.h.0.mlp.weight"])


TOY = '''
family = "toy_moe"
model_types = ["toy_moe"]
[config]
n_layers = ["n_layer"]
n_experts = ["n_expert"]
hidden = ["d_model"]
intermediate = ["d_expert"]
experts_per_tok = ["top_k"]
[experts]
pattern = "blocks.{L}.moe.{E}.{proj}"
proj = { gate = "wg", up = "wu", down = "wd" }
'''


def test_manifest_path_adds_family(tmp_path, monkeypatch):
    (tmp_path / "toy.toml").write_text(TOY)
    monkeypatch.setenv("KTCONVERT_MANIFEST_PATH", str(tmp_path))
    info = resolve({"model_type": "toy_moe", "n_layer": 3, "n_expert": 4, "d_model": 32, "d_expert": 16,
                    "top_k": 1})
    assert (info.family, info.moe_layers, info.n_experts) == ("toy_moe", (0, 1, 2), 4)
    assert info.expert_names(1, 2)["down"] == "model.blocks.1.moe.2.wd"


def test_manifest_unknown_key_names_file_and_key(tmp_path, monkeypatch):
    (tmp_path / "bad.toml").write_text(TOY.replace("[experts]", "[experts]\nbias_name = 'x'"))
    monkeypatch.setenv("KTCONVERT_MANIFEST_PATH", str(tmp_path))
    with pytest.raises(ManifestError) as err:
        load_manifests()
    assert "bad.toml" in str(err.value) and "bias_name" in str(err.value)
    (tmp_path / "bad.toml").write_text(TOY.replace("[config]", "[config]\nexperts_total = ['x']"))
    with pytest.raises(ManifestError, match="experts_total"):
        load_manifests()


def test_component_regexes():
    m = manifest_for("deepseek_v3")
    assert component_of(m, "model.layers.3.mlp.experts.7.up_proj.weight") == "routed_experts"
    assert component_of(m, "model.layers.3.mlp.shared_experts.up_proj.weight") == "shared_experts"
    assert component_of(m, "model.layers.3.mlp.gate.e_score_correction_bias") == "router"
    assert component_of(m, "model.layers.0.self_attn.kv_b_proj.weight") == "attention"
    assert component_of(m, "model.layers.0.mlp.down_proj.weight") == "dense_mlp"
    assert component_of(m, "model.layers.3.eh_proj.weight") == "mtp"
    assert component_of(m, "lm_head.weight") == "embeddings"


# ---------------------------------------------------------------- config.json that contradicts the tensors (issue 14, 11)

QWEN = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8, "hidden_size": 64,
        "moe_intermediate_size": 32, "num_experts_per_tok": 2}


def _qwen_names(layers: int, experts: int) -> list[str]:
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    for layer in range(layers):
        names.append(f"model.layers.{layer}.self_attn.q_proj.weight")
        names.append(f"model.layers.{layer}.mlp.gate.weight")
        for e in range(experts):
            names += [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
    return names


def test_consistent_config_and_tensors_resolve():
    info = resolve(QWEN, _qwen_names(2, 8))
    assert (info.n_layers, info.n_experts, info.experts_per_tok) == (2, 8, 2)


@pytest.mark.parametrize("key,value,layers,experts,needles", [
    ("num_experts", 4, 2, 8, ["num_experts", "model.layers.0.mlp.experts.4.gate_proj.weight"]),
    ("num_hidden_layers", 1, 2, 8, ["num_hidden_layers", "model.layers.1."]),
    ("num_experts", 8.5, 2, 8, ["num_experts", "8.5"]),
    ("decoder_sparse_step", 0, 2, 8, ["decoder_sparse_step", "0"]),
    ("num_experts_per_tok", 99, 2, 8, ["num_experts_per_tok", "99"]),
    ("num_experts", 0, 2, 8, ["num_experts"]),
    ("num_experts", True, 2, 8, ["num_experts", "True"]),
    ("num_hidden_layers", -2, 2, 8, ["num_hidden_layers", "-2"]),
    ("hidden_size", "64", 2, 8, ["hidden_size", "'64'"]),
    ("moe_intermediate_size", 0, 2, 8, ["moe_intermediate_size"]),
    ("num_experts_per_tok", 0, 2, 8, ["num_experts_per_tok"]),
    ("mlp_only_layers", [0, "1"], 2, 8, ["mlp_only_layers"]),
    ("mlp_only_layers", [7], 2, 8, ["mlp_only_layers", "7"]),
])
def test_config_value_or_tensors_contradiction_is_refused(key, value, layers, experts, needles):
    config = {**QWEN, key: value}
    with pytest.raises(ManifestError) as err:
        resolve(config, _qwen_names(layers, experts))
    msg = str(err.value)
    assert err.value.exit_code == 3 and "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_expert_tensors_in_a_dense_layer_are_refused():
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "n_routed_experts": 2, "hidden_size": 64,
              "moe_intermediate_size": 32, "num_experts_per_tok": 1, "first_k_dense_replace": 1}
    names = [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for layer in (0, 1) for e in range(2)
             for p in ("gate", "up", "down")]
    with pytest.raises(ManifestError) as err:
        resolve(config, names)
    assert "model.layers.0.mlp.experts.0." in str(err.value) and "first_k_dense_replace" in str(err.value)
    resolve(config, [n for n in names if ".layers.1." in n])      # the config's own layout passes


def test_mtp_layers_inside_the_config_are_accepted():
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "n_routed_experts": 2, "hidden_size": 64,
              "moe_intermediate_size": 32, "num_experts_per_tok": 1, "num_nextn_predict_layers": 1}
    names = [f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight" for layer in (0, 1, 2) for e in range(2)]
    assert resolve(config, names).mtp_layers == (2,)
    with pytest.raises(ManifestError, match="model.layers.3."):
        resolve(config, names + ["model.layers.3.mlp.experts.0.gate_proj.weight"])


def test_tiny_checkpoint_with_too_few_experts_in_config_fails_on_open(tiny_model, tmp_path):
    """Per-expert tensors beyond num_experts are refused at open (they used to be dropped); fused tensors carry E in
    their shape, which validate() compares with the config."""
    import shutil

    from ktconvert.errors import InputError
    from ktconvert.formats.sources import open_source

    for arch, key in (("qwen3_moe", "num_experts"), ("gpt_oss", "num_local_experts")):
        src = tmp_path / arch
        shutil.copytree(tiny_model(arch), src)
        config = json.loads((src / "config.json").read_text())
        config[key] = 4                                  # the tiny checkpoints hold 8 experts per layer
        (src / "config.json").write_text(json.dumps(config))
        with pytest.raises(InputError) as err:
            open_source(src).validate()
        msg = str(err.value)
        assert err.value.exit_code == 3
        if arch == "qwen3_moe":
            assert key in msg and "experts.4." in msg, msg
        else:
            assert "[4, " in msg and "[8, " in msg, msg

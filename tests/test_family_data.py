"""Family data read from the manifests: GGUF architecture names, transformers aliases, and which linears SGLang
builds as LinearBase layers (``[linears]``), with the loader's ManifestError for each bad value.

Golden values: llama.cpp's ``general.architecture`` names (its LLM_ARCH table: "deepseek2", "qwen3moe", ...), the
model_type transformers registers Kimi-K2's classes under (DeepseekV3), and SGLang's model code (which modules are
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``ReplicatedLinear`` built with the quant_config) for the tiny
checkpoints' module names."""
from __future__ import annotations

import pytest

from ktconvert.architectures.family_tensors import family_vocabulary
from ktconvert.architectures.manifests import (DEFAULT_LINEARS, families, gguf_architectures, linear_kind,
                                               load_manifests, manifest_for, transformers_alias)
from ktconvert.errors import ManifestError
from ktconvert.gpu.linears import is_linear_base

TOY = '''
family = "toy_moe"
model_types = ["toy_moe", "toy_moe_chat"]
[config]
n_layers = ["n_layer"]
n_experts = ["n_expert"]
hidden = ["d_model"]
intermediate = ["d_expert"]
experts_per_tok = ["top_k"]
[experts]
form = "per_expert"
pattern = "blocks.{L}.moe.{E}.{proj}"
proj = { gate = "wg", up = "wu", down = "wd" }
'''


def _with(top: str = "", tables: str = "") -> str:
    head, _, rest = TOY.partition("[config]")
    return head + top + "\n[config]" + rest + tables


def test_gguf_architectures_are_llama_cpp_names():
    assert gguf_architectures() == {
        "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next",
        "deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
        "llama": "mixtral"}


def test_transformers_alias_of_kimi_k2_only():
    assert transformers_alias("kimi_k2") == "deepseek_v3"
    assert [t for t in load_manifests() if transformers_alias(t)] == ["kimi_k2"]
    assert transformers_alias("no_such_type") is None


def test_family_data_from_an_added_manifest(tmp_path, monkeypatch):
    (tmp_path / "toy.toml").write_text(_with('gguf_architectures = { toymoe = "toy_moe" }\n'
                                             'transformers_aliases = { toy_moe_chat = "toy_moe" }\n',
                                             "[linears]\nattention = ['attn\\.(wq|wo)']\n"))
    monkeypatch.setenv("KTCONVERT_MANIFEST_PATH", str(tmp_path))
    assert gguf_architectures()["toymoe"] == "toy_moe"
    assert transformers_alias("toy_moe_chat") == "toy_moe"
    toy = manifest_for("toy_moe")
    assert toy.linear_kind("model.blocks.0.attn.wq") == "attention"
    assert toy.linear_kind("model.blocks.0.attn.wk") is None
    assert toy.linear_kind("model.blocks.0.self_attn.q_proj") is None      # only what [linears] names
    assert toy.linear_kind("model.blocks.0.xattn.wq") is None              # matched from a dot on


def test_manifest_without_linears_gets_sglangs_usual_names(tmp_path, monkeypatch):
    (tmp_path / "toy.toml").write_text(TOY)
    monkeypatch.setenv("KTCONVERT_MANIFEST_PATH", str(tmp_path))
    toy = manifest_for("toy_moe")
    assert toy.linears == DEFAULT_LINEARS
    assert toy.linear_kind("model.layers.0.self_attn.o_proj") == "attention"
    assert toy.gguf_architectures == {} and toy.transformers_aliases == {}


@pytest.mark.parametrize("top, tables, needles", [
    ('gguf_architectures = { toymoe = "toy" }\n', "", ("gguf_architectures", "'toy'", "toy_moe")),
    ('gguf_architectures = ["toymoe"]\n', "", ("gguf_architectures", "table of strings")),
    ('transformers_aliases = { other = "deepseek_v3" }\n', "", ("transformers_aliases", "'other'")),
    ("", "[linears]\nrouter = ['mlp\\.gate']\n", ("[linears]", "router", "attention, dense, shared")),
    ("", "[linears]\nattention = ['self_attn\\.(q_proj']\n", ("[linears] attention", "bad regex")),
    ("", "[linears]\ndense = 3\n", ("[linears] dense", "list of strings")),
])
def test_bad_family_data_names_file_and_key(tmp_path, monkeypatch, top, tables, needles):
    (tmp_path / "bad.toml").write_text(_with(top, tables))
    monkeypatch.setenv("KTCONVERT_MANIFEST_PATH", str(tmp_path))
    with pytest.raises(ManifestError) as err:
        load_manifests()
    msg = str(err.value)
    assert "bad.toml" in msg and all(n in msg for n in needles), msg


# SGLang: DeepseekV2AttentionMLA (fused_qkv_a_proj_with_mqa / q_a_proj, q_b_proj or q_proj, kv_b_proj, o_proj),
# DeepseekV2MLP (dense layers and shared_experts: gate_up_proj, down_proj); MoEGate, eh_proj and shared_head are not
# LinearBase. Qwen3-Next: Gated DeltaNet in_proj_qkvz / in_proj_ba / out_proj, attention q/k/v/o, shared_expert MLP;
# shared_expert_gate is a plain nn.Linear, the router mlp.gate a ReplicatedLinear without quant_config.
LINEAR_BASE = {
    "deepseek": {("self_attn", m) for m in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                            "o_proj")}
                | {("mlp", m) for m in ("gate_proj", "up_proj", "down_proj")}
                | {("mlp.shared_experts", m) for m in ("gate_proj", "up_proj", "down_proj")},
    "qwen3_next": {("linear_attn", m) for m in ("in_proj_qkvz", "in_proj_ba", "out_proj")}
                  | {("self_attn", m) for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
                  | {("mlp.shared_expert", m) for m in ("gate_proj", "up_proj", "down_proj")},
}


def _modules(family: str) -> set[str]:
    return {n.rsplit(".", 1)[0] for n in family_vocabulary(family) if n.endswith(".weight")}


@pytest.mark.parametrize("family", sorted(LINEAR_BASE))
def test_linear_base_modules_are_sglangs(family):
    manifest = families()[family]
    found = {tuple(m.split("layers.{L}.", 1)[1].rsplit(".", 1)) for m in _modules(family)
             if is_linear_base(m, manifest)}
    assert found == LINEAR_BASE[family]


def test_every_family_names_the_linears_sglangs_usual_names_do():
    """Each shipped family's [linears] picks, among its own tensors, what the family-blind default picks."""
    for family, manifest in families().items():
        for module in _modules(family):
            assert (manifest.linear_kind(module) is None) == (linear_kind(module) is None), (family, module)

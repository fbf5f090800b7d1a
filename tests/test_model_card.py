"""The model card publish uploads: huggingface_hub's own parser reads its metadata back (library_name, tags,
base_model, base_model_relation), and its text fits the output kind (CPU method + NUMA + --kt-* flags; GPU scheme +
--model, no NUMA wording)."""
from __future__ import annotations

import pytest

from ktconvert.formats.out_manifest import build_manifest

huggingface_hub = pytest.importorskip("huggingface_hub")

MODEL = {"family": "qwen3_moe", "model_type": "qwen3_moe", "layers": [0, 1], "experts": 4, "hidden": 256,
         "intermediate": 128}


def _manifest(kind="cpu", method="AMXINT4", source=None):
    source = source or {"config_sha256": "0" * 64, "files": {}}
    extra = {} if kind == "cpu" else {"kind": "gpu", "flags": {"model": "."}, "layout": "compressed-tensors",
                                      "gpu": {"experts": "w4a16", "group_size": 128, "algo": "rtn",
                                              "linears": "fp8"}}
    manifest = build_manifest(method=method, numa=2, layout="kt", model=MODEL, source=source, files=[], tensors={})
    manifest.update(extra)
    return manifest


def _parsed(card, tmp_path):
    """Round trip through the library: write README.md, ModelCard.load it back."""
    from huggingface_hub import ModelCard

    path = tmp_path / "README.md"
    path.write_text(str(card))
    return ModelCard.load(path)


def test_cpu_card_from_an_hf_source_names_its_base_model(tmp_path):
    from ktconvert.ops.model_card import model_card

    hub = {"config_sha256": "1" * 64, "files": {}, "hub": "hf", "repo": "Qwen/Qwen3-30B-A3B", "revision": "abc"}
    card = _parsed(model_card(_manifest(source=hub), "org/qwen-amxint4"), tmp_path)
    data = card.data.to_dict()
    assert data["base_model"] == "Qwen/Qwen3-30B-A3B" and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "ktransformers" and "amxint4" in data["tags"]
    assert "--kt-method AMXINT4" in card.text and "--kt-threadpool-count 2" in card.text
    assert "python -m sglang.launch_server --model" in card.text and "NUMA count 2" in card.text


def test_gpu_card_speaks_of_the_gpu_checkpoint(tmp_path):
    from ktconvert.ops.model_card import model_card

    card = _parsed(model_card(_manifest(kind="gpu", method="W4A16"), "org/qwen-gpu", base_model="Qwen/Q"), tmp_path)
    assert card.data.to_dict()["base_model"] == "Qwen/Q" and "compressed-tensors" in card.data.to_dict()["tags"]
    assert "W4A16" in card.text and "--model /path/to/this/repo" in card.text
    assert "NUMA" not in card.text and "kt-kernel CPU expert weights" not in card.text


def test_local_source_and_bf16_copy_claim_no_quantized_base(tmp_path):
    from ktconvert.ops.model_card import model_card

    local = _parsed(model_card(_manifest(), "org/x"), tmp_path).data.to_dict()
    assert "base_model" not in local and "base_model_relation" not in local
    bf16 = _parsed(model_card(_manifest(method="BF16"), "org/x", base_model="a/b"), tmp_path).data.to_dict()
    assert bf16["base_model"] == "a/b" and "base_model_relation" not in bf16


def test_publish_rejects_a_bad_base_model(tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    res = CliRunner().invoke(cli, ["publish", str(tmp_path), "org/x", "--base-model", "not a repo!"])
    assert res.exit_code != 0

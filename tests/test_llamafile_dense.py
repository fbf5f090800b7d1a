"""``--method llamafile --include-dense``: a complete GGUF (formats/gguf_model.py, formats/gguf_sink.py).

Golden values: gguf-py's own tables (``gguf.get_tensor_name_map`` / ``MODEL_TENSORS``) for the names a complete
qwen3moe GGUF holds, gguf-py's ``GGUFReader`` and ``dequantize`` for what the files hold (every non-expert tensor
equal to the source's values: BF16 bits as stored, 1-D tensors and the router as F32), the source's config.json and
tokenizer.json for the metadata, and, where llama-cpp-python is importable (here or in the interpreter
``KTCONVERT_LLAMA_PYTHON`` names), llama.cpp itself: it loads the output and its logits agree with transformers'
forward of the source model within 5% (relative L2 over a few tokens). Refusals (exit 2, OUT never made): an
architecture whose tensors llama.cpp transforms (Mixtral's llama-architecture attn_q / attn_k), one not mapped.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ktconvert.formats.sources import open_source  # noqa: E402
from ktconvert.quant.bf16 import bf16_bits_to_f32  # noqa: E402

SHAPE = dict(hidden=256, intermediate=512, experts=4, layers=2)
TOKENS = [5, 17, 42, 99, 3, 250, 7, 128]
LLAMA_SCRIPT = """
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], logits_all=True, n_ctx=64, n_threads=2, verbose=False)
tokens = json.loads(sys.argv[2])
llm.eval(tokens)
print(json.dumps(np.asarray(llm.scores[:len(tokens)], dtype=np.float64).tolist()))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny qwen3_moe model with a GPT-2 byte-level BPE tokenizer.json (Qwen's kind; the tiny model's own is
    WordLevel, which llama.cpp has no vocabulary for), trained by the tokenizers library to the model's 512 ids."""
    from ktconvert.examples.tiny import make_tiny_model

    tokenizers = pytest.importorskip("tokenizers")
    path = make_tiny_model(tmp_path_factory.mktemp("lfd") / "qwen3", "qwen3_moe", **SHAPE)
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    corpus = [" ".join("".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(40)) for _ in range(400)]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=512, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    (path / "tokenizer.json").write_text(bpe._tokenizer.to_str(), encoding="utf-8")
    return path


def _cli(*args, code: int = 0) -> str:
    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *map(str, args)], capture_output=True,
                          text=True)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return proc.stdout or proc.stderr


@pytest.fixture(scope="module")
def outputs(model, tmp_path_factory):
    """{"Q8_0" | "BF16" | "split": OUT} of --include-dense runs."""
    root = tmp_path_factory.mktemp("lfd-out")
    runs = {"Q8_0": ("--ggml-type", "Q8_0"), "BF16": ("--ggml-type", "BF16"),
            "split": ("--ggml-type", "Q8_0", "--split-max-size", "700K")}
    for name, extra in runs.items():
        _cli("cpu", model, root / name, "--method", "llamafile", "--include-dense", *extra, "--quiet")
    return {name: root / name for name in runs}


def _tensors(out: Path) -> dict:
    return {t.name: t for p in sorted(out.glob("*.gguf")) for t in gguf.GGUFReader(p).tensors}


def test_every_tensor_has_gguf_py_s_name_and_the_source_values(model, outputs):
    source = open_source(model)
    specs, read = source.dense_tensors()
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, SHAPE["layers"])
    arch_names = {gguf.TENSOR_NAMES[k] for k in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE]}
    for out in outputs.values():
        tensors = _tensors(out)
        want = {table.get_name(hf, try_suffixes=(".weight",)): hf for hf, _, _ in specs}
        experts = {f"blk.{b}.ffn_{p}_exps.weight" for b in range(SHAPE["layers"]) for p in ("gate", "up", "down")}
        assert set(tensors) == set(want) | experts
        for name in tensors:
            base = name.rsplit(".", 1)[0]
            assert any(base == pattern.format(bid=b) for pattern in arch_names for b in range(SHAPE["layers"]))
        for name, hf in want.items():
            t = tensors[name]
            bits = read(hf)
            value = bf16_bits_to_f32(bits)
            assert [int(x) for x in t.shape] == list(reversed(bits.shape)) or (bits.ndim == 1 and
                                                                             int(t.shape[0]) == bits.shape[0])
            if bits.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
                assert t.tensor_type.name == "F32"
                assert np.array_equal(np.asarray(t.data, dtype=np.float32).reshape(value.shape), value)
            else:
                assert t.tensor_type.name == "BF16"
                assert np.array_equal(np.asarray(t.data).view(np.uint16).reshape(bits.shape), bits)


def test_metadata_and_tokenizer_come_from_the_source(model, outputs):
    config = json.loads((model / "config.json").read_text())
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    merges = json.loads((model / "tokenizer.json").read_text())["model"]["merges"]
    for out in outputs.values():
        first = sorted(out.glob("*.gguf"))[0]
        fields = gguf.GGUFReader(first).fields
        value = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
        assert value["general.architecture"] == "qwen3moe"
        assert value["qwen3moe.block_count"] == config["num_hidden_layers"]
        assert value["qwen3moe.embedding_length"] == config["hidden_size"]
        assert value["qwen3moe.attention.head_count"] == config["num_attention_heads"]
        assert value["qwen3moe.attention.head_count_kv"] == config["num_key_value_heads"]
        assert value["qwen3moe.attention.key_length"] == config["head_dim"]
        assert value["qwen3moe.expert_count"] == config["num_experts"]
        assert value["qwen3moe.expert_used_count"] == config["num_experts_per_tok"]
        assert value["qwen3moe.expert_feed_forward_length"] == config["moe_intermediate_size"]
        assert value["qwen3moe.rope.freq_base"] == pytest.approx(config["rope_theta"])
        assert value["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
        tokens = value["tokenizer.ggml.tokens"]
        assert len(tokens) == config["vocab_size"] and all(tokens[i] == t for t, i in vocab.items())
        assert value["tokenizer.ggml.model"] == "gpt2" and value["tokenizer.ggml.pre"] == "qwen2"
        assert len(value["tokenizer.ggml.merges"]) == len(merges) > 0
        assert value["tokenizer.ggml.bos_token_id"] == config["bos_token_id"]
        assert value["tokenizer.ggml.eos_token_id"] == config["eos_token_id"]
        n = len(list(out.glob("*.gguf")))
        assert value["split.count"] == n and value["split.tensors.count"] == len(_tensors(out))


def test_verify_and_the_gguf_source_read_the_complete_model(model, outputs):
    for out in outputs.values():
        report = json.loads(_cli("verify", out, "--source", model, "--hashes", "--json"))
        assert report["ok"], report["problems"]
        back = open_source(out)
        assert back.input_format == "gguf" and back.info.moe_layers == (0, 1)
    planned = json.loads(_cli("plan", model, "--method", "llamafile", "--include-dense", "--ggml-type", "Q8_0",
                              "--split-max-size", "700K", "--json"))["cpu"]
    files = {p.name: p.stat().st_size for p in outputs["split"].iterdir() if p.suffix == ".gguf"}
    assert {f["path"]: f["bytes"] for f in planned["files"] if not f.get("approx")} == files


def test_families_llama_cpp_transforms_or_we_do_not_map_are_refused(tmp_path):
    from ktconvert.examples.tiny import make_tiny_model

    for arch, why in (("mixtral", "permutes the rows of llama-architecture attn_q / attn_k"),
                      ("deepseek_v3", "splits kv_b_proj"), ("glm4_moe", "its llama.cpp metadata is not mapped")):
        src = make_tiny_model(tmp_path / arch, arch, layers=2)
        out = tmp_path / f"out-{arch}"
        err = _cli("cpu", src, out, "--method", "llamafile", "--include-dense", code=2)
        assert err.count("\n") <= 1 and why in err, err
        assert not out.exists()
    err = _cli("cpu", make_tiny_model(tmp_path / "wl", "qwen3_moe", **SHAPE), tmp_path / "o", "--method",
               "llamafile", "--include-dense", code=3)
    assert "tokenizer.json is not a GPT-2 byte-level BPE tokenizer" in err and not (tmp_path / "o").exists()


def _llama_cpp_logits(gguf_path: Path, tokens: list[int]) -> np.ndarray | None:
    """llama.cpp's logits of `tokens` through llama-cpp-python (here, or KTCONVERT_LLAMA_PYTHON's interpreter);
    None where neither has it."""
    python = os.environ.get("KTCONVERT_LLAMA_PYTHON")
    if python is None:
        if importlib.util.find_spec("llama_cpp") is None:
            return None
        python = sys.executable
    proc = subprocess.run([python, "-c", LLAMA_SCRIPT, str(gguf_path), json.dumps(tokens)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.asarray(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("run", ["BF16", "Q8_0", "split"])
def test_llama_cpp_loads_it_and_agrees_with_transformers(model, outputs, run):
    first = sorted(outputs[run].glob("*.gguf"))[0]
    got = _llama_cpp_logits(first, TOKENS)
    if got is None:
        pytest.skip("llama-cpp-python is not importable (nor KTCONVERT_LLAMA_PYTHON set to an interpreter that "
                    "imports it)")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0].double().numpy()
    assert got.shape == want.shape
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"{run}: llama.cpp vs transformers logits rel L2 {rel:.4g}")
    assert rel < 0.05, rel

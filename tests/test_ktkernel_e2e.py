"""The whole `ktconvert cpu` run against the real kt-kernel 0.7.2, on tiny models of several families:

(a) kt-kernel quantizes each MoE layer of the same checkpoint itself (what its convert_cpu_weights.py does per
    layer: stack the BF16 experts, KTMoEWrapper(cpu_save=True).load_weights_from_tensors) and every file it writes
    equals ours byte for byte — `.kt` layout directly, merged layout tensor by tensor;
(b) kt-kernel loads our merged output (`--kt-weight-path OUT`) and its MoE forward matches a float reference built
    from the source weights quantized by the spec (its activations are int8-quantized: a few % relative L2).

Needs an AVX-512 CPU and kt-kernel (skipped elsewhere with the reason)."""
from __future__ import annotations

import numpy as np
import pytest

from ktkernel_util import (dequantized_experts, ktkernel_forward, ktkernel_skip_reason, ktkernel_write_kt,
                           rawint4_skip_reason, read_kt_tree, reference_moe_forward, relative_l2)

pytestmark = pytest.mark.ktkernel

CASES = [("qwen3_moe", "amxint4", 2), ("deepseek_v3", "amxint8", 2), ("mixtral", "amxint4", 1),
         ("qwen3_5_moe", "amxint8", 1), ("gpt_oss", "amxint4", 2)]


@pytest.fixture(autouse=True)
def _needs_ktkernel():
    reason = ktkernel_skip_reason("AMXINT4")
    if reason:
        pytest.skip(reason)


def _layer_experts(model, layer: int):
    from ktconvert.formats.hf_source import HFSource

    src = HFSource.open(model)
    experts = [src.read_expert(layer, e) for e in range(src.info.n_experts)]
    return {p: np.stack([getattr(x, p) for x in experts]) for p in ("gate", "up", "down")}, src.info


def _convert(model, out, method, numa, layout):
    from ktconvert.cpu.convert import convert_cpu

    convert_cpu(model, out, method=method, numa=numa, layout=layout, allow_drop_bias=True)


@pytest.mark.parametrize("family,method,numa", CASES)
def test_every_file_equals_ktkernels(tiny_model, tmp_path, family, method, numa):
    model = tiny_model(family)
    ours_kt, ours_st = tmp_path / "kt", tmp_path / "st"
    _convert(model, ours_kt, method, numa, "kt")
    _convert(model, ours_st, method, numa, "safetensors")
    from safetensors.numpy import load_file

    merged = {}
    for shard in ours_st.glob("model-*.safetensors"):
        merged.update(load_file(shard))
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.layouts.naming import key_for_kt_path

    theirs = tmp_path / "ktkernel"
    compared = 0
    for layer in HFSource.open(model).info.moe_layers:
        mats, _ = _layer_experts(model, layer)
        ktkernel_write_kt(theirs, method.upper(), mats["gate"], mats["up"], mats["down"], numa, layer_idx=layer)
    want = read_kt_tree(theirs)
    got = read_kt_tree(ours_kt)
    assert set(got) == set(want) and want
    for rel, data in want.items():
        assert got[rel] == data, f"{rel} differs from kt-kernel's"
        key = key_for_kt_path(rel)
        dtype = np.float32 if rel.endswith("_scale_.kt") else np.int8
        assert merged[key].tobytes() == np.frombuffer(data, dtype=dtype).tobytes(), key
        compared += len(data)
    assert compared > 0


@pytest.mark.parametrize("family,method,numa", CASES[:3])
def test_ktkernel_runs_our_merged_output(tiny_model, tmp_path, family, method, numa):
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

    model = tiny_model(family)
    out = tmp_path / "out"
    _convert(model, out, method, numa, "safetensors")
    info = HFSource.open(model).info
    layer = info.moe_layers[-1]
    mats, _ = _layer_experts(model, layer)
    rng = np.random.default_rng(3)
    tokens, top_k = 16, 2
    x = f32_to_bf16_bits(rng.standard_normal((tokens, info.hidden)).astype(np.float32))
    ids = np.stack([rng.choice(info.n_experts, top_k, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, top_k)).astype(np.float32)
    got = ktkernel_forward(out, method.upper(), num_experts=info.n_experts, hidden=info.hidden,
                           intermediate=info.intermediate, threadpool_count=numa, x_bf16=x, topk_ids=ids,
                           topk_weights=weights, layer_idx=layer)
    gate, up, down = dequantized_experts(method.upper(), mats["gate"], mats["up"], mats["down"], numa)
    ref = reference_moe_forward(bf16_bits_to_f32(x), ids, weights, gate, up, down)
    assert relative_l2(got, ref) < 0.05


RAWINT4_FORWARD = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from ktkernel_util import ktkernel_forward
x = np.load({x!r}); ids = np.load({ids!r}); w = np.load({w!r})
out = ktkernel_forward({path!r}, "RAWINT4", num_experts={E}, hidden={H}, intermediate={I}, threadpool_count=1,
                       x_bf16=x, topk_ids=ids, topk_weights=w, layer_idx={L})
np.save({dest!r}, out)
"""


def _rawint4_forward(path, info, layer, tmp_path, name):
    """kt-kernel's RAWINT4 forward in a child process (0.7.2 segfaults on some shapes, e.g. I = 128, even on
    llmcompressor's own files; a crash must fail this test, not kill the test run)."""
    import subprocess
    import sys
    from pathlib import Path

    from ktconvert.quant.bf16 import f32_to_bf16_bits

    rng = np.random.default_rng(7)
    files = {k: tmp_path / f"{name}-{k}.npy" for k in ("x", "ids", "w", "out")}
    np.save(files["x"], f32_to_bf16_bits(rng.standard_normal((8, info.hidden)).astype(np.float32)))
    np.save(files["ids"], np.stack([rng.choice(info.n_experts, 2, replace=False) for _ in range(8)]))
    np.save(files["w"], rng.random((8, 2)).astype(np.float32))
    code = RAWINT4_FORWARD.format(tests=str(Path(__file__).parent), x=str(files["x"]), ids=str(files["ids"]),
                                  w=str(files["w"]), path=str(path), E=info.n_experts, H=info.hidden,
                                  I=info.intermediate, L=layer, dest=str(files["out"]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, "KT_FORCE_SYNC_SUBMIT": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return np.load(files["out"])


@pytest.mark.slow
def test_ktkernel_rawint4_runs_ours_exactly_like_llmcompressors(tiny_model, tmp_path):
    """Our rawint4 output and llmcompressor's model_free_ptq W4A16 output of the same source give kt-kernel's
    RAWINT4 forward bit-identical results (a real third-party writer of the same format)."""
    if rawint4_skip_reason():
        pytest.skip(rawint4_skip_reason())
    from llmcompressor import model_free_ptq

    from ktconvert.formats.hf_source import HFSource
    from ktconvert.cpu.convert import convert_cpu

    model = tiny_model("deepseek_v3")
    info = HFSource.open(model).info
    ours, theirs = tmp_path / "ours", tmp_path / "llmc"
    convert_cpu(model, ours, method="rawint4", group_size=128)
    model_free_ptq(str(model), str(theirs), scheme="W4A16", device="cpu", max_workers=1,
                   ignore=["lm_head", r"re:.*mlp\.gate$", r"re:.*embed_tokens$", r"re:.*self_attn.*",
                           r"re:.*shared_experts.*", r"re:model\.layers\.0\.mlp.*"])
    layer = info.moe_layers[-1]
    got = _rawint4_forward(ours, info, layer, tmp_path, "ours")
    want = _rawint4_forward(theirs, info, layer, tmp_path, "llmc")
    assert np.isfinite(got).all() and np.array_equal(got, want)


@pytest.mark.parametrize("method,kt_method", [("bf16", "BF16"), ("fp8", "FP8"), ("rawint4", "RAWINT4")])
def test_ktkernel_native_methods_run_our_outputs(tiny_model, tmp_path, method, kt_method):
    """`ktconvert cpu --method bf16|fp8|rawint4` of a whole tiny model, loaded by kt-kernel's native backends: its
    forward matches a float reference built from the decoded output weights."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.formats.decoders import decode_matrix, detect_scheme
    from ktconvert.formats.safetensors_reader import Checkpoint
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.quant.bf16 import bf16_bits_to_f32

    if kt_method == "RAWINT4" and rawint4_skip_reason():
        pytest.skip(rawint4_skip_reason())
    model = tiny_model("deepseek_v3")
    info = HFSource.open(model).info
    out = tmp_path / method
    convert_cpu(model, out, method=method, group_size=128)
    layer = info.moe_layers[-1]
    if kt_method == "RAWINT4":
        got = _rawint4_forward(out, info, layer, tmp_path, method)
        x, ids, weights = (np.load(tmp_path / f"{method}-{k}.npy") for k in ("x", "ids", "w"))
    else:
        from ktconvert.quant.bf16 import f32_to_bf16_bits

        rng = np.random.default_rng(7)
        x = f32_to_bf16_bits(rng.standard_normal((8, info.hidden)).astype(np.float32))
        ids = np.stack([rng.choice(info.n_experts, 2, replace=False) for _ in range(8)])
        weights = rng.random((8, 2)).astype(np.float32)
        got = ktkernel_forward(out, kt_method, num_experts=info.n_experts, hidden=info.hidden,
                               intermediate=info.intermediate, threadpool_count=1, x_bf16=x, topk_ids=ids,
                               topk_weights=weights, layer_idx=layer)
    ck = Checkpoint.open(out)
    scheme = detect_scheme(ck.config)
    mats = {p: np.stack([bf16_bits_to_f32(decode_matrix(ck, f"model.layers.{layer}.mlp.experts.{e}.{p}_proj", scheme))
                         for e in range(info.n_experts)]) for p in ("gate", "up", "down")}
    want = reference_moe_forward(bf16_bits_to_f32(x), ids, weights, mats["gate"], mats["up"], mats["down"])
    assert relative_l2(got, want) < 0.05

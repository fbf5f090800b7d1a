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

from ktconvert.quant.bf16 import bf16_bits_to_f32

from ktkernel_util import (ct_decoded_experts, dequantized_experts, ktkernel_forward, ktkernel_skip_reason,
                           ktkernel_write_kt, native_skip_reason, rawint4_skip_reason, read_kt_tree,
                           reference_moe_forward, relative_l2)

pytestmark = pytest.mark.ktkernel

CASES = [("qwen3_moe", "amxint4", 2), ("deepseek_v3", "amxint8", 2), ("mixtral", "amxint4", 1),
         ("qwen3_5_moe", "amxint8", 1), ("gpt_oss", "amxint4", 2)]


@pytest.fixture
def needs_ktkernel_amx():
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


@pytest.mark.usefixtures("needs_ktkernel_amx")
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


@pytest.mark.usefixtures("needs_ktkernel_amx")
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


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "mixtral", "qwen3_5_moe", "gpt_oss"])
def test_ktkernel_rawint4_forward_matches_an_independent_decode(tiny_model, tmp_path, family):
    """`ktconvert cpu --method rawint4` (group 32, the default) of each family's tiny model: kt-kernel 0.7.2's RAWINT4
    forward on our files agrees with a float64 forward of the weights compressed-tensors' own decompressor reads
    from the same files within 2 % rel L2 (measured 0.013 on an AMX host)."""
    reason = rawint4_skip_reason()
    if reason:
        pytest.skip(reason)
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.formats.hf_source import HFSource

    model = tiny_model(family)
    info = HFSource.open(model).info
    out = tmp_path / "rawint4"
    convert_cpu(model, out, method="rawint4", allow_drop_bias=True)
    for layer in info.moe_layers:
        got, (x, ids, weights) = _native_forward(out, "RAWINT4", info, layer)
        want = reference_moe_forward(bf16_bits_to_f32(x), ids, weights, *ct_decoded_experts(out, layer, info.n_experts))
        err = relative_l2(got, want)
        assert np.isfinite(got).all() and err < 0.02, f"layer {layer}: kt-kernel vs decoded files rel L2 {err:.4g}"


def _native_forward(out, kt_method, info, layer):
    """kt-kernel's forward of one MoE layer of `out` on seeded BF16 activations, 8 tokens, top-2."""
    from ktconvert.quant.bf16 import f32_to_bf16_bits

    rng = np.random.default_rng(7)
    x = f32_to_bf16_bits(rng.standard_normal((8, info.hidden)).astype(np.float32))
    ids = np.stack([rng.choice(info.n_experts, 2, replace=False) for _ in range(8)])
    weights = rng.random((8, 2)).astype(np.float32)
    got = ktkernel_forward(out, kt_method, num_experts=info.n_experts, hidden=info.hidden,
                           intermediate=info.intermediate, threadpool_count=1, x_bf16=x, topk_ids=ids,
                           topk_weights=weights, layer_idx=layer)
    return got, (x, ids, weights)


@pytest.mark.parametrize("method,kt_method", [("bf16", "BF16"), ("fp8", "FP8"), ("rawint4", "RAWINT4")])
def test_ktkernel_native_methods_run_our_outputs(tiny_model, tmp_path, method, kt_method):
    """`ktconvert cpu --method bf16|fp8|rawint4` of a whole tiny model, loaded by kt-kernel's native backends: its
    forward matches a float reference built from the decoded output weights (RAWINT4: decoded by
    compressed-tensors, within 2 %)."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.formats.decoders import decode_matrix, detect_scheme
    from ktconvert.formats.safetensors_reader import Checkpoint
    from ktconvert.cpu.convert import convert_cpu

    reason = rawint4_skip_reason() if kt_method == "RAWINT4" else native_skip_reason(kt_method)
    if reason:
        pytest.skip(reason)
    model = tiny_model("deepseek_v3")
    info = HFSource.open(model).info
    out = tmp_path / method
    convert_cpu(model, out, method=method)
    layer = info.moe_layers[-1]
    got, (x, ids, weights) = _native_forward(out, kt_method, info, layer)
    if kt_method == "RAWINT4":
        mats = dict(zip(("gate", "up", "down"), ct_decoded_experts(out, layer, info.n_experts)))
    else:
        ck = Checkpoint.open(out)
        scheme = detect_scheme(ck.config)
        mats = {p: np.stack([bf16_bits_to_f32(decode_matrix(ck, f"model.layers.{layer}.mlp.experts.{e}.{p}_proj",
                                                            scheme)) for e in range(info.n_experts)])
                for p in ("gate", "up", "down")}
    want = reference_moe_forward(bf16_bits_to_f32(x), ids, weights, mats["gate"], mats["up"], mats["down"])
    assert relative_l2(got, want) < (0.02 if kt_method == "RAWINT4" else 0.05)

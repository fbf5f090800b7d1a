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
                           read_kt_tree, reference_moe_forward, relative_l2)

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
    from ktconvert.pipeline import convert_cpu

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
    from ktconvert.formats.kt_sink import key_for_kt_path

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

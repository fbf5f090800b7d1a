"""Issue 15: kt-kernel itself, fed a fused-expert checkpoint, gives the same bytes as ktconvert.

kt-kernel 0.7.2 reads fused experts where its own code accepts them: its HF loader (``kt_kernel.utils.loader.
BF16SafeTensorLoader``, "packed" format) takes ``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (first half gate)
+ ``down_proj`` [E, H, I] in BF16, as its convert_cpu_weights.py fused path does (out-major only; input-major and
separate gate/up/down 3-D tensors are not read by kt-kernel, so they are compared with ktconvert's per-expert
output in test_expert_layouts.py). Here kt-kernel loads each layer of the fused checkpoint with that loader and
quantizes it (KTMoEWrapper(cpu_save=True).load_weights_from_tensors, what its converter calls per layer); every
``.kt`` file must equal ktconvert's conversion of the same fused checkpoint byte for byte.
Needs an AVX-512 CPU and kt-kernel (skipped elsewhere with the reason)."""
from __future__ import annotations

import pytest

from ktkernel_util import ktkernel_load_experts, ktkernel_skip_reason, ktkernel_write_kt, read_kt_tree

pytestmark = pytest.mark.ktkernel


@pytest.fixture(autouse=True)
def _needs_ktkernel():
    reason = ktkernel_skip_reason("AMXINT4")
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("model_type,method,numa", [("qwen3_moe", "amxint4", 2), ("deepseek_v3", "amxint8", 1),
                                                    ("qwen3_5_moe", "amxint4", 2)])
def test_ktkernel_on_fused_checkpoint_equals_ours(tiny_model, tmp_path, model_type, method, numa):
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.examples.tiny_relayout import relayout

    model = tiny_model(model_type)
    fused = model if model_type == "qwen3_5_moe" else relayout(model, tmp_path / "fused", "fused", "out")
    src = HFSource.open(fused)
    assert src.required_layout(src.info.moe_layers[0]).kind == "fused" and src.kt_native_names()
    ours = tmp_path / "ours"
    convert_cpu(fused, ours, method=method, numa=numa, layout="kt", threads=2)
    theirs = tmp_path / "theirs"
    for layer in src.info.moe_layers:   # "model.layers.L": the loader tries "model.language_model.layers.L" itself
        mats = ktkernel_load_experts(fused, f"model.layers.{layer}")
        assert mats["gate"].shape == (src.info.n_experts, src.info.intermediate, src.info.hidden)
        ktkernel_write_kt(theirs, method.upper(), mats["gate"], mats["up"], mats["down"], numa, layer_idx=layer)
    want, got = read_kt_tree(theirs), read_kt_tree(ours)
    assert want and set(got) == set(want)
    for rel, data in want.items():
        assert got[rel] == data, f"{rel} differs from kt-kernel's"

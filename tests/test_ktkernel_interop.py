"""Interop with the real kt-kernel 0.7.2 (``pip install --no-deps kt-kernel==0.7.2``; needs AVX-512, not AMX).

(a) kt-kernel quantizes BF16 experts itself (the converter's online path) and writes its ``.kt`` files; every file
    must equal ktconvert's numpy quant + layout output byte for byte.
(b) kt-kernel loads ktconvert's files and runs its MoE forward; the output must match a float64 reference built from
    ktconvert's dequantized weights (kt-kernel quantizes activations to int8, so ~1-3 % relative L2 is expected).

Skipped, with the reason, where the CPU lacks AVX-512 or kt_kernel is not importable.
"""
from __future__ import annotations

import numpy as np
import pytest

from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from ktkernel_util import (adversarial_bf16, dequantized_experts, heavy_tailed_bf16, ktkernel_forward,
                           ktkernel_skip_reason, ktkernel_write_kt, numpy_kt_files, read_kt_tree,
                           reference_moe_forward, relative_l2, write_kt_files)

pytestmark = pytest.mark.ktkernel

METHODS = ["AMXINT4", "AMXINT8"]


@pytest.fixture(autouse=True)
def _needs_ktkernel(request, monkeypatch):
    method = request.node.callspec.params.get("method", "AMXINT4") if hasattr(request.node, "callspec") else "AMXINT4"
    reason = ktkernel_skip_reason(method)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("KTCONVERT_FORCE_IMPL", "numpy")   # compare the numpy reference path itself


def _layer(case: str, seed: int):
    """BF16 bits gate/up [E, I, H], down [E, H, I] for a named case."""
    rng = np.random.default_rng(seed)
    if case == "adversarial":        # E=3, H=256, I=256: every edge-case row kind in every matrix
        e, hidden, inter = 3, 256, 256
        make = lambda n, k: adversarial_bf16(rng, n, k)  # noqa: E731
    elif case == "ktail":            # H=3712 = 3584 + 128: K-block tail for gate/up, 29-58 N-blocks for down
        e, hidden, inter = 2, 3712, 256
        make = lambda n, k: np.where(rng.random((n, 1)) < 0.25, adversarial_bf16(rng, n, k),  # noqa: E731
                                     heavy_tailed_bf16(rng, (n, k)))
    else:                            # "heavy": Gaussian with 1 % 12-sigma outliers, several N-blocks
        e, hidden, inter = (4, 512, 512) if case == "heavy" else (2, 3712, 256)     # "heavy_ktail"
        make = lambda n, k: heavy_tailed_bf16(rng, (n, k))  # noqa: E731
    gate = np.stack([make(inter, hidden) for _ in range(e)])
    up = np.stack([make(inter, hidden) for _ in range(e)])
    down = np.stack([make(hidden, inter) for _ in range(e)])
    return gate, up, down


@pytest.mark.parametrize("case", ["adversarial", "ktail", "heavy"])
@pytest.mark.parametrize("threadpool_count", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_kt_files_byte_identical_to_ktkernel(method, threadpool_count, case, tmp_path):
    gate, up, down = _layer(case, seed=threadpool_count)
    layer_dir = ktkernel_write_kt(tmp_path / "kt", method, gate, up, down, threadpool_count, layer_idx=3)
    theirs = read_kt_tree(layer_dir)
    ours = numpy_kt_files(method, gate, up, down, threadpool_count)
    assert sorted(theirs) == sorted(ours)
    assert len(ours) == gate.shape[0] * 3 * 2 * threadpool_count
    differing = [name for name in ours if ours[name] != theirs[name]]
    assert not differing, f"{len(differing)} of {len(ours)} files differ, first {differing[0]}"


@pytest.mark.parametrize("case", ["heavy", "heavy_ktail"])   # finite outputs: no bf16-max rows here
@pytest.mark.parametrize("threadpool_count", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_ktkernel_forward_on_ktconvert_files(method, threadpool_count, case, tmp_path):
    gate, up, down = _layer(case, seed=10 + threadpool_count)
    experts, inter, hidden = gate.shape
    weight_path = write_kt_files(tmp_path / "ours", 0, numpy_kt_files(method, gate, up, down, threadpool_count))
    rng = np.random.default_rng(5)
    tokens, top_k = 16, 2
    x = f32_to_bf16_bits(rng.standard_normal((tokens, hidden)).astype(np.float32))
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, top_k)).astype(np.float32)

    got = ktkernel_forward(weight_path, method, num_experts=experts, hidden=hidden, intermediate=inter,
                           threadpool_count=threadpool_count, x_bf16=x, topk_ids=ids, topk_weights=weights)
    want = reference_moe_forward(bf16_bits_to_f32(x), ids, weights,
                                 *dequantized_experts(method, gate, up, down, threadpool_count))
    assert got.shape == (tokens, hidden) and np.isfinite(got).all()
    err = relative_l2(got, want)
    assert err < 0.05, f"kt-kernel forward vs dequantized reference: relative L2 {err:.4f}"

"""ggml quantizers (ktconvert.quant.ggml_quant) against llama.cpp's own bytes.

Golden values, none from our code:
* tests/golden/gguf/tiny-qwen3moe-*.gguf (SOURCES.json): ``llama_model_quantize`` (llama-cpp-python
  0.3.36) of an F16 GGUF that make_fixtures.write_moe_gguf regenerates here from its seed; every tensor of a type
  we write (Q4_K, Q5_K, Q6_K: experts, attention, embeddings, output) must come out byte for byte.
* tests/golden/gguf/ggml-quantize-cases.gguf: ``ggml_quantize_chunk`` of the same llama.cpp (libggml-base, see
  make_ggml_quant_fixture.py) on hand-picked rows, for all seven types (Q8_0, Q4_0, BF16, F16 included).
* gguf-py's ``dequantize`` (an independent decoder) for round-trip error bounds.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ktconvert.errors import NumericError, ShapeError  # noqa: E402
from ktconvert.quant import ggml_quant as gq  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "gguf"
LLAMA_FIXTURES = sorted(json.loads((GOLDEN / "SOURCES.json").read_text()))   # llama_model_quantize outputs


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"golden_{name}", GOLDEN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def f16_source(tmp_path_factory) -> dict[str, np.ndarray]:
    """{tensor name: float32 values} of the F16 GGUF the llama.cpp fixtures were quantized from."""
    fixtures = _load("make_fixtures")
    path = tmp_path_factory.mktemp("f16") / "tiny-qwen3moe-F16.gguf"
    fixtures.write_moe_gguf(path, **fixtures.TINY)
    return {t.name: np.asarray(t.data).astype(np.float32) for t in gguf.GGUFReader(path).tensors}


def _bad_blocks(ours: np.ndarray, ref: np.ndarray, block_bytes: int) -> np.ndarray:
    return (ours.reshape(-1, block_bytes) != ref.reshape(-1, block_bytes)).any(axis=1)


def test_k_quants_equal_llama_model_quantize(f16_source):
    """Every Q4_K / Q5_K / Q6_K tensor llama.cpp wrote in the fixtures, requantized here from the same F16 values."""
    blocks = {"Q4_K": 0, "Q5_K": 0, "Q6_K": 0}
    for fixture in LLAMA_FIXTURES:
        for t in gguf.GGUFReader(GOLDEN / fixture).tensors:
            kind = t.tensor_type.name
            if kind not in blocks:
                continue
            x = f16_source[t.name]
            ours = gq.quantize(x.reshape(-1, x.shape[-1]), kind)
            ref = np.asarray(t.data).view(np.uint8).reshape(ours.shape)
            bad = _bad_blocks(ours, ref, gq.BLOCKS[kind][1])
            assert not bad.any(), f"{fixture} {t.name} {kind}: {int(bad.sum())} of {bad.size} blocks differ, " \
                                  f"first {int(np.argmax(bad))}"
            blocks[kind] += bad.size
    assert blocks == {"Q4_K": 5536, "Q5_K": 4256, "Q6_K": 6112}, blocks    # what the fixtures hold


@pytest.fixture(scope="module")
def cases():
    reader = gguf.GGUFReader(GOLDEN / "ggml-quantize-cases.gguf")
    return {t.name: t for t in reader.tensors}


def test_cases_fixture_rows_are_regenerated(cases):
    x = _load("make_ggml_quant_fixture").cases()
    assert np.array_equal(np.asarray(cases["cases"].data), x)
    assert x.shape == (43, 512)


@pytest.mark.parametrize("kind", gq.TYPES)
def test_every_type_equals_ggml_quantize_chunk(cases, kind):
    """Zero, constant, one-signed, spiky, tiny (fp16-subnormal scales), huge, BF16-valued, half-integer rows and
    sub-blocks of very different size, quantized by libggml: byte for byte."""
    x = np.asarray(cases["cases"].data)
    ref = np.asarray(cases[f"q.{kind}"].data).view(np.uint8).reshape(x.shape[0], -1)
    assert cases[f"q.{kind}"].tensor_type.name == kind
    ours = gq.quantize(x, kind)
    assert ours.shape == ref.shape == (x.shape[0], gq.row_bytes(kind, x.shape[1]))
    bad = _bad_blocks(ours, ref, gq.BLOCKS[kind][1])
    assert np.array_equal(gq.quantize(x, kind, impl="numpy"), ref)      # the numpy / gguf-py path too
    assert not bad.any(), f"{kind}: {int(bad.sum())} of {bad.size} blocks differ, rows " \
                          f"{sorted(set(np.nonzero(bad)[0] * gq.BLOCKS[kind][0] // 512))}"


def test_q4_0_all_zero_block_keeps_llama_cpp_sign():
    """llama.cpp stores d = -0.0 for an all-zero Q4_0 block, also when its first value is -0.0 (gguf-py: +0.0)."""
    x = np.full((1, 32), -0.0, np.float32)
    assert gq.quantize(x, "Q4_0")[0, :2].tolist() == [0x00, 0x80]
    assert gq.quantize(np.zeros((1, 32), np.float32), "Q4_0")[0, :2].tolist() == [0x00, 0x80]


def _gaussian(rows: int = 64, k: int = 1024, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32) * np.float32(0.02)
    w[rng.random(w.shape) < 0.002] *= 8
    return w


# relative L2 error of a round trip on Gaussian weights with outliers (measured: F16 2.1e-4, BF16 1.6e-3,
# Q8_0 6.4e-3, Q6_K 0.020, Q5_K 0.039, Q4_K 0.077, Q4_0 0.103): each bound ~1.3x its measurement
REL_L2 = {"F16": 3e-4, "BF16": 2.5e-3, "Q8_0": 0.009, "Q6_K": 0.026, "Q5_K": 0.05, "Q4_K": 0.1, "Q4_0": 0.13}


@pytest.mark.parametrize("kind", gq.TYPES)
def test_round_trip_through_gguf_py_dequantize(kind):
    w = _gaussian()
    raw = gq.quantize(w, kind)
    back = gq.dequantize(raw, kind, w.shape[1])
    rel = float(np.linalg.norm(back - w) / np.linalg.norm(w))
    assert rel < REL_L2[kind], rel
    assert rel > REL_L2[kind] / 3       # not a pass-through: a type's error is what its bits allow


@pytest.mark.parametrize("kind, codes", [("Q8_0", 127), ("Q4_0", 8)])
def test_block_scale_types_round_to_nearest(kind, codes):
    """Q8_0: |w - w'| <= d/2 per value; Q4_0 (d = max / -8, codes clipped at 15): <= |d|, with d the stored fp16."""
    w = _gaussian(16, 256)
    raw = gq.quantize(w, kind).reshape(-1, gq.BLOCKS[kind][1])
    d = np.abs(raw[:, :2].copy().view(np.float16).astype(np.float32))
    err = np.abs(gq.dequantize(raw.reshape(16, -1), kind, 256) - w).reshape(-1, 32).max(axis=1)
    limit = d[:, 0] * (0.5 if kind == "Q8_0" else 1.0) + d[:, 0] * 2 ** -10 * codes   # + the fp16 rounding of d
    assert (err <= limit).all()


def test_chunking_does_not_change_bytes(monkeypatch):
    w = _gaussian(8, 1024)
    whole = {k: gq.quantize(w, k, impl="numpy") for k in ("Q4_K", "Q5_K", "Q6_K")}
    monkeypatch.setattr(gq, "CHUNK", 3)
    for kind, raw in whole.items():
        assert np.array_equal(gq.quantize(w, kind, impl="numpy"), raw)


def test_bad_input_names_the_tensor():
    w = _gaussian(2, 256)
    w[1, 7] = np.nan
    with pytest.raises(NumericError, match="NaN or Inf") as e:
        gq.quantize(w, "Q4_K", where="blk.3.ffn_up_exps.weight[5]")
    assert "blk.3.ffn_up_exps.weight[5]" in str(e.value)
    with pytest.raises(ShapeError, match="whole number of Q6_K blocks") as e:
        gq.quantize(np.zeros((2, 320), np.float32), "Q6_K", where="blk.0.ffn_down_exps.weight[0]")
    assert "blk.0.ffn_down_exps.weight[0]" in str(e.value)
    with pytest.raises(ShapeError, match="no quantizer"):
        gq.row_bytes("Q2_K", 256)


def test_sizes_are_gguf_py_geometry():
    from gguf.constants import GGML_QUANT_SIZES

    for kind in gq.TYPES:
        assert gq.BLOCKS[kind] == GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        assert gq.row_bytes(kind, 2048) == 2048 // gq.BLOCKS[kind][0] * gq.BLOCKS[kind][1]


def _native_impls() -> list[str]:
    from ktconvert import native
    from ktconvert.native import ggml_quant as native_ggml

    return native.usable_impls() if native_ggml.supports("Q4_K") else []


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"])
def test_native_quantizer_equals_llama_cpp_and_numpy(cases, kind):
    """native/ggml_quant.c, every implementation this CPU runs, threaded: the fixture's ggml bytes and the numpy
    (gguf-py for Q8_0 / Q4_0) path's bytes on rows whose sub-blocks span 13 orders of magnitude."""
    impls = _native_impls()
    if not impls:
        pytest.skip("the native library has no ggml quantizer (not built, or built before native/ggml_quant.c)")
    x = np.asarray(cases["cases"].data)
    ref = np.asarray(cases[f"q.{kind}"].data).view(np.uint8).reshape(x.shape[0], -1)
    rng = np.random.default_rng(3)
    y = rng.standard_normal((64, 2048)) * np.exp(rng.uniform(-20, 10, (64, 64, 1))).repeat(32, 2).reshape(64, 2048)
    y = y.astype(np.float32)
    want = gq.quantize(y, kind, impl="numpy")
    for impl in impls:
        assert np.array_equal(gq.quantize(x, kind, impl=impl), ref), impl
        assert np.array_equal(gq.quantize(y, kind, impl=impl, threads=3), want), impl

"""gpt-oss MXFP4 inputs: expected values derived here from the E2M1 definition and the E8M0 exponents."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ktconvert.errors import InputError
from ktconvert.formats.decoders import decode_matrix, detect_scheme, validate_matrix
from ktconvert.formats.safetensors_reader import Checkpoint

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def _e2m1(code: int) -> float:
    """E2M1 by definition: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def _expected(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 [n, G, 16] + [n, G] -> BF16 bits [n, 32G], element by element."""
    n, groups, _ = blocks.shape
    out = np.empty((n, groups * 32), dtype=np.float64)
    for r in range(n):
        for gi in range(groups):
            for j in range(16):
                byte = int(blocks[r, gi, j])
                for half, code in ((0, byte & 0xF), (1, byte >> 4)):
                    out[r, gi * 32 + 2 * j + half] = _e2m1(code) * 2.0 ** (int(scales[r, gi]) - 127)
    return torch.from_numpy(out).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _hub_checkpoint(path, experts=2, rows=8, k=64, seed=0):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (experts, rows, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (experts, rows, k // 32), dtype=np.uint8)
    scales[0, 0, 0], scales[0, 1, 0] = 1, 254        # extreme exponents (2^-126 and 2^127)
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file({GATE_UP + "_blocks": torch.from_numpy(blocks), GATE_UP + "_scales": torch.from_numpy(scales)},
                       str(path / "model.safetensors"))
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    (path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config": qc}))
    return blocks, scales


def test_fused_mxfp4_expert_matches_definition(tmp_path):
    blocks, scales = _hub_checkpoint(tmp_path)
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    assert scheme.input_format == "mxfp4"
    for e in range(2):
        validate_matrix(ck, GATE_UP, scheme, (8, 64), expert=e)
        np.testing.assert_array_equal(decode_matrix(ck, GATE_UP, scheme, e), _expected(blocks[e], scales[e]))


def test_raw_bytes_path_equals_read_path(tmp_path):
    blocks, _ = _hub_checkpoint(tmp_path, seed=3)
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    raw = blocks[1].reshape(-1).copy()
    np.testing.assert_array_equal(decode_matrix(ck, GATE_UP, scheme, 1, raw=raw), decode_matrix(ck, GATE_UP, scheme, 1))


def test_bad_scales_shape_is_input_error(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    st_torch.save_file({GATE_UP + "_blocks": torch.zeros(2, 8, 2, 16, dtype=torch.uint8),
                        GATE_UP + "_scales": torch.zeros(2, 8, 3, dtype=torch.uint8)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    ck = Checkpoint.open(tmp_path)
    with pytest.raises(InputError) as exc:
        validate_matrix(ck, GATE_UP, detect_scheme(ck.config), (8, 64), expert=0)
    assert "model.safetensors" in str(exc.value) and GATE_UP + "_blocks" in str(exc.value)


def test_hfsource_reads_tiny_gpt_oss_mxfp4(tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the mxfp4 writer)
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.examples.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "m", "gpt_oss", layers=1, experts=2, hidden=64, intermediate=64,
                          dtype="mxfp4", seed=5)
    src = HFSource.open(out)
    assert src.input_format == "mxfp4"
    src.validate()
    layer = src.info.moe_layers[0]
    ew = src.read_expert(layer, 1)
    ck = Checkpoint.open(out)
    names = src.info.fused_names(layer)
    gu = _expected(ck.read_slice(names["gate_up"] + "_blocks", 1), ck.read_slice(names["gate_up"] + "_scales", 1))
    np.testing.assert_array_equal(ew.gate, gu[0::2])     # gpt-oss: even rows gate, odd rows up
    np.testing.assert_array_equal(ew.up, gu[1::2])
    down = _expected(ck.read_slice(names["down"] + "_blocks", 1), ck.read_slice(names["down"] + "_scales", 1))
    np.testing.assert_array_equal(ew.down, down)
    assert ew.gate_bias is not None and ew.gate_bias.shape == (64,)

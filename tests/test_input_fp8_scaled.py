"""Per-channel / per-tensor FP8 and MXFP8 inputs (issue 27 item 2) decode bit for bit:

* per-channel (``quant_method: fbgemm_fp8``, ``quant_method: fp8`` without ``weight_block_size``) and per-tensor
  (``fp8`` static, ModelOpt ``quant_algo: FP8``): against torch's own float8_e4m3fn times the row's (or the
  tensor's) scale in float32, rounded to BF16 by torch;
* MXFP8 (MiniMax-style ``quant_method: mxfp8`` with ``weight_scale_inv`` bytes, compressed-tensors
  ``mxfp8-quantized``): against compressed-tensors' MXFP8QuantizationCompressor and against e4m3 * 2^(e - 127)
  written here; the "_inv" scale multiplies;
* tiny checkpoints (``--dtype fp8-channel`` / ``mxfp8``) convert with ``cpu --method amxint4``, pass ``verify``,
  are named by ``inspect``, and their quantized attention is decoded by ``gpu``; malformed scales exit 3.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ktconvert.errors import InputError
from ktconvert.formats.decoders import decode_matrix, detect_scheme, validate_matrix
from ktconvert.formats.safetensors_reader import Checkpoint
from test_input_gptq import _run, edited, gpu_checkpoint_decodes_quantized_linears, one_line_error

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
BASE = "model.layers.0.mlp.experts.3.up_proj"
FUSED = "model.layers.0.mlp.experts.down_proj"


def _bits(t) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _codes(rng, shape) -> torch.Tensor:
    """Random e4m3 codes without the two NaN codes, as torch float8_e4m3fn."""
    c = rng.integers(0, 256, shape, dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] = 0x3C
    return torch.from_numpy(c).view(torch.float8_e4m3fn)


def _save(path, tensors: dict, qc: dict) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": qc}))
    return Checkpoint.open(path)


CHANNEL_CONFIGS = {"fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
                   "fp8-static": {"quant_method": "fp8", "activation_scheme": "static"},
                   "modelopt": {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}}


@pytest.mark.parametrize("config", list(CHANNEL_CONFIGS))
@pytest.mark.parametrize("shape,dtype", [((40, 1), torch.float32), ((40,), torch.bfloat16), ((1,), torch.float32),
                                         ((), torch.float32)])
def test_per_channel_and_per_tensor_scales(tmp_path, config, shape, dtype):
    rng = np.random.default_rng(len(shape) + len(config))
    w = _codes(rng, (40, 96))
    scale = torch.from_numpy(rng.uniform(1e-5, 1e-2, shape).astype(np.float32)).to(dtype)
    tensors = {f"{BASE}.weight": w, f"{BASE}.weight_scale": scale, f"{BASE}.input_scale": torch.tensor(0.5)}
    ck = _save(tmp_path, tensors, CHANNEL_CONFIGS[config])
    scheme = detect_scheme(ck.config)
    refs = validate_matrix(ck, BASE, scheme, (40, 96))
    assert "unused_input_scale" in refs.partners          # carried with the matrix, not read
    want = _bits(w.float() * (scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float()))
    np.testing.assert_array_equal(decode_matrix(ck, BASE, scheme), want)


def test_fused_per_channel_slices(tmp_path):
    rng = np.random.default_rng(4)
    w = _codes(rng, (3, 24, 64))
    scale = torch.from_numpy(rng.uniform(1e-4, 1e-2, (3, 24, 1)).astype(np.float32))
    ck = _save(tmp_path, {f"{FUSED}.weight": w, f"{FUSED}.weight_scale": scale}, CHANNEL_CONFIGS["fbgemm"])
    scheme = detect_scheme(ck.config)
    for e in range(3):
        np.testing.assert_array_equal(decode_matrix(ck, FUSED, scheme, e), _bits(w[e].float() * scale[e]))


def test_malformed_channel_scale_is_refused(tmp_path):
    rng = np.random.default_rng(5)
    ck = _save(tmp_path, {f"{BASE}.weight": _codes(rng, (40, 96)), f"{BASE}.weight_scale": torch.ones(40, 2)},
               CHANNEL_CONFIGS["fbgemm"])
    with pytest.raises(InputError, match=rf"model.safetensors: {BASE}.weight_scale: .*neither per-channel"):
        decode_matrix(ck, BASE, detect_scheme(ck.config))


# ---------------------------------------------------------------- MXFP8

def _mx_reference(w: torch.Tensor, exps: np.ndarray) -> np.ndarray:
    """e4m3 * 2^(e - 127) per 32 in-features, float32, to BF16 (torch)."""
    scale = torch.from_numpy(np.ldexp(np.float32(1), exps.astype(np.int32) - 127).astype(np.float32))
    return _bits(w.float() * scale.repeat_interleave(32, dim=1)[:, : w.shape[1]])


@pytest.mark.parametrize("qc,scale_name", [
    ({"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32]}, "weight_scale_inv"),
    ({"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["lm_head"]}, "weight_scale"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [1, 32]}, "weight_scale_inv"),
    ({"quant_method": "compressed-tensors", "format": "mxfp8-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32,
                                           "scale_dtype": "torch.uint8"}}}}, "weight_scale"),
])
def test_mxfp8_matches_compressed_tensors_and_the_definition(tmp_path, qc, scale_name):
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP8A16

    rng = np.random.default_rng(6)
    w = _codes(rng, (24, 128))
    exps = rng.integers(90, 160, (24, 4), dtype=np.uint8)
    exps[0, :2] = (1, 254)                              # 2^-126 and 2^127 scales
    ck = _save(tmp_path, {f"{BASE}.weight": w, f"{BASE}.{scale_name}": torch.from_numpy(exps)}, qc)
    scheme = detect_scheme(ck.config)
    assert validate_matrix(ck, BASE, scheme, (24, 128)).kind == "mxfp8"
    got = decode_matrix(ck, BASE, scheme)
    np.testing.assert_array_equal(got, _mx_reference(w, exps))
    library = MXFP8QuantizationCompressor.decompress({"weight": w, "weight_scale": torch.from_numpy(exps)},
                                                     QuantizationScheme(targets=["Linear"], **MXFP8A16))["weight"]
    np.testing.assert_array_equal(got, _bits(library))


def test_mxfp8_scale_shape_and_dtype_are_checked(tmp_path):
    rng = np.random.default_rng(7)
    qc = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    w = _codes(rng, (24, 128))
    short = torch.zeros(24, 2, dtype=torch.uint8)
    bad = _save(tmp_path / "shape", {f"{BASE}.weight": w, f"{BASE}.weight_scale_inv": short}, qc)
    with pytest.raises(InputError, match=rf"{BASE}.weight_scale_inv: MXFP8 scale does not match"):
        decode_matrix(bad, BASE, detect_scheme(bad.config))
    bad = _save(tmp_path / "dtype", {f"{BASE}.weight": w, f"{BASE}.weight_scale_inv": torch.ones(24, 4)}, qc)
    with pytest.raises(InputError, match=rf"{BASE}.weight_scale_inv: MXFP8 scale has the wrong dtype"):
        decode_matrix(bad, BASE, detect_scheme(bad.config))


# ---------------------------------------------------------------- tiny checkpoints, end to end

@pytest.mark.parametrize("dtype,fmt", [("fp8-channel", "fp8-channel"), ("mxfp8", "mxfp8")])
def test_tiny_checkpoint_converts_verifies_and_decodes_attention(tiny_model, tmp_path, dtype, fmt):
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the writers)

    src = tiny_model("qwen3_moe", dtype=dtype)
    ck = Checkpoint.open(src)
    scheme = detect_scheme(ck.config)
    base = "model.layers.1.mlp.experts.2.down_proj"
    w = torch.from_numpy(ck.read(f"{base}.weight")).view(torch.float8_e4m3fn)
    if dtype == "mxfp8":
        want = _mx_reference(w, ck.read(f"{base}.weight_scale_inv"))
    else:
        want = _bits(w.float() * torch.from_numpy(ck.read(f"{base}.weight_scale")))
    np.testing.assert_array_equal(decode_matrix(ck, base, scheme), want)
    inspected = _run("inspect", src)
    assert inspected.exit_code == 0 and f"input format       {fmt}" in inspected.output, inspected.output
    result = _run("cpu", src, tmp_path / "out", "--method", "amxint4", "--quiet")
    assert result.exit_code == 0, result.output
    result = _run("verify", tmp_path / "out", "--source", src)
    assert result.exit_code == 0, result.output
    if dtype == "mxfp8":
        gpu_checkpoint_decodes_quantized_linears(src, tmp_path / "gpu", "bf16", suffixes=("weight_scale_inv",))
        shard = ck.tensors[f"{base}.weight"].file.name
        scale = ck.read(f"{base}.weight_scale_inv")
        model = edited(src, tmp_path / "bad", {f"{base}.weight_scale_inv": (scale[:, :-1].copy(), "U8")})
        one_line_error(_run("cpu", model, tmp_path / "out-bad", "--method", "amxint4", "--quiet"),
                       f"{shard}: {base}.weight_scale_inv", "MXFP8 scale does not match")

"""FP4 (E2M1) inputs (issue 27 item 2) decode bit for bit:

* compressed-tensors ``nvfp4-pack-quantized`` (``weight_packed`` + E4M3 ``weight_scale`` per 16 +
  ``weight_global_scale``, a divisor) and ``mxfp4-pack-quantized`` (E8M0 ``weight_scale`` per 32): against
  compressed-tensors' own NVFP4PackedCompressor / MXFP4PackedCompressor;
* ModelOpt NVFP4 (``quant_method: modelopt``, ``quant_algo: NVFP4``: ``weight`` U8 + ``weight_scale`` E4M3 +
  ``weight_scale_2``, a multiplier): against e2m1 * (e4m3 * ws2) written here from the definitions (E2M1 from its
  bit fields, E4M3 by torch), and, with a power-of-two ws2, against compressed-tensors' ModelOpt converter followed
  by its decompressor (1 / ws2 is exact there, so both conventions must give the same bits);
* tiny ``--dtype nvfp4`` checkpoints convert with ``cpu --method amxint4``, pass ``verify``, are named by
  ``inspect``, their attention is decoded by ``gpu``; malformed scales exit 3 naming file and tensor.
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
BASE = "model.layers.0.mlp.experts.5.gate_proj"
FUSED = "model.layers.0.mlp.experts.gate_up_proj"
MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}


def _bits(t) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def _fp4_values(packed: np.ndarray) -> torch.Tensor:
    """uint8 [n, k/2] -> float32 [n, k]: byte j holds element 2j (low nibble) and 2j+1 (high nibble)."""
    table = np.array([_e2m1(c) for c in range(16)], dtype=np.float32)
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.float32)
    out[:, 0::2], out[:, 1::2] = table[packed & 15], table[packed >> 4]
    return torch.from_numpy(out)


def _e4m3(rng, shape, lo=0x08, hi=0x7E) -> torch.Tensor:
    """Random positive e4m3 block scales (no NaN), as float8_e4m3fn."""
    return torch.from_numpy(rng.integers(lo, hi, shape, dtype=np.uint8)).view(torch.float8_e4m3fn)


def _save(path, tensors: dict, qc: dict) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": qc}))
    return Checkpoint.open(path)


def _ct(fmt: str, group: int, strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "config_groups": {"g": {
        "targets": ["Linear"], "format": fmt, "weights": {"num_bits": 4, "type": "float", "strategy": strategy,
                                                          "group_size": group, "symmetric": True}}}}


def test_ct_nvfp4_matches_compressed_tensors(tmp_path):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    rng = np.random.default_rng(0)
    t = {"weight_packed": torch.from_numpy(rng.integers(0, 256, (24, 48), dtype=np.uint8)),
         "weight_scale": _e4m3(rng, (24, 6)), "weight_global_scale": torch.tensor([1234.567], dtype=torch.float32)}
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _ct("nvfp4-pack-quantized", 16, "tensor_group"))
    scheme = detect_scheme(ck.config)
    assert scheme.input_format == "ct-nvfp4"
    validate_matrix(ck, BASE, scheme, (24, 96))
    library = NVFP4PackedCompressor.decompress(dict(t), QuantizationScheme(targets=["Linear"], **NVFP4A16))
    np.testing.assert_array_equal(decode_matrix(ck, BASE, scheme), _bits(library["weight"]))


def test_ct_mxfp4_matches_compressed_tensors(tmp_path):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16

    rng = np.random.default_rng(1)
    t = {"weight_packed": torch.from_numpy(rng.integers(0, 256, (16, 64), dtype=np.uint8)),
         "weight_scale": torch.from_numpy(rng.integers(100, 150, (16, 4), dtype=np.uint8))}
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _ct("mxfp4-pack-quantized", 32, "group"))
    scheme = detect_scheme(ck.config)
    assert scheme.input_format == "ct-mxfp4"
    library = MXFP4PackedCompressor.decompress(dict(t), QuantizationScheme(targets=["Linear"], **MXFP4A16))
    np.testing.assert_array_equal(decode_matrix(ck, BASE, scheme), _bits(library["weight"]))


def _modelopt_tensors(rng, n, k, ws2: float) -> dict:
    return {"weight": torch.from_numpy(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)),
            "weight_scale": _e4m3(rng, (n, k // 16)), "weight_scale_2": torch.tensor(ws2, dtype=torch.float32),
            "input_scale": torch.tensor(0.25, dtype=torch.float32)}


def _modelopt_reference(t: dict) -> np.ndarray:
    scale = t["weight_scale"].float() * t["weight_scale_2"]            # float32 block scales
    return _bits(_fp4_values(t["weight"].numpy()) * scale.repeat_interleave(16, dim=1))


@pytest.mark.parametrize("ws2", [3.7e-4, 2.0 ** -12])
def test_modelopt_nvfp4_matches_the_definition(tmp_path, ws2):
    rng = np.random.default_rng(2)
    t = _modelopt_tensors(rng, 24, 128, ws2)
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, MODELOPT)
    scheme = detect_scheme(ck.config)
    refs = validate_matrix(ck, BASE, scheme, (24, 128))
    assert scheme.input_format == "nvfp4" and refs.partners["unused"] == f"{BASE}.input_scale"
    got = decode_matrix(ck, BASE, scheme)
    np.testing.assert_array_equal(got, _modelopt_reference(t))
    if ws2 == 2.0 ** -12:      # compressed-tensors' converter stores 1 / ws2, exact for a power of two
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
        from compressed_tensors.quantization import QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4A16

        ct = ModelOptNvfp4Converter(targets=["re:.*"]).process({f"m.{s}": v.clone() for s, v in t.items()})
        comp = {s: ct[f"m.{s}"].reshape(1) if s == "weight_global_scale" else ct[f"m.{s}"]
                for s in ("weight_packed", "weight_scale", "weight_global_scale")}
        library = NVFP4PackedCompressor.decompress(comp, QuantizationScheme(targets=["Linear"], **NVFP4A16))
        np.testing.assert_array_equal(got, _bits(library["weight"]))


def test_modelopt_nvfp4_fused_slices(tmp_path):
    rng = np.random.default_rng(3)
    parts = [_modelopt_tensors(rng, 16, 64, 1e-3 * (e + 1)) for e in range(3)]
    tensors = {f"{FUSED}.{s}": torch.stack([p[s] for p in parts]) for s in parts[0]}
    ck = _save(tmp_path, tensors, MODELOPT)
    scheme = detect_scheme(ck.config)
    for e, p in enumerate(parts):
        np.testing.assert_array_equal(decode_matrix(ck, FUSED, scheme, e), _modelopt_reference(p))


@pytest.mark.parametrize("qc, message", [
    ({"quant_algo": "W4A8_AWQ"}, "unsupported ModelOpt quant_algo"), ({"group_size": 32}, "NVFP4 group_size"),
])
def test_unreadable_modelopt_configs_are_refused(qc, message):
    with pytest.raises(InputError, match=rf"config.json: quantization_config: .*{message}"):
        detect_scheme({"quantization_config": {**MODELOPT, **qc}})


def test_tiny_checkpoint_converts_verifies_and_decodes_attention(tiny_model, tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the nvfp4 writer)

    src = tiny_model("qwen3_moe", dtype="nvfp4")
    ck = Checkpoint.open(src)
    base = "model.layers.1.mlp.experts.6.up_proj"
    stored = {s: torch.from_numpy(ck.read(f"{base}.{s}")) for s in ("weight", "weight_scale", "weight_scale_2")}
    stored["weight_scale"] = stored["weight_scale"].view(torch.float8_e4m3fn)
    np.testing.assert_array_equal(decode_matrix(ck, base, detect_scheme(ck.config)), _modelopt_reference(stored))
    inspected = _run("inspect", src)
    assert inspected.exit_code == 0 and "input format       nvfp4" in inspected.output, inspected.output
    result = _run("cpu", src, tmp_path / "out", "--method", "amxint4", "--quiet")
    assert result.exit_code == 0, result.output
    result = _run("verify", tmp_path / "out", "--source", src)
    assert result.exit_code == 0, result.output
    gpu_checkpoint_decodes_quantized_linears(src, tmp_path / "gpu", "bf16", ("weight_scale_2", "weight_scale"))
    shard = ck.tensors[f"{base}.weight"].file.name
    scale = ck.read(f"{base}.weight_scale")
    for what, changes, message in (
            ("dtype", {f"{base}.weight_scale": (scale.astype(np.float32), "F32")}, "wrong dtype"),
            ("shape", {f"{base}.weight_scale": (scale[:, :-1].copy(), "F8_E4M3")}, "do not match")):
        model = edited(src, tmp_path / what, changes)
        one_line_error(_run("cpu", model, tmp_path / f"out-{what}", "--method", "amxint4", "--quiet"),
                       f"{shard}: {base}.weight_scale", message)

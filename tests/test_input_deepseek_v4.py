"""DeepSeek-V4 checkpoints as input (formats/decoders/deepseek_v4.py, manifests/deepseek_v4.toml): detection by
config.json's expert_dtype, the FP4 experts and ue8m0 block-FP8 linears decoded against decoders written here from
the format definitions, a round trip (a checkpoint written here with an OCP MX encoder, converted, compared), and
AMXINT4 from DeepSeek-V4 equal to AMXINT4 from the independently dequantized BF16 twin."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.examples.tiny_deepseek_v4 import make_tiny_deepseek_v4
from ktconvert.formats.decoders import decode_matrix, detect_scheme
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.formats.sources import open_source
from ktconvert.formats.st_writer import StreamingSafetensorsWriter
from ktconvert.methods import METHODS
from test_method_mxfp4 import _exact_bf16, _raw, _u8, _widen, ocp_reference, reference_decode

LAYERS, EXPERTS, H, I = 2, 4, 256, 128
W_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
HF_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
NUMPY = {"BF16": np.uint16, "F32": np.float32, "I8": np.int8}      # else one byte per element (U8, F8_*)


def _array(entry) -> np.ndarray:
    dtype, shape, data = entry
    return np.frombuffer(data, NUMPY.get(dtype, np.uint8)).reshape(shape)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """OCP FP8 E4M3 (bias 7, no infinities, S.1111.111 NaN) -> float64, from the bit fields."""
    c = np.asarray(codes, np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 0xF, c & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * np.exp2(exp - 7.0))
    return np.where((exp == 15) & (man == 7), np.nan, sign * mag)


def fp8_reference_decode(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """DeepSeek block FP8 with ue8m0 scales: e4m3 * 2^(e - 127) per 128x128 block, float64."""
    n, k = weight.shape
    s = np.exp2(np.asarray(scale, np.float64) - 127)
    return e4m3_values(weight) * np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:n, :k]


def _run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return make_tiny_deepseek_v4(tmp_path_factory.mktemp("v4") / "src", layers=LAYERS, experts=EXPERTS, hidden=H,
                                 intermediate=I)


# ---------------------------------------------------------------- (1) detection and decode

def test_detected_as_deepseek_v4_fp4(v4):
    src = open_source(v4)
    assert src.info.family == "deepseek_v4" and src.info.name_prefix == ""
    assert src.info.moe_layers == tuple(range(LAYERS)) and (src.info.hidden, src.info.intermediate) == (H, I)
    assert src.input_format == "mxfp4"
    assert src.expert_quantization().fmt == "deepseek-v4"
    assert src.info.expert_names(1, 3)["down"] == "layers.1.ffn.experts.3.w2.weight"
    assert METHODS.get("mxfp4").reads_as_is(src)                 # kt-kernel's MXFP4 loader reads these names
    assert not METHODS.get("nvfp4").reads_as_is(src)


def test_decode_matches_the_format_definition(v4):
    ck = Checkpoint.open(v4)
    scheme = detect_scheme(ck.config)
    raw = _raw(v4)
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for w in W_NAMES.values():
                base = f"layers.{layer}.ffn.experts.{e}.{w}"
                weight, scale = raw[base + ".weight"], raw[base + ".scale"]
                assert weight[0] == "I8" and scale[0] == "F8_E8M0"
                want = _exact_bf16(reference_decode(_u8(weight), _u8(scale)))
                np.testing.assert_array_equal(decode_matrix(ck, base, scheme), want, base)
        for base in (f"layers.{layer}.attn.wo", f"layers.{layer}.ffn.shared_experts.w2"):
            weight, scale = raw[base + ".weight"], raw[base + ".scale"]
            assert weight[0] == "F8_E4M3" and scale[0] == "F8_E8M0"
            want = _exact_bf16(fp8_reference_decode(_u8(weight), _u8(scale)))
            np.testing.assert_array_equal(decode_matrix(ck, base, scheme), want, base)


def test_which_configs_are_deepseek_v4(v4):
    """DeepSeek-V4's quant_method fp8 (by expert_dtype or model_type) and ktconvert's mxfp4 output are read here;
    the same block FP8 config of another family, and the outputs of other methods written from a DeepSeek-V4 source
    (the source's top-level keys, their own quantization_config), are not."""
    config = json.loads((v4 / "config.json").read_text())
    assert detect_scheme(config).groups[0].fmt == "deepseek-v4"
    assert detect_scheme({**config, "model_type": "deepseek_v3"}).groups[0].fmt == "deepseek-v4"   # expert_dtype
    v3 = {k: v for k, v in config.items() if k != "expert_dtype"}
    assert detect_scheme(v3).groups[0].fmt == "deepseek-v4"                                        # model_type
    assert detect_scheme({**v3, "model_type": "deepseek_v3"}).groups[0].fmt == "fp8-block"
    for method, fmt in (("nvfp4", "nvfp4"), ("gptq_int4", "gptq"), ("mxfp8", "mxfp8"), ("mxfp4", "deepseek-v4")):
        qc = METHODS.get(method).quantization_config()
        assert detect_scheme({**config, "quantization_config": qc}).groups[0].fmt == fmt, method
        assert detect_scheme({"model_type": "qwen3_moe", "quantization_config": qc}).groups[0].fmt == fmt, method


@pytest.mark.parametrize("method", ["mxfp8", "nvfp4", "fp8", "gptq_int4"])
def test_other_methods_from_deepseek_v4_verify(v4, tmp_path, method):
    out = tmp_path / "out"
    rc, output = _run("cpu", v4, out, "--method", method, "--quiet")
    assert rc == 0, output
    rc, output = _run("verify", out, "--source", v4, "--hashes", "--json")
    assert rc == 0, output
    result = json.loads(output)
    assert all(c["status"] in ("ok", "skipped") for c in result["checks"]), result["checks"]
    if method == "mxfp8":       # every E2M1 value times a power of two is an e4m3 value at the same E8M0 scale
        assert all(r["weight_rel_l2"] == 0.0 for r in result["numerics"]["layers"])


def test_gpu_checkpoint_from_deepseek_v4_verifies(v4, tmp_path):
    """The GPU checkpoint: routed experts (decoded from FP4) as W4A16, the ue8m0 FP8 linears decoded here too."""
    out = tmp_path / "out"
    rc, output = _run("gpu", v4, out, "--quiet")
    assert rc == 0, output
    rc, output = _run("verify", out, "--source", v4, "--hashes", "--json")
    assert rc == 0, output
    assert all(c["status"] in ("ok", "skipped") for c in json.loads(output)["checks"])
    raw = _raw(out)
    assert raw["layers.1.ffn.experts.3.w2.weight_packed"][0] == "I32"
    wo = raw["layers.0.attn.wo.weight"]
    ours = _raw(v4)
    want = _exact_bf16(fp8_reference_decode(_u8(ours["layers.0.attn.wo.weight"]), _u8(ours["layers.0.attn.wo.scale"])))
    assert wo[0] == "BF16" and np.array_equal(np.frombuffer(wo[2], np.uint16).reshape(wo[1]), want)


def test_bad_scale_is_one_clear_line(tmp_path):
    src = make_tiny_deepseek_v4(tmp_path / "src", layers=1, experts=2)
    tensors = {n: (_array(entry), entry[0]) for n, entry in _raw(src).items()}
    bad = "layers.0.ffn.experts.1.w3.scale"
    tensors[bad] = (np.zeros((I, H // 64), np.uint8), "F8_E8M0")          # per 64, not per 32
    _save(src / "model.safetensors", tensors)
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", "amxint4")
    assert rc == 3, output
    line = output.strip().splitlines()[-1]
    assert "model.safetensors" in line and bad in line and f"[{I}, {H // 32}]" in line, output
    assert not out.exists()


# ---------------------------------------------------------------- (2) round trip and AMXINT4 against the BF16 twin

def _save(path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    specs = [(name, dtype, array.shape) for name, (array, dtype) in tensors.items()]
    with StreamingSafetensorsWriter(path, specs, metadata={"format": "pt"}, fsync_and_hash=False) as writer:
        for name, (array, dtype) in tensors.items():
            writer.write(name, np.asarray(array).view(np.int8) if dtype == "I8" else array)


def _write_reference_v4(folder, seed: int) -> dict:
    """A DeepSeek-V4 checkpoint whose experts this test encodes (OCP MX, test_method_mxfp4.ocp_reference) from
    heavy-tailed BF16 weights; returns {(layer, expert, proj): float64 values the files decode to}."""
    folder.mkdir()
    config = json.loads((make_tiny_deepseek_v4(folder.parent / "shape", layers=LAYERS, experts=EXPERTS, hidden=H,
                                               intermediate=I) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors, values = {}, {}
    for layer in range(LAYERS):
        tensors[f"layers.{layer}.ffn.gate.weight"] = (rng.integers(0x3C00, 0x3C80, (EXPERTS, H)).astype(np.uint16),
                                                      "BF16")
        for e in range(EXPERTS):
            for proj, shape in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
                w = rng.standard_t(3, shape) * 0.02
                codes, stored = ocp_reference(_widen((w.astype(np.float32).view(np.uint32) >> 16)
                                                     .astype(np.uint16)))
                packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
                base = f"layers.{layer}.ffn.experts.{e}.{W_NAMES[proj]}"
                tensors[base + ".weight"], tensors[base + ".scale"] = (packed, "I8"), (stored, "F8_E8M0")
                values[layer, e, proj] = reference_decode(packed, stored)
    _save(folder / "model.safetensors", tensors)
    return values


def test_round_trip_through_bf16(tmp_path):
    values = _write_reference_v4(tmp_path / "src", seed=5)
    out = tmp_path / "out"
    rc, output = _run("cpu", tmp_path / "src", out, "--method", "bf16", "--quiet")
    assert rc == 0, output
    raw = _raw(out)
    for (layer, e, proj), want in values.items():
        got = raw[f"model.layers.{layer}.mlp.experts.{e}.{HF_NAMES[proj]}.weight"]
        assert got[0] == "BF16"
        np.testing.assert_array_equal(np.frombuffer(got[2], np.uint16).reshape(got[1]), _exact_bf16(want))


def test_amxint4_equals_amxint4_of_the_dequantized_bf16_twin(v4, tmp_path):
    """Every tensor of the DeepSeek-V4 checkpoint dequantized here (FP4 experts, ue8m0 FP8 linears) into a BF16
    twin with the same names and config (no quantization): both convert to the same AMXINT4 bytes."""
    twin = tmp_path / "twin"
    twin.mkdir()
    config = json.loads((v4 / "config.json").read_text())
    for key in ("expert_dtype", "quantization_config"):
        del config[key]
    (twin / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, entry in _raw(v4).items():
        dtype, arr = entry[0], _u8(entry) if entry[0] in ("I8", "F8_E4M3") else _array(entry)
        if dtype == "I8":
            tensors[name] = (_exact_bf16(reference_decode(arr, _u8(_raw_scale(v4, name)))), "BF16")
        elif dtype == "F8_E4M3":
            tensors[name] = (_exact_bf16(fp8_reference_decode(arr, _u8(_raw_scale(v4, name)))), "BF16")
        elif dtype != "F8_E8M0":
            tensors[name] = (arr, dtype)
    _save(twin / "model.safetensors", tensors)
    outs = {}
    for name, src in (("v4", v4), ("twin", twin)):
        outs[name] = tmp_path / f"out-{name}"
        rc, output = _run("cpu", src, outs[name], "--method", "amxint4", "--quiet")
        assert rc == 0, output
    ours, theirs = _raw(outs["v4"]), _raw(outs["twin"])
    assert len(ours) == LAYERS * EXPERTS * 3 * 2 and ours == theirs


_SCALES: dict = {}


def _raw_scale(folder, weight_name: str):
    if folder not in _SCALES:
        _SCALES[folder] = _raw(folder)
    return _SCALES[folder][weight_name[: -len("weight")] + "scale"]



def _kt_layer(v4, tmp_path, layer: int):
    """(ours: {"_numa_0/<file>.kt": bytes} of `ktconvert cpu --method amxint4 --layout kt` for `layer`,
    {proj: uint16 [E, n, k]} the layer's experts dequantized here from the format definition)."""
    out = tmp_path / "out"
    rc, output = _run("cpu", v4, out, "--method", "amxint4", "--layout", "kt", "--quiet")
    assert rc == 0, output
    raw = _raw(v4)

    def decoded(e, proj):
        base = f"layers.{layer}.ffn.experts.{e}.{W_NAMES[proj]}"
        return _exact_bf16(reference_decode(_u8(raw[base + ".weight"]), _u8(raw[base + ".scale"])))

    mats = {p: np.stack([decoded(e, p) for e in range(EXPERTS)]) for p in W_NAMES}
    ours = {path.relative_to(out / f"_layer_{layer}").as_posix(): path.read_bytes()
            for path in sorted((out / f"_layer_{layer}").rglob("*.kt"))}
    assert len(ours) == EXPERTS * 3 * 2
    return ours, mats


def test_kt_tree_equals_the_kt_files_of_the_dequantized_weights(v4, tmp_path):
    """The .kt files ktconvert writes from BF16 (ktkernel_util.numpy_kt_files, byte-identical to kt-kernel's own
    AMXINT4 quantization where kt-kernel runs: test_ktkernel_interop) of the independently dequantized experts."""
    from ktkernel_util import numpy_kt_files

    ours, mats = _kt_layer(v4, tmp_path, 1)
    assert ours == numpy_kt_files("amxint4", mats["gate"], mats["up"], mats["down"], 1)


@pytest.mark.ktkernel
def test_amxint4_equals_ktkernels_own_quantization_of_the_dequantized_weights(v4, tmp_path):
    """Acceptance of issue 27: kt-kernel 0.7.2's AMXINT4 of the independently dequantized experts, byte for byte."""
    from ktkernel_util import ktkernel_skip_reason, ktkernel_write_kt, read_kt_tree

    reason = ktkernel_skip_reason("AMXINT4")
    if reason:
        pytest.skip(reason)
    ours, mats = _kt_layer(v4, tmp_path, 1)
    theirs = read_kt_tree(ktkernel_write_kt(tmp_path / "kt", "AMXINT4", mats["gate"], mats["up"], mats["down"], 1,
                                            layer_idx=1))
    assert ours == theirs

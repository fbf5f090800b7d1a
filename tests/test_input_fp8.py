"""FP8 block inputs decode bit-exactly: llmcompressor FP8_BLOCK checkpoints (compressed-tensors float-quantized,
BF16 weight_scale) and DeepSeek-convention checkpoints (weight_scale_inv F32, partial blocks), checked against
compressed-tensors' own decompressors and a per-element reference written here from the spec."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ktconvert.errors import InputError
from ktconvert.formats.decoders import decode_matrix, detect_scheme, validate_matrix
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.quant import fp8

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
EXPERT = "model.layers.1.mlp.experts.{e}.{p}"
PROJS = ("gate_proj", "up_proj", "down_proj")


def _bits(t) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _tiny_bf16(path, hidden, inter, experts=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {}
    for e in range(experts):
        for p, shp in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            w = torch.randn(*shp, generator=g) * 0.02
            w[0, :5] = torch.tensor([0.0, -0.0, 3.0, -1e-6, 7e-3])     # zero, -0, outlier, tiny values
            t[EXPERT.format(e=e, p=p) + ".weight"] = w.to(torch.bfloat16)
    t["model.layers.1.mlp.gate.weight"] = torch.randn(experts, hidden, generator=g).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": hidden,
                                                  "moe_intermediate_size": inter}))
    return t


@pytest.fixture(scope="module")
def llmc_fp8(tmp_path_factory):
    llmcompressor = pytest.importorskip("llmcompressor")
    root = tmp_path_factory.mktemp("llmc_fp8")
    _tiny_bf16(root / "src", hidden=384, inter=256)
    llmcompressor.model_free_ptq(str(root / "src"), str(root / "out"), scheme="FP8_BLOCK",
                                 ignore=["re:.*mlp.gate$"], device="cpu", max_workers=1)
    return root / "out"


@pytest.mark.slow  # llmcompressor's import alone takes ~10 s on 2 shared cores
def test_llmcompressor_fp8_block_bit_exact(llmc_fp8):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    ck = Checkpoint.open(llmc_fp8)
    scheme = detect_scheme(ck.config)
    assert scheme.input_format == "fp8-block" and scheme.groups[0].block == (128, 128)
    qc = QuantizationConfig.model_validate(ck.config["quantization_config"])
    group = next(iter(qc.config_groups.values()))
    comp = BaseCompressor.get_value_from_registry(qc.format)
    sd = st_torch.load_file(str(llmc_fp8 / "model.safetensors"))
    assert sd[EXPERT.format(e=0, p="gate_proj") + ".weight_scale"].dtype == torch.bfloat16
    for e in range(2):
        for p in PROJS:
            base = EXPERT.format(e=e, p=p)
            ref = comp.decompress({n: sd[f"{base}.{n}"] for n in ("weight", "weight_scale")}, group)["weight"]
            np.testing.assert_array_equal(decode_matrix(ck, base, scheme), _bits(ref.to(torch.bfloat16)), base)
    # the router is in `ignore`: read as plain BF16
    router = decode_matrix(ck, "model.layers.1.mlp.gate", scheme)
    np.testing.assert_array_equal(router, _bits(sd["model.layers.1.mlp.gate.weight"]))


def _deepseek_fp8(path, shapes, block=(128, 128), seed=1, scale_dtype=torch.float32):
    """Hand-written DeepSeek-convention checkpoint: random e4m3 codes (NaN codes excluded) and random scales."""
    rng = np.random.default_rng(seed)
    t = {}
    for name, (n, k) in shapes.items():
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        nb, kb = -(-n // block[0]), -(-k // block[1])
        scale = (rng.random((nb, kb)) * 2.0 ** rng.integers(-12, -4, (nb, kb))).astype(np.float32)
        t[name + ".weight"] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
        t[name + ".weight_scale_inv"] = torch.from_numpy(scale).to(scale_dtype)
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(t, str(path / "model.safetensors"))
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": qc}))
    return t


def _reference_dequant(codes: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """Per-element spec formula: value(e4m3) * s[r // bn, c // bk] in float64, then float32, then BF16 RNE."""
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    val = sign * np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp.astype(float) - 7))
    r, c = np.indices(codes.shape)
    prod = (val * scale[r // block[0], c // block[1]]).astype(np.float32)   # exact e4m3 x f32, one f32 rounding
    return torch.from_numpy(prod).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_deepseek_fp8_partial_blocks_bit_exact(tmp_path, block):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    shapes = {EXPERT.format(e=0, p="gate_proj"): (192, 320), EXPERT.format(e=0, p="down_proj"): (320, 192)}
    t = _deepseek_fp8(tmp_path, shapes, block)
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    deq = FP8BlockDequantizer(targets=["re:.*_proj$"], weight_block_size=block)
    for name, (n, k) in shapes.items():
        validate_matrix(ck, name, scheme, (n, k))
        mine = decode_matrix(ck, name, scheme)
        ref = deq._create_dequantized_weight(t[name + ".weight"], t[name + ".weight_scale_inv"])
        np.testing.assert_array_equal(mine, _bits(ref), name)
        codes = t[name + ".weight"].view(torch.uint8).numpy()
        np.testing.assert_array_equal(mine, _reference_dequant(codes, t[name + ".weight_scale_inv"].numpy(), block))


def test_bf16_scale_inv_multiplies_in_fp32(tmp_path):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    name = EXPERT.format(e=0, p="up_proj")
    t = _deepseek_fp8(tmp_path, {name: (130, 260)}, scale_dtype=torch.bfloat16)
    ck = Checkpoint.open(tmp_path)
    ref = FP8BlockDequantizer(targets=["re:.*"])._create_dequantized_weight(t[name + ".weight"],
                                                                            t[name + ".weight_scale_inv"])
    np.testing.assert_array_equal(decode_matrix(ck, name, detect_scheme(ck.config)), _bits(ref))


def test_e4m3_table_and_encoder_match_torch():
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(fp8.E4M3_TO_F32, table)
    rng = np.random.default_rng(3)
    finite = fp8.E4M3_TO_F32[:127]
    x = np.concatenate([rng.standard_normal(50000) * s for s in (1e-3, 1.0, 100.0)]
                       + [finite, -finite, (finite[:-1] + finite[1:]) / 2]).astype(np.float32)
    x = np.clip(x, -448, 448)
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(fp8.f32_to_e4m3(x), ref)


def _write_config(path, qc):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))


def test_scale_grid_mismatch_is_input_error(tmp_path):
    name = EXPERT.format(e=0, p="gate_proj")
    _deepseek_fp8(tmp_path, {name: (256, 256)}, block=(128, 128))
    _write_config(tmp_path, {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]})
    ck = Checkpoint.open(tmp_path)
    with pytest.raises(InputError) as exc:
        validate_matrix(ck, name, detect_scheme(ck.config), (256, 256))
    msg = str(exc.value)
    assert "model.safetensors" in msg and name + ".weight_scale_inv" in msg and "[4, 4]" in msg and "[2, 2]" in msg


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "hqq", "bits": 4}, "unsupported quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_bad_configs_are_input_errors(qc, words):
    with pytest.raises(InputError) as exc:
        detect_scheme({"quantization_config": qc})
    assert "config.json" in str(exc.value) and words in str(exc.value)


def test_hfsource_reads_tiny_fp8_with_partial_blocks(tmp_path):
    pytest.importorskip("ktconvert.examples.tiny")
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the fp8 writer)
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.examples.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "m", "deepseek_v3", layers=2, experts=2, hidden=320, intermediate=192,
                          dtype="fp8", seed=4)
    src = HFSource.open(out)
    assert src.input_format == "fp8-block"
    src.validate()
    layer = src.info.moe_layers[0]
    ew = src.read_expert(layer, 1)
    ck = Checkpoint.open(out)
    name = src.info.expert_names(layer, 1)["down"][: -len(".weight")]
    codes = ck.read(name + ".weight")
    scale = ck.read(name + ".weight_scale_inv")
    assert ew.down.shape == (320, 192) and scale.shape == (3, 2)
    np.testing.assert_array_equal(ew.down, _reference_dequant(codes, scale, (128, 128)))


def test_missing_scale_names_the_shard_and_the_schemes_scale_name(tmp_path):
    """A DeepSeek-convention FP8 weight without its scale: the error names the shard holding the weight and the
    scheme's own scale name (weight_scale_inv), not the folder and not compressed-tensors' weight_scale."""
    name = EXPERT.format(e=0, p="gate_proj")
    t = _deepseek_fp8(tmp_path, {name: (128, 128)})
    del t[name + ".weight_scale_inv"]
    st_torch.save_file(t, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {n: "model-00001-of-00001.safetensors" for n in t}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = Checkpoint.open(tmp_path)
    with pytest.raises(InputError) as exc:
        validate_matrix(ck, name, detect_scheme(ck.config), (128, 128))
    msg = str(exc.value)
    assert "model-00001-of-00001.safetensors" in msg and name + ".weight_scale_inv" in msg, msg

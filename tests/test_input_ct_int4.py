"""compressed-tensors pack-quantized inputs decode bit-exactly against compressed-tensors' own decompression:
llmcompressor W4A16 output, asymmetric / channel / F16-scale variants made with compressed-tensors' compressor,
and tiny Kimi-K2-style checkpoints through HFSource."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ktconvert.errors import InputError
from ktconvert.formats.decoders import decode_matrix, detect_scheme, validate_matrix
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.quant import ct_int4

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("compressed_tensors")
EXPERT = "model.layers.1.mlp.experts.{e}.{p}"
PROJS = ("gate_proj", "up_proj", "down_proj")


def _bits(t) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _scheme(group_size=128, symmetric=True, strategy="group", bits=4):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights={
        "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
        "group_size": group_size if strategy == "group" else None})


def test_pack_unpack_match_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    rng = np.random.default_rng(0)
    for bits, k in ((4, 256), (4, 36), (8, 64), (2, 48)):
        q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (5, k)).astype(np.int8)
        ref = pack_to_int32(torch.from_numpy(q), bits).numpy()
        np.testing.assert_array_equal(ct_int4.pack_int32(q, bits), ref)
        np.testing.assert_array_equal(ct_int4.unpack_int32(ref, k, bits), q)
        back = unpack_from_int32(torch.from_numpy(ref), bits, torch.Size([5, k])).numpy()
        np.testing.assert_array_equal(back, q)


def _save(path, tensors, qc):
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "quantization_config": qc}))


def _ct_config(group_size, symmetric=True, strategy="group", bits=4):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
                "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
                "group_size": group_size if strategy == "group" else None}}}}


@pytest.mark.parametrize("symmetric, strategy, scale_dtype, bits", [
    (True, "group", torch.bfloat16, 4), (False, "group", torch.bfloat16, 4), (True, "channel", torch.float32, 4),
    (True, "group", torch.float16, 4), (False, "group", torch.float16, 8)])
def test_compressor_variants_bit_exact(tmp_path, symmetric, strategy, scale_dtype, bits):
    """Tensors made by compressed-tensors' PackedQuantizationCompressor.compress from chosen scales/zero points."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC

    g = torch.Generator().manual_seed(1)
    n, k, gs = 96, 256, 64
    scheme = _scheme(gs, symmetric, strategy, bits)
    groups = k // gs if strategy == "group" else 1
    w = (torch.randn(n, k, generator=g) * 0.02).to(scale_dtype)
    scale = (torch.rand(n, groups, generator=g) * 0.004 + 1e-4).to(scale_dtype)
    sd = {"weight": w, "weight_scale": scale}
    if not symmetric:
        half = 1 << (bits - 1)
        sd["weight_zero_point"] = torch.randint(-half, half, (n, groups), generator=g, dtype=torch.int8)
    comp = PQC.compress(sd, scheme)
    base = EXPERT.format(e=0, p="up_proj")
    _save(tmp_path, {f"{base}.{k_}": v for k_, v in comp.items()}, _ct_config(gs, symmetric, strategy, bits))
    ref = PQC.decompress(comp, scheme)["weight"].to(torch.bfloat16)
    ck = Checkpoint.open(tmp_path)
    scheme_k = detect_scheme(ck.config)
    validate_matrix(ck, base, scheme_k, (n, k))
    np.testing.assert_array_equal(decode_matrix(ck, base, scheme_k), _bits(ref))


@pytest.fixture(scope="module")
def llmc_w4a16(tmp_path_factory):
    llmcompressor = pytest.importorskip("llmcompressor")
    root = tmp_path_factory.mktemp("llmc_w4")
    g = torch.Generator().manual_seed(0)
    H, I = 384, 256
    t = {EXPERT.format(e=e, p=p) + ".weight": (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
         for e in range(2) for p, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    (root / "src").mkdir()
    st_torch.save_file(t, str(root / "src" / "model.safetensors"))
    (root / "src" / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "hidden_size": H}))
    llmcompressor.model_free_ptq(str(root / "src"), str(root / "out"), scheme="W4A16", ignore=[],
                                 device="cpu", max_workers=1)
    return root / "out", t


@pytest.mark.slow  # llmcompressor's import alone takes ~10 s on 2 shared cores
def test_llmcompressor_w4a16_bit_exact_and_same_quantizer(llmc_w4a16):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC
    from compressed_tensors.quantization import QuantizationConfig

    out, src = llmc_w4a16
    ck = Checkpoint.open(out)
    scheme = detect_scheme(ck.config)
    assert scheme.input_format == "ct-int4" and scheme.groups[0].group_size == 128
    group = next(iter(QuantizationConfig.model_validate(ck.config["quantization_config"]).config_groups.values()))
    sd = st_torch.load_file(str(out / "model.safetensors"))
    for e in range(2):
        for p in PROJS:
            base = EXPERT.format(e=e, p=p)
            comp = {n: sd[f"{base}.{n}"] for n in ("weight_packed", "weight_scale", "weight_shape")}
            ref = PQC.decompress(comp, group)["weight"].to(torch.bfloat16)
            np.testing.assert_array_equal(decode_matrix(ck, base, scheme), _bits(ref), base)
            # ktconvert's RTN (used by --method rawint4) reproduces llmcompressor's W4A16 bytes exactly
            q, scale = ct_int4.quantize_sym_groups(_bits(src[base + ".weight"]), 128)
            np.testing.assert_array_equal(ct_int4.pack_int32(q), comp["weight_packed"].numpy())
            np.testing.assert_array_equal(scale, _bits(comp["weight_scale"]))


def test_rtn_matches_compressed_tensors_quantize():
    """quantize_sym_groups vs compressed-tensors' calculate_qparams + PackedQuantizationCompressor.compress."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC
    from compressed_tensors.quantization.utils import calculate_qparams

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 256, generator=g) * 0.02)
    w[0] = 0
    w[1, :32] = torch.tensor([1.0, -1.0] * 16) * 0.0625     # ties at .5 after division
    w = w.to(torch.bfloat16)
    scheme = _scheme(32)
    grouped = w.reshape(64, 8, 32)
    scale, _ = calculate_qparams(grouped.amin(dim=2), grouped.amax(dim=2), scheme.weights)
    comp = PQC.compress({"weight": w, "weight_scale": scale}, scheme)
    q, mine_scale = ct_int4.quantize_sym_groups(_bits(w), 32)
    np.testing.assert_array_equal(mine_scale, _bits(scale))
    np.testing.assert_array_equal(ct_int4.pack_int32(q), comp["weight_packed"].numpy())


def test_group_mismatch_is_input_error(tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC

    w = torch.zeros(32, 256, dtype=torch.bfloat16)
    comp = PQC.compress({"weight": w, "weight_scale": torch.ones(32, 2, dtype=torch.bfloat16)}, _scheme(128))
    base = EXPERT.format(e=0, p="gate_proj")
    _save(tmp_path, {f"{base}.{k}": v for k, v in comp.items()}, _ct_config(64))
    ck = Checkpoint.open(tmp_path)
    with pytest.raises(InputError) as exc:
        validate_matrix(ck, base, detect_scheme(ck.config), (32, 256))
    assert "model.safetensors" in str(exc.value) and base + ".weight_scale" in str(exc.value)


def test_unsupported_ct_format_is_input_error():
    qc = _ct_config(128)
    qc["config_groups"]["group_0"]["format"] = qc["format"] = "marlin-24"
    with pytest.raises(InputError, match="config.json.*unsupported compressed-tensors scheme"):
        detect_scheme({"quantization_config": qc})


def test_ignored_module_reads_plain_weight(tmp_path):
    base = "model.layers.1.mlp.gate"
    w = torch.randn(4, 64).to(torch.bfloat16)
    qc = _ct_config(32)
    qc["ignore"] = ["re:.*mlp.gate$"]
    _save(tmp_path, {base + ".weight": w}, qc)
    ck = Checkpoint.open(tmp_path)
    np.testing.assert_array_equal(decode_matrix(ck, base, detect_scheme(ck.config)), _bits(w))


def test_hfsource_reads_tiny_ct_int4(tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the ct-int4 writer)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.examples.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "m", "kimi_k2", layers=2, experts=3, dtype="ct-int4", seed=2)
    src = HFSource.open(out)
    assert src.input_format == "ct-int4"
    src.validate()
    layer = src.info.moe_layers[0]
    ew = src.read_expert(layer, 2)
    names = src.info.expert_names(layer, 2)
    ck = Checkpoint.open(out)
    for proj in ("gate", "up", "down"):
        base = names[proj][: -len(".weight")]
        comp = {n: torch.from_numpy(ck.read(f"{base}.{n}")) for n in ("weight_packed", "weight_shape")}
        comp["weight_scale"] = torch.from_numpy(ck.read(f"{base}.weight_scale").view(np.int16)).view(torch.bfloat16)
        ref = PQC.decompress(comp, _scheme(32))["weight"].to(torch.bfloat16)
        np.testing.assert_array_equal(getattr(ew, proj), _bits(ref), proj)

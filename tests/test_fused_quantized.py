"""Issue 15 item 3: quantized experts stored fused 3-D (scales fused the same way) decode bit-exactly against the
libraries' own decoders and convert to the same bytes as the per-expert checkpoint they were made from:
DeepSeek FP8 block (``<name>`` + ``<name>_scale_inv``, transformers 5's names, or ``<name>.weight`` +
``.weight_scale_inv``, both orientations), compressed-tensors pack-quantized INT4 (``weight_packed [E, n, k/8]``,
``weight_scale [E, n, groups]``, ``weight_shape [E, 2]``) and compressed-tensors float-quantized FP8 blocks."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ktconvert.errors import InputError
from ktconvert.formats.hf_source import HFSource
from ktconvert.formats.safetensors_reader import Checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")


def _bits(t) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _bf16_tensor(bits: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _split(t, rows):
    """The library's view of a fused gate_up: first half gate, second half up."""
    if t.role != "gate_up":
        return {t.role: rows}
    half = rows.shape[0] // 2
    return {"gate": rows[:half], "up": rows[half:]}


def _check_slices(path, reference, orientation=None) -> int:
    """Every expert slice of every fused tensor: ktconvert's read_expert == reference(checkpoint, tensor,
    expert) (torch BF16 [stored rows, cols]), transposed for an "in" tensor. Returns matrices compared."""
    src = HFSource.open(path, orientation)
    src.validate()
    ck = Checkpoint.open(path)
    compared = 0
    for layer in src.all_layers():
        layout = src.required_layout(layer)
        assert layout.kind != "per_expert"
        for e in range(src.info.n_experts):
            ew = src.read_expert(layer, e)
            for t in layout.tensors:
                ref = reference(ck, t.name, e)
                if src.orientation[t.role].value == "in":
                    ref = ref.t()
                for proj, rows in _split(t, _bits(ref)).items():
                    np.testing.assert_array_equal(getattr(ew, proj), rows, f"{t.name}[{e}] {proj}")
                    compared += 1
    return compared


def _same_cpu_output(per_expert, fused, tmp_path, method, orientation=None) -> None:
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.run.inputs import open_input

    digests = []
    for name, path, flag in (("a", per_expert, None), ("b", fused, orientation)):
        convert_cpu(open_input(path, flag), tmp_path / name, method=method, numa=2, threads=2)
        manifest = json.loads((tmp_path / name / "ktconvert.json").read_text())
        digests.append(({p: f["sha256"] for p, f in manifest["files"].items()}, manifest["tensors"]))
    assert digests[0] == digests[1] and digests[0][1]


# ---------------------------------------------------------------- DeepSeek FP8 block

def _fp8_reference(names: str):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    deq = FP8BlockDequantizer(targets=["re:.*"], weight_block_size=[128, 128])

    def reference(ck, name, e):
        weight = name if names == "tensor" else f"{name}.weight"
        codes = torch.from_numpy(ck.read_slice(weight, e)).view(torch.float8_e4m3fn)
        scale = torch.from_numpy(ck.read_slice(weight + "_scale_inv", e))
        return deq._create_dequantized_weight(codes, scale)

    return reference


@pytest.mark.parametrize("layout,orientation,names,flag", [
    ("fused", "out", "tensor", None), ("fused", "in", "module", None), ("fused_separate", "in", "tensor", "in")])
def test_fp8_block_fused_bit_exact_and_same_bytes(tiny_model, tmp_path, layout, orientation, names, flag):
    from ktconvert.examples.tiny_relayout import relayout

    per_expert = tiny_model("deepseek_v3", dtype="fp8")
    fused = relayout(per_expert, tmp_path / "fused", layout, orientation, fp8_names=names)
    gate = "model.layers.1.mlp.experts." + ("gate_up_proj" if layout == "fused" else "gate_proj")
    stored = Checkpoint.open(fused).tensors
    weight = gate if names == "tensor" else f"{gate}.weight"
    assert stored[weight].dtype == "F8_E4M3" and stored[weight + "_scale_inv"].dtype == "F32"
    assert len(stored[weight].shape) == len(stored[weight + "_scale_inv"].shape) == 3
    src = HFSource.open(fused, flag)
    assert src.input_format == "fp8-block"
    assert _check_slices(fused, _fp8_reference(names), flag) == 3 * 8 * 3       # MoE layers 1, 2 + MTP 3
    _same_cpu_output(per_expert, fused, tmp_path, "amxint4", flag)


# ---------------------------------------------------------------- compressed-tensors pack-quantized INT4

def _ct_int4_reference(ck, name, e):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights={"num_bits": 4, "type": "int", "symmetric": True,
                                                             "strategy": "group", "group_size": 32})
    comp = {"weight_packed": torch.from_numpy(ck.read_slice(f"{name}.weight_packed", e)),
            "weight_shape": torch.from_numpy(ck.read_slice(f"{name}.weight_shape", e)),
            "weight_scale": _bf16_tensor(ck.read_slice(f"{name}.weight_scale", e))}
    return PQC.decompress(comp, scheme)["weight"].to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["fused", "fused_separate"])
def test_ct_int4_fused_bit_exact_and_same_bytes(tiny_model, tmp_path, layout):
    from ktconvert.examples.tiny_relayout import relayout

    per_expert = tiny_model("kimi_k2", dtype="ct-int4")
    fused = relayout(per_expert, tmp_path / "fused", layout, "out")
    name = "model.layers.1.mlp.experts." + ("gate_up_proj" if layout == "fused" else "down_proj")
    stored = Checkpoint.open(fused).tensors
    assert [stored[f"{name}.{s}"].shape[0] for s in ("weight_packed", "weight_scale", "weight_shape")] == [8] * 3
    assert stored[f"{name}.weight_shape"].shape == (8, 2)
    src = HFSource.open(fused)
    assert src.input_format == "ct-int4"
    # square separate tensors: compressed-tensors weights are [out, in] by definition, no flag needed
    assert all("quantizes along in-features" in o.why for o in src.orientation.values())
    assert _check_slices(fused, _ct_int4_reference) == 8 * 3
    _same_cpu_output(per_expert, fused, tmp_path / "amxint8", "amxint8")
    # rawint4: the per-expert checkpoint's tensors are carried over byte for byte (test_carry_over), the fused
    # one's are decoded and quantized again at the same group size (carry-over reads per-expert tensors only)
    from ktconvert.cpu.convert import convert_cpu

    convert_cpu(fused, tmp_path / "rawint4", method="rawint4", numa=2, threads=2)
    assert "carried_over" not in json.loads((tmp_path / "rawint4" / "ktconvert.json").read_text())


def test_ct_int4_cannot_be_stored_input_major(tiny_model, tmp_path):
    from ktconvert.examples.tiny_relayout import relayout

    with pytest.raises(InputError, match="only as"):
        relayout(tiny_model("kimi_k2", dtype="ct-int4"), tmp_path / "x", "fused", "in")


# ---------------------------------------------------------------- compressed-tensors float-quantized FP8 block

def _to_ct_fp8(src, dst) -> None:
    """The DeepSeek FP8 checkpoint as llmcompressor's FP8_BLOCK names it: weight_scale, compressed-tensors config."""
    from ktconvert.examples.tiny import _save_shard

    shutil.copytree(src, dst)
    ck = Checkpoint.open(dst)
    by_file: dict = {}
    for name, ref in ck.tensors.items():
        by_file.setdefault(ref.file.name, {})[name.replace("weight_scale_inv", "weight_scale")] = \
            (ck.read(name), ref.dtype)
    for file, tensors in by_file.items():
        (dst / file).unlink()
        _save_shard(dst / file, tensors)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n.replace("weight_scale_inv", "weight_scale"): f for n, f in index["weight_map"].items()}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized", "weights": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128],
            "dynamic": False}}}}
    (dst / "config.json").write_text(json.dumps(config))


def test_ct_fp8_block_fused_bit_exact_and_same_bytes(tiny_model, tmp_path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from ktconvert.examples.tiny_relayout import relayout

    per_expert = tmp_path / "ct"
    _to_ct_fp8(tiny_model("deepseek_v3", dtype="fp8"), per_expert)
    fused = relayout(per_expert, tmp_path / "fused", "fused", "out", fp8_names="module")
    qc = QuantizationConfig.model_validate(json.loads((fused / "config.json").read_text())["quantization_config"])
    group = next(iter(qc.config_groups.values()))
    comp = BaseCompressor.get_value_from_registry(qc.format)

    def reference(ck, name, e):
        weight = torch.from_numpy(ck.read_slice(f"{name}.weight", e)).view(torch.float8_e4m3fn)
        scale = torch.from_numpy(ck.read_slice(f"{name}.weight_scale", e))
        return comp.decompress({"weight": weight, "weight_scale": scale}, group)["weight"].to(torch.bfloat16)

    assert HFSource.open(fused).input_format == "fp8-block"
    assert _check_slices(fused, reference) == 3 * 8 * 3
    _same_cpu_output(per_expert, fused, tmp_path, "amxint8")

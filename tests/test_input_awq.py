"""AutoAWQ GEMM inputs (``quant_method: awq``, ``version: gemm``, issue 27 item 2) decode bit for bit as the
libraries read them:

* against compressed-tensors' own AutoAWQ converter followed by its pack-quantized decompressor (the library's
  unpacking, AWQ order reversal and dequantization), on random words and F16 scales;
* against a reference written here from the format definition: qweight [K, N/8] and qzeros [G, N/8] hold column
  8w + ORDER[i] in field i (bits 4i) of word w, ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; W[k, n] = scales[g, n] *
  (q - z) with g = k // group, computed as AutoAWQ's torch dequantization does (int32 tensor times F16);
* tiny checkpoints (``--dtype awq-int4``, per-expert and fused) decode as that reference reads their tensors, convert
  with ``cpu --method amxint4`` and pass ``verify --source``; ``inspect`` names the format; ``gpu`` decodes their
  AWQ attention;
* malformed tensors and unsupported packings exit 3 with one line.
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
BASE = "model.layers.0.mlp.experts.1.gate_proj"
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack(values: np.ndarray) -> np.ndarray:
    """int [R, C] in [0, 16) -> int32 [R, C/8]: column c in word c // 8, field ORDER.index(c % 8)."""
    out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for c in range(values.shape[1]):
        out[:, c // 8] |= values[:, c].astype(np.uint32) << np.uint32(4 * ORDER.index(c % 8))
    return out.view(np.int32)


def unpack(words: np.ndarray) -> np.ndarray:
    u = words.view(np.uint32)
    return np.stack([(u[:, c // 8] >> np.uint32(4 * ORDER.index(c % 8))) & 15 for c in range(u.shape[1] * 8)], 1)


def reference(q: np.ndarray, z: np.ndarray, scales, group: int) -> np.ndarray:
    """BF16 bits [N, K] of (q - z[k // group]) * scales[k // group] in torch (int32 times the scales' dtype)."""
    iw = torch.from_numpy(q.astype(np.int32))
    iz = torch.from_numpy(z.astype(np.int32)).repeat_interleave(group, dim=0)[: q.shape[0]]
    w = (iw - iz) * scales.repeat_interleave(group, dim=0)[: q.shape[0]]
    return w.to(torch.bfloat16).t().contiguous().view(torch.int16).numpy().view(np.uint16)


def reference_from_tensors(ck: Checkpoint, base: str, group: int, e: int | None = None) -> np.ndarray:
    def read(suffix):
        return ck.read(f"{base}.{suffix}") if e is None else ck.read_slice(f"{base}.{suffix}", e)

    return reference(unpack(read("qweight")), unpack(read("qzeros")), torch.from_numpy(read("scales")), group)


def _config(group=32, **extra) -> dict:
    return {"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm", **extra}}


def _save(path, tensors: dict, config: dict) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(path)


def _scales(rng, groups, n, dtype=torch.float16):
    s = rng.uniform(1e-4, 4e-2, (groups, n)).astype(np.float32)
    s[0, :3] = (6.0e-8, 3.3e-3, 60000.0)
    return torch.from_numpy(s).to(dtype)


@pytest.mark.parametrize("k,n,group", [(128, 64, 32), (256, 48, 128), (64, 16, 64)])
def test_matches_compressed_tensors_autoawq_converter(tmp_path, k, n, group):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationScheme

    rng = np.random.default_rng(k + n)
    groups = -(-k // group)
    words = lambda rows: torch.from_numpy(rng.integers(-2 ** 31, 2 ** 31, (rows, n // 8)).astype(np.int32))  # noqa
    t = {"qweight": words(k), "qzeros": words(groups), "scales": _scales(rng, groups, n)}
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _config(group))
    scheme = detect_scheme(ck.config)
    assert scheme.input_format == "awq-int4"
    validate_matrix(ck, BASE, scheme, (n, k))
    converted = AutoAWQConverter(bits=4, group_size=group, zero_point=True).process(
        {f"m.{s}": v.clone() for s, v in t.items()})
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}
    library = PackedQuantizationCompressor.decompress(
        {s[2:]: v for s, v in converted.items()}, QuantizationScheme(targets=["Linear"], weights=weights))["weight"]
    want = library.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    got = decode_matrix(ck, BASE, scheme)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(reference_from_tensors(ck, BASE, group), want)


@pytest.mark.parametrize("scale_dtype,k,group", [(torch.float16, 128, 32), (torch.bfloat16, 128, 32),
                                                 (torch.float32, 128, 32), (torch.float16, 96, 64)])
def test_round_trip_through_the_definition(tmp_path, scale_dtype, k, group):
    rng = np.random.default_rng(1)
    n = 40
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (-(-k // group), n))        # 96 / 64: a partial last group
    scales = _scales(rng, -(-k // group), n, scale_dtype)
    t = {"qweight": torch.from_numpy(pack(q)), "qzeros": torch.from_numpy(pack(z)), "scales": scales}
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _config(group))
    got = decode_matrix(ck, BASE, detect_scheme(ck.config))
    np.testing.assert_array_equal(got, reference(q, z, scales, group))
    if scale_dtype == torch.float16:        # the product is rounded to F16 first, as AutoAWQ computes it
        assert not np.array_equal(got, reference(q, z, scales.float(), group))


def test_zero_point_false_reads_offset_binary(tmp_path):
    """zero_point: false (compressed-tensors' converter): z = 8, qzeros (when stored) not read."""
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (64, 16))
    scales = _scales(rng, 2, 16)
    junk = rng.integers(0, 16, (2, 16))
    t = {"qweight": torch.from_numpy(pack(q)), "qzeros": torch.from_numpy(pack(junk)), "scales": scales}
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _config(32, zero_point=False))
    np.testing.assert_array_equal(decode_matrix(ck, BASE, detect_scheme(ck.config)),
                                  reference(q, np.full((2, 16), 8), scales, 32))


@pytest.mark.parametrize("qc, message", [
    ({"version": "gemv"}, "unsupported AWQ packing"), ({"version": "GEMV_FAST"}, "unsupported AWQ packing"),
    ({"backend": "llm-awq"}, "unsupported AWQ packing"), ({"bits": 8}, "bad bits"),
])
def test_unreadable_configs_are_refused(qc, message):
    config = _config()
    config["quantization_config"].update(qc)
    with pytest.raises(InputError, match=rf"config.json: quantization_config: {message}"):
        detect_scheme(config)


# ---------------------------------------------------------------- tiny checkpoints, end to end

def test_tiny_checkpoint_decodes_converts_and_verifies(tiny_model, tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the awq writer)

    src = tiny_model("qwen3_moe", dtype="awq-int4")
    ck = Checkpoint.open(src)
    scheme = detect_scheme(ck.config)
    for e in (1, 6):
        for p in ("up_proj", "down_proj"):
            base = f"model.layers.0.mlp.experts.{e}.{p}"
            np.testing.assert_array_equal(decode_matrix(ck, base, scheme), reference_from_tensors(ck, base, 32), base)
    inspected = _run("inspect", src)
    assert inspected.exit_code == 0 and "awq-int4" in inspected.output, inspected.output
    out = tmp_path / "out"
    result = _run("cpu", src, out, "--method", "amxint4", "--quiet")
    assert result.exit_code == 0, result.output
    result = _run("verify", out, "--source", src)
    assert result.exit_code == 0, result.output


def test_gpu_checkpoint_decodes_quantized_attention(tiny_model, tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401

    gpu_checkpoint_decodes_quantized_linears(tiny_model("qwen3_moe", dtype="awq-int4"), tmp_path / "gpu", "bf16")


def test_fused_tiny_checkpoint_decodes_each_slice(tiny_model):
    import ktconvert.examples.tiny_quantized  # noqa: F401

    src = tiny_model("qwen3_5_moe", dtype="awq-int4")
    ck = Checkpoint.open(src)
    scheme = detect_scheme(ck.config)
    fused = [n[: -len(".qweight")] for n in ck.tensors if n.endswith(".qweight") and ".experts." in n]
    assert fused and all(len(ck.tensors[f"{b}.qweight"].shape) == 3 for b in fused)
    for base in fused[:2]:
        for e in (0, 2):
            np.testing.assert_array_equal(decode_matrix(ck, base, scheme, e),
                                          reference_from_tensors(ck, base, 32, e), base)


def test_malformed_tensors_exit_3_naming_file_and_tensor(tiny_model, tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401

    src = tiny_model("qwen3_moe", dtype="awq-int4")
    ck = Checkpoint.open(src)
    base = "model.layers.1.mlp.experts.4.down_proj"
    shard = ck.tensors[f"{base}.qweight"].file.name
    qw, qz, scales = (ck.read(f"{base}.{s}") for s in ("qweight", "qzeros", "scales"))
    cases = {
        "qweight": ({f"{base}.qweight": (qw[:, :-1], "I32")}, f"{base}.scales", "out-features"),
        "qzeros": ({f"{base}.qzeros": (qz[:, :-1], "I32")}, f"{base}.qzeros", "do not match"),
        "scales": ({f"{base}.scales": (scales.astype(np.float32).view(np.int32), "I32")}, f"{base}.scales",
                   "wrong dtype"),
    }
    for what, (changes, tensor, message) in cases.items():
        model = edited(src, tmp_path / what, changes)
        one_line_error(_run("cpu", model, tmp_path / f"out-{what}", "--method", "amxint4", "--quiet"),
                       f"{shard}: {tensor}", message)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    model = edited(src, tmp_path / "gemv", {})
    (model / "config.json").write_text(json.dumps(config))
    one_line_error(_run("cpu", model, tmp_path / "out-gemv", "--method", "amxint4", "--quiet"),
                   "config.json: quantization_config: unsupported AWQ packing")

"""RTN of the GPU checkpoint's routed experts (compressed-tensors pack-quantized W4A16 / W8A16) without torch.

Golden values: compressed-tensors 0.19 itself (``calculate_qparams`` on the BF16 min/max + ``PackedQuantizationCompressor
.compress``, as llmcompressor's model_free_ptq runs them), and model_free_ptq's files (slow group). Under test: the
native kernel of every implementation this CPU runs (native/ct_quant.c) and the numpy path
(ktconvert.quant.ct_int4), both through ``ktconvert.gpu.experts.quantize_expert_rtn``.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ktconvert import native
from ktconvert.errors import NumericError, ShapeError
from ktconvert.gpu.experts import quantize_expert_rtn
from ktconvert.quant.bf16 import f32_to_bf16_bits

IMPLS = ["numpy"] + native.usable_impls()
GROUPS = [32, 64, 128, None]                    # None: channel-wise (one scale per row)
FAMILIES = ["deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2", "mixtral", "qwen2_moe", "qwen3_5_moe", "qwen3_moe",
            "qwen3_next"]                        # one model_type of every family in manifests/


def ct_reference(w_bf16: np.ndarray, bits: int, group_size: int | None) -> dict[str, np.ndarray]:
    """compressed-tensors' own RTN of uint16 [n, k] BF16 bits: symmetric int, group (or channel) strategy."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "channel" if group_size is None else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    weight = torch.from_numpy(np.ascontiguousarray(w_bf16).view(np.int16)).view(torch.bfloat16)
    grouped = weight.unflatten(-1, (-1, group_size)) if group_size else weight.unsqueeze(1)
    scale, zero_point = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
    state = {"weight": weight, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero_point.to(torch.int8)}
    with torch.no_grad():
        out = PackedQuantizationCompressor.compress(state, scheme)
    return {"weight_packed": out["weight_packed"].numpy(),
            "weight_scale": out["weight_scale"].view(torch.int16).numpy().view(np.uint16),
            "weight_shape": out["weight_shape"].to(torch.int64).numpy()}


def assert_same(got: dict, want: dict, what: str) -> None:
    for key in ("weight_packed", "weight_scale", "weight_shape"):
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, (what, key)
        if not np.array_equal(got[key], want[key]):
            bad = np.argwhere(got[key] != want[key])
            raise AssertionError(f"{what} {key}: {len(bad)} differ, first at {bad[0].tolist()}")


def bf16(values) -> np.ndarray:
    return f32_to_bf16_bits(np.asarray(values, np.float32))


def adversarial(k: int, bits: int, seed: int = 0) -> np.ndarray:
    """uint16 [12, k] BF16 bits: Gaussian rows, exact .5 ties of w / s, zero rows, subnormals, huge outliers, -0."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(k) * 0.02, rng.standard_t(2, k) * 1e-3]
    half = 7.5 if bits == 4 else 127.5                    # amax = half gives the scale 1.0 exactly
    ties = rng.choice(np.arange(-2 * half, 2 * half + 1) / 2, k)   # every multiple of 0.5 in [-half, half]
    ties[::16] = half                                     # each group's amax, so s = 1 and w / s = w
    rows += [ties, -ties, np.zeros(k), np.full(k, -0.0)]
    tiny = np.zeros(k, np.float32)
    tiny[::3] = rng.choice([1, -1], len(tiny[::3])) * np.float32(2.0 ** -133) * rng.integers(1, 100, len(tiny[::3]))
    rows += [tiny, tiny * 2.0 ** 7, np.where(rng.random(k) < 0.5, tiny, rng.standard_normal(k) * 1e-38)]
    huge = rng.standard_normal(k) * 1e-3
    huge[::7] = rng.choice([1, -1], len(huge[::7])) * 3.0e38          # near the BF16 maximum
    rows += [huge, rng.standard_normal(k) * 2.0 ** 100, np.where(np.arange(k) % 32 == 5, 1e30, 1e-30)]
    return bf16(np.stack(rows).astype(np.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
def test_adversarial_bytes_equal_compressed_tensors(bits, group):
    w = adversarial(256, bits, seed=bits)
    assert (w[4] == 0).all() and (w[5] == 0x8000).all() and ((w[6] & 0x7F80) == 0).any()   # zeros, -0, subnormal
    want = ct_reference(w, bits, group)
    for impl in IMPLS:
        assert_same(quantize_expert_rtn(w, bits, group, impl=impl), want, f"{impl} bits {bits} group {group}")


def test_ties_round_half_to_even_and_range():
    """w / s exactly k + 0.5 rounds to even; -8.5..7.5 clamp to the int4 range (independent of the reference)."""
    values = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5, -6.5, 7.5, -7.5] + [0.0] * 22, np.float32)
    for impl in IMPLS:
        out = quantize_expert_rtn(bf16(values[None, :]), 4, 32, impl=impl)
        assert out["weight_scale"][0, 0] == 0x3F80                                # 7.5 / 7.5 = 1.0
        words = out["weight_packed"].view(np.uint32)[0]
        codes = ((words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).reshape(-1).astype(int) - 8
        assert codes[:10].tolist() == [0, 2, 2, 0, -2, -2, 6, -6, 7, -8], impl


@pytest.mark.parametrize("bits", [4, 8])
def test_random_shapes_and_threads(bits):
    rng = np.random.default_rng(7)
    w = bf16(rng.standard_normal((160, 768)) * 0.05)
    for group in GROUPS:
        want = ct_reference(w, bits, group)
        for impl in IMPLS:
            for threads in (1, 3):
                assert_same(quantize_expert_rtn(w, bits, group, impl=impl, threads=threads), want,
                            f"{impl} group {group} threads {threads}")


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_tiny_model(tiny_model, arch):
    """Every routed expert matrix of one MoE layer of each family's tiny model, W4A16 and W8A16, g32/g128/channel."""
    from ktconvert.formats.hf_source import HFSource

    source = HFSource.open(tiny_model(arch))
    layer = source.info.moe_layers[-1]
    impls = IMPLS[:1] + IMPLS[-1:]                          # numpy and the best native one
    for e in range(min(3, source.info.n_experts)):
        for proj, w in source.read_expert(layer, e).projections():
            for bits, group in ((4, 128), (8, 32), (4, None)):
                want = ct_reference(w, bits, group)
                for impl in impls:
                    assert_same(quantize_expert_rtn(w, bits, group, impl=impl), want,
                                f"{arch} layer {layer} expert {e} {proj} {impl} bits {bits} group {group}")


@pytest.mark.parametrize("impl", IMPLS)
def test_nonfinite_is_a_numeric_error(impl):
    w = bf16(np.ones((4, 64), np.float32))
    for bad in (0x7FC0, 0xFF80):                            # NaN, -Inf
        w[2, 37] = bad
        with pytest.raises(NumericError) as info:
            quantize_expert_rtn(w, 4, 32, where="t.weight", impl=impl)
        assert "t.weight" in str(info.value)
        if impl != "numpy":
            assert "row 2, column 37" in str(info.value)


def test_shape_errors():
    with pytest.raises(ShapeError, match="group"):
        quantize_expert_rtn(np.zeros((4, 96), np.uint16), 4, 64)
    with pytest.raises(ShapeError):
        native.ct_quant.rtn_quantize(np.zeros((4, 12), np.uint16), 4, None)     # 12 * 4 bits: not whole words
    with pytest.raises(ShapeError, match="BF16 bits"):
        native.ct_quant.rtn_quantize(np.zeros((4, 64), np.float32), 4, 32)


def test_gpu_rtn_conversion_imports_no_torch(tiny_model, tmp_path):
    """A `gpu` RTN conversion (FP8-block linears included) loads neither torch, compressed-tensors nor llmcompressor."""
    code = ("import sys, json\nfrom ktconvert.cli.main import main\nsys.argv = ['ktconvert'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'compressed_tensors', 'llmcompressor',"
            " 'transformers'})\nprint(json.dumps(heavy))\n")
    for arch, dtype in (("deepseek_v3", "bf16"), ("qwen3_moe", "fp8")):
        out = tmp_path / f"{arch}-{dtype}"
        proc = subprocess.run([sys.executable, "-c", code, "gpu", str(tiny_model(arch, dtype=dtype)), str(out),
                               "--quiet"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], proc.stdout
        assert (out / "ktconvert.json").is_file()


def test_ct_ignored_is_compressed_tensors_match_name(tiny_model):
    """config.ct_ignored (no torch) decides like compressed_tensors.utils.match.match_name on every module."""
    from compressed_tensors.utils.match import match_name

    from ktconvert.formats.safetensors_reader import Checkpoint
    from ktconvert.gpu.config import BASE_IGNORE, EXTRA_IGNORE, ct_ignored

    patterns = BASE_IGNORE + EXTRA_IGNORE + ["lm_head", "model.layers.0.mlp.gate", r"re:.*experts\.1\..*"]
    checked = 0
    for arch in FAMILIES:
        for name in Checkpoint.open(tiny_model(arch)).tensors:
            module = name.rsplit(".", 1)[0]
            for pattern in patterns:
                assert ct_ignored(module, [pattern]) == match_name(module, pattern), (module, pattern)
                checked += 1
    assert checked > 10000


@pytest.mark.slow
@pytest.mark.parametrize("scheme_name,group", [("W4A16", 32), ("W8A16", 64), ("W4A16", None)])
def test_bytes_equal_model_free_ptq_other_groups(tiny_model, tmp_path, scheme_name, group):
    """model_free_ptq with a custom group size (and channel-wise) against quantize_expert_rtn of the same matrices."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    from ktconvert.formats.hf_source import HFSource
    from ktconvert.formats.safetensors_reader import Checkpoint

    bits = 4 if scheme_name == "W4A16" else 8
    src = tiny_model("qwen3_moe")
    targets = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, group_size=group,
                            strategy="group" if group else "channel")
    model_free_ptq(str(src), str(tmp_path / "ref"), scheme=QuantizationScheme(targets=targets, weights=args),
                   device="cpu")
    ref = Checkpoint.open(tmp_path / "ref")
    source = HFSource.open(src)
    compared = 0
    for layer in source.info.moe_layers:
        for e in range(source.info.n_experts):
            names = source.info.expert_names(layer, e)
            for proj, w in source.read_expert(layer, e).projections():
                base = names[proj].removesuffix(".weight")
                ours = quantize_expert_rtn(w, bits, group, impl=IMPLS[-1])
                for key in ("weight_packed", "weight_scale"):
                    assert np.array_equal(ours[key].view(np.uint8), ref.read(f"{base}.{key}").view(np.uint8)), base
                compared += 1
    assert compared >= 3 * source.info.n_experts

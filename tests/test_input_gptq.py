"""GPTQ inputs (AutoGPTQ / GPTQModel ``quant_method: gptq``, issue 27 item 2) decode bit for bit as the format
defines them, checked against references written here from the definition, never against ktconvert's unpacking:

* qweight [K*b/32, N]: value (k, n) in word (k // (32/b), n) at bits b*(k % (32/b)); qzeros [G, N*b/32]: zero
  (g, n) in word (g, n // (32/b)) at bits b*(n % (32/b)), holding z - 1 in checkpoint_format "gptq" (v1) and z in
  "gptq_v2"; W[k, n] = scales[g, n] * (q - z), g = g_idx[k], computed as AutoGPTQ's torch dequantization does
  (int tensor times the scales' dtype), then rounded to BF16 by torch.
* Round trip: known integers and scales are packed by this file's own packer (loops over the definition), decoded,
  and compared with the reference computed from the integers; 2/4/8 bits, sym/asym, v1/v2, act-order g_idx,
  group_size -1, a partial last group, F16/BF16/F32 scales, fused [E, ...] tensors.
* Tiny checkpoints (``ktconvert tiny-model --dtype gptq-*``) decode as the reference reads their stored tensors,
  convert with ``cpu --method amxint4`` and pass ``verify --source``; ``inspect`` names the format; ``gpu`` writes
  their GPTQ attention linears decoded (BF16 or block FP8), never as the source's GPTQ tensors.
* Malformed tensors: exit 3 with one line naming the file and tensor.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import InputError
from ktconvert.formats.decoders import decode_matrix, detect_scheme, validate_matrix
from ktconvert.formats.safetensors_reader import Checkpoint

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
BASE = "model.layers.0.mlp.experts.0.down_proj"
FUSED = "model.layers.0.mlp.experts.down_proj"
TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


# ---------------------------------------------------------------- the definition, written out

def pack_k(q: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: int [K, N] values -> int32 [K*bits/32, N], value k in row k // per at bits bits*(k % per)."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for k in range(q.shape[0]):
        out[k // per] |= q[k].astype(np.uint32) << np.uint32(bits * (k % per))
    return out.view(np.int32)


def pack_n(z: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qzeros: int [G, N] -> int32 [G, N*bits/32], column n in word n // per at bits bits*(n % per)."""
    per = 32 // bits
    out = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint32)
    for n in range(z.shape[1]):
        out[:, n // per] |= z[:, n].astype(np.uint32) << np.uint32(bits * (n % per))
    return out.view(np.int32)


def unpack_k(qw: np.ndarray, bits: int) -> np.ndarray:
    per, mask = 32 // bits, (1 << bits) - 1
    u = qw.view(np.uint32)
    return np.stack([(u[k // per] >> np.uint32(bits * (k % per))) & mask for k in range(u.shape[0] * per)])


def unpack_n(qz: np.ndarray, bits: int) -> np.ndarray:
    per, mask = 32 // bits, (1 << bits) - 1
    u = qz.view(np.uint32)
    return np.stack([(u[:, n // per] >> np.uint32(bits * (n % per))) & mask for n in range(u.shape[1] * per)], 1)


def reference(q: np.ndarray, z: np.ndarray, scales, g_idx: np.ndarray) -> np.ndarray:
    """BF16 bits [N, K]: torch's scales[g_idx] * (q - z[g_idx]) (int32 tensor times the scales' dtype), to BF16."""
    g = torch.from_numpy(np.asarray(g_idx, dtype=np.int64))
    diff = torch.from_numpy(q.astype(np.int32)) - torch.from_numpy(z.astype(np.int32))[g]
    w = scales[g] * diff
    return w.to(torch.bfloat16).t().contiguous().view(torch.int16).numpy().view(np.uint16)


def reference_from_tensors(ck: Checkpoint, base: str, bits: int, v1: bool, gs: int, e: int | None = None):
    """The reference dequantization of the stored tensors of `base` (expert slice `e` of a fused one)."""
    def read(suffix):
        name = f"{base}.{suffix}"
        return ck.read(name) if e is None else ck.read_slice(name, e)

    q = unpack_k(read("qweight"), bits)
    z = unpack_n(read("qzeros"), bits).astype(np.int64) + (1 if v1 else 0)
    ref = ck.tensors[f"{base}.scales"]
    scales = torch.from_numpy(read("scales"))
    scales = scales.view(torch.bfloat16) if ref.dtype == "BF16" else scales
    g_idx = read("g_idx") if f"{base}.g_idx" in ck.tensors else np.arange(q.shape[0]) // gs
    return reference(q, z, scales, g_idx)


# ---------------------------------------------------------------- round trip through this file's packer

def _config(bits=4, gs=32, sym=True, desc_act=False, fmt="gptq", **extra) -> dict:
    return {"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": desc_act,
        "checkpoint_format": fmt, **extra}}


def _save(path, tensors: dict, config: dict) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(path)


def _case(rng, k, n, bits, gs, sym, v1, act_order, scale_dtype):
    """(q [K, N], true z [G, N], scales torch [G, N], g_idx [K], stored tensors) of one random matrix."""
    top = (1 << bits) - 1
    groups = -(-k // gs) if gs > 0 else 1
    g_idx = np.arange(k) // gs if gs > 0 else np.zeros(k, dtype=np.int64)
    if act_order:
        g_idx = rng.permutation(g_idx)
    q = rng.integers(0, top + 1, (k, n))
    if sym:
        z = np.full((groups, n), 1 << (bits - 1))
    else:                                   # v1 cannot store z = 0; its all-ones field means z = 2^b
        z = rng.integers(1, top + 2, (groups, n)) if v1 else rng.integers(0, top + 1, (groups, n))
    s = rng.uniform(1e-4, 4e-2, (groups, n)).astype(np.float32)
    s[0, :3] = (6.0e-8, 3.3e-3, 60000.0)     # F16 subnormal, many-bit mantissa, a product past F16's range
    scales = torch.from_numpy(s).to(TORCH_DTYPES[scale_dtype])
    tensors = {"qweight": torch.from_numpy(pack_k(q, bits)), "scales": scales,
               "qzeros": torch.from_numpy(pack_n(z - (1 if v1 else 0), bits)),
               "g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    return q, z, scales, g_idx, tensors


@pytest.mark.parametrize("bits,gs,sym,fmt,act_order,scale_dtype,k", [
    (4, 32, True, "gptq", False, "F16", 128), (4, 32, False, "gptq", False, "F16", 128),
    (4, 64, False, "gptq_v2", True, "F16", 128), (8, 32, True, "gptq", True, "F16", 96),
    (8, 32, False, "gptq_v2", False, "BF16", 64), (2, 32, False, "gptq", False, "F32", 128),
    (4, -1, True, "gptq", False, "F16", 64), (4, 64, False, "gptq", False, "F16", 96),   # partial last group
    (4, 32, True, "gptq_v1", True, "BF16", 64),
])
def test_round_trip_matches_the_definition(tmp_path, bits, gs, sym, fmt, act_order, scale_dtype, k):
    rng = np.random.default_rng(bits * 1000 + k + (gs > 0) * gs)
    n = 48
    q, z, scales, g_idx, t = _case(rng, k, n, bits, gs, sym, fmt != "gptq_v2", act_order, scale_dtype)
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _config(bits, gs, sym, act_order, fmt))
    scheme = detect_scheme(ck.config)
    assert scheme.input_format == f"gptq-int{bits}"
    validate_matrix(ck, BASE, scheme, (n, k))
    want = reference(q, z, scales, g_idx)
    np.testing.assert_array_equal(decode_matrix(ck, BASE, scheme), want)
    v1 = fmt != "gptq_v2"
    np.testing.assert_array_equal(reference_from_tensors(ck, BASE, bits, v1, gs if gs > 0 else k), want)


def test_f16_scales_multiply_in_f16_and_g_idx_is_applied(tmp_path):
    """The decoder must round the product to F16 before BF16 (AutoGPTQ multiplies in the scales' dtype), and must
    use g_idx: a float32 product or plain k // group decode to other bits on these inputs."""
    rng = np.random.default_rng(7)
    q, z, scales, g_idx, t = _case(rng, 128, 32, 4, 32, False, True, True, "F16")
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _config(4, 32, False, True))
    got = decode_matrix(ck, BASE, detect_scheme(ck.config))
    np.testing.assert_array_equal(got, reference(q, z, scales, g_idx))
    assert not np.array_equal(got, reference(q, z, scales.float(), g_idx))
    assert not np.array_equal(got, reference(q, z, scales, np.arange(128) // 32))


def test_symmetric_checkpoint_without_qzeros_uses_the_midpoint(tmp_path):
    rng = np.random.default_rng(3)
    q, z, scales, g_idx, t = _case(rng, 64, 16, 4, 32, True, True, False, "F16")
    del t["qzeros"], t["g_idx"]
    ck = _save(tmp_path, {f"{BASE}.{s}": v for s, v in t.items()}, _config(4, 32, True))
    np.testing.assert_array_equal(decode_matrix(ck, BASE, detect_scheme(ck.config)), reference(q, z, scales, g_idx))
    bad = _save(tmp_path / "asym", {f"{BASE}.{s}": v for s, v in t.items()}, _config(4, 32, False))
    with pytest.raises(InputError, match=rf"{BASE}.qzeros: tensor missing"):
        decode_matrix(bad, BASE, detect_scheme(bad.config))


def test_fused_experts_decode_each_slice(tmp_path):
    rng = np.random.default_rng(11)
    cases = [_case(rng, 64, 32, 4, 32, False, False, True, "F16") for _ in range(3)]
    tensors = {f"{FUSED}.{s}": torch.stack([c[4][s] for c in cases]) for s in cases[0][4]}
    ck = _save(tmp_path, tensors, _config(4, 32, False, True, "gptq_v2"))
    scheme = detect_scheme(ck.config)
    for e, (q, z, scales, g_idx, _) in enumerate(cases):
        validate_matrix(ck, FUSED, scheme, (32, 64), expert=e)
        np.testing.assert_array_equal(decode_matrix(ck, FUSED, scheme, e), reference(q, z, scales, g_idx))


def test_dynamic_rules_pick_bits_per_module(tmp_path):
    """GPTQModel's dynamic: "+:regex" overrides bits for the modules it matches, "-:regex" leaves them unquantized."""
    rng = np.random.default_rng(5)
    q8, z8, s8, g8, t8 = _case(rng, 64, 16, 8, 32, True, True, False, "F16")
    q4, z4, s4, g4, t4 = _case(rng, 64, 16, 4, 32, True, True, False, "F16")
    up = BASE.replace("down_proj", "up_proj")
    tensors = {**{f"{BASE}.{s}": v for s, v in t8.items()}, **{f"{up}.{s}": v for s, v in t4.items()}}
    config = _config(4, 32, True, dynamic={r"+:.*down_proj$": {"bits": 8}, r"-:.*mlp\.gate$": {}})
    ck = _save(tmp_path, tensors, config)
    scheme = detect_scheme(ck.config)
    np.testing.assert_array_equal(decode_matrix(ck, BASE, scheme), reference(q8, z8, s8, g8))
    np.testing.assert_array_equal(decode_matrix(ck, up, scheme), reference(q4, z4, s4, g4))
    assert scheme.group_for("model.layers.0.mlp.gate") is None


@pytest.mark.parametrize("qc, message", [
    ({"bits": 3}, "bad bits"), ({"group_size": 0}, "bad group_size"),
    ({"checkpoint_format": "marlin"}, "unsupported GPTQ checkpoint_format"),
    ({"is_marlin_format": True}, "Marlin-repacked"),
])
def test_unreadable_configs_are_refused(qc, message):
    config = _config()
    config["quantization_config"].update(qc)
    with pytest.raises(InputError, match=rf"config.json: quantization_config: {message}"):
        detect_scheme(config)


# ---------------------------------------------------------------- tiny checkpoints, end to end

VARIANTS = {"gptq-int4": (4, True), "gptq-int8": (8, True), "gptq-int4-asym": (4, True),
            "gptq-int4-actorder": (4, True), "gptq-v2-int4-asym": (4, False)}


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("dtype", list(VARIANTS))
def test_tiny_checkpoint_decodes_converts_and_verifies(tiny_model, tmp_path, dtype):
    import ktconvert.examples.tiny_quantized  # noqa: F401  (registers the gptq writers)

    bits, v1 = VARIANTS[dtype]
    src = tiny_model("qwen3_moe", dtype=dtype)
    ck = Checkpoint.open(src)
    scheme = detect_scheme(ck.config)
    for e in (0, 5):
        for p in ("gate_proj", "down_proj"):
            base = f"model.layers.1.mlp.experts.{e}.{p}"
            np.testing.assert_array_equal(decode_matrix(ck, base, scheme),
                                          reference_from_tensors(ck, base, bits, v1, 32), base)
    inspected = _run("inspect", src)
    assert inspected.exit_code == 0 and f"gptq-int{bits}" in inspected.output, inspected.output
    if dtype in ("gptq-int4", "gptq-int4-actorder", "gptq-v2-int4-asym"):
        out = tmp_path / "out"
        result = _run("cpu", src, out, "--method", "amxint4", "--quiet")
        assert result.exit_code == 0, result.output
        result = _run("verify", out, "--source", src)
        assert result.exit_code == 0, result.output


def test_fused_tiny_checkpoint_decodes_each_slice(tiny_model):
    import ktconvert.examples.tiny_quantized  # noqa: F401

    src = tiny_model("qwen3_5_moe", dtype="gptq-v2-int4-asym")
    ck = Checkpoint.open(src)
    scheme = detect_scheme(ck.config)
    fused = [n[: -len(".qweight")] for n in ck.tensors if n.endswith(".qweight") and ".experts." in n]
    assert fused and all(len(ck.tensors[f"{b}.qweight"].shape) == 3 for b in fused)
    for base in fused[:2]:
        for e in (0, 3):
            np.testing.assert_array_equal(decode_matrix(ck, base, scheme, e),
                                          reference_from_tensors(ck, base, 4, False, 32, e), base)


def test_fused_separate_relayout_reads_the_same_experts(tiny_model, tmp_path):
    """The per-expert tensors stacked into [E, ...] (fused_separate) decode to the same experts; joining gate and
    up of input-major GPTQ tensors is refused by relayout rather than written wrong."""
    import ktconvert.examples.tiny_quantized  # noqa: F401
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.examples.tiny_relayout import relayout

    src = tiny_model("qwen3_moe", dtype="gptq-v2-int4-asym")
    fused = relayout(src, tmp_path / "fs", "fused_separate", "out")
    a, b = HFSource.open(src), HFSource.open(fused)
    assert b.required_layout(1).kind == "fused_separate" and b.input_format == "gptq-int4"
    for e in range(a.info.n_experts):
        ea, eb = a.read_expert(1, e), b.read_expert(1, e)
        for p in ("gate", "up", "down"):
            np.testing.assert_array_equal(getattr(ea, p), getattr(eb, p), (e, p))
    with pytest.raises(InputError, match="does not join their gate and up"):
        relayout(src, tmp_path / "fu", "fused", "out")


def gpu_checkpoint_decodes_quantized_linears(src, out, linears: str,
                                             suffixes=("qweight", "qzeros", "scales", "g_idx")) -> None:
    """`ktconvert gpu` on a checkpoint whose attention is quantized too: none of the source's quantization tensors
    (`suffixes`, the first naming the quantized modules) is copied, each attention linear is written from its
    decoded weight (BF16 bits equal to the decoder's with --linears bf16), and verify passes."""
    result = _run("gpu", src, out, "--linears", linears)
    assert result.exit_code == 0, result.output
    result = _run("verify", out, "--source", src)
    assert result.exit_code == 0, result.output
    ck, gpu = Checkpoint.open(src), Checkpoint.open(out)
    attention = sorted(n.rsplit(".", 1)[0] for n in ck.tensors if ".self_attn." in n and n.endswith("." + suffixes[0]))
    assert attention
    assert not [n for n in gpu.tensors if n.rsplit(".", 1)[0] in attention and n.rsplit(".", 1)[-1] in suffixes]
    scheme = detect_scheme(ck.config)
    for module in attention:
        ref = gpu.tensors[f"{module}.weight"]
        if linears == "bf16":
            np.testing.assert_array_equal(gpu.read(ref.name), decode_matrix(ck, module, scheme), module)
        else:
            assert ref.dtype == "F8_E4M3" and f"{module}.weight_scale_inv" in gpu.tensors


@pytest.mark.parametrize("linears", ["bf16", "fp8"])
def test_gpu_checkpoint_decodes_quantized_attention(tiny_model, tmp_path, linears):
    import ktconvert.examples.tiny_quantized  # noqa: F401

    gpu_checkpoint_decodes_quantized_linears(tiny_model("qwen3_moe", dtype="gptq-int4-actorder"), tmp_path / "gpu",
                                             linears)


# ---------------------------------------------------------------- malformed tensors: exit 3, one line

def edited(src, dst, changes: dict):
    """A copy of checkpoint `src` with tensors replaced: changes {name: (array, safetensors dtype)}."""
    from ktconvert.examples.tiny import _save_shard

    shutil.copytree(src, dst)
    ck = Checkpoint.open(dst)
    files = {ck.tensors[name].file.name for name in changes}
    for file in files:
        tensors = {n: (ck.read(n), r.dtype) for n, r in ck.tensors.items() if r.file.name == file}
        tensors.update({n: v for n, v in changes.items() if ck.tensors[n].file.name == file})
        (dst / file).unlink()
        _save_shard(dst / file, tensors)
    return dst


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 3, (result.exit_code, result.output)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def test_malformed_tensors_exit_3_naming_file_and_tensor(tiny_model, tmp_path):
    import ktconvert.examples.tiny_quantized  # noqa: F401

    src = tiny_model("qwen3_moe", dtype="gptq-int4-actorder")
    ck = Checkpoint.open(src)
    base = "model.layers.1.mlp.experts.2.up_proj"
    shard = ck.tensors[f"{base}.qweight"].file.name
    qw, scales, g_idx = (ck.read(f"{base}.{s}") for s in ("qweight", "scales", "g_idx"))
    bad_g = g_idx.copy()
    bad_g[7] = scales.shape[0]
    cases = {
        "qweight": ({f"{base}.qweight": (qw[:-4], "I32")}, f"{base}.qweight", "do not fit"),
        "g_idx": ({f"{base}.g_idx": (bad_g, "I32")}, f"{base}.g_idx", "names a group that does not exist"),
        "scales": ({f"{base}.scales": (scales.view(np.int16).astype(np.int32), "I32")}, f"{base}.scales",
                   "wrong dtype"),
    }
    for what, (changes, tensor, message) in cases.items():
        model = edited(src, tmp_path / what, changes)
        one_line_error(_run("cpu", model, tmp_path / f"out-{what}", "--method", "amxint4", "--quiet"),
                       f"{shard}: {tensor}", message)

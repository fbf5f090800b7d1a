"""--method fp8_perchannel / gptq_int4 / mxfp8 / nvfp4 (methods/native.py): the files against independent encoders
and decoders written here from the format definitions (torch), ktconvert's own input decoders, the command line end
to end with verify, refusals, carry-over from a source already in the format, and kt-kernel 0.7.2's own forward
(marker ktkernel; its avx2 build runs GPTQ_INT4, MXFP8 and NVFP4, FP8_PERCHANNEL only runs on its amx / avx512_*
builds)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.formats.decoders import decode_matrix, detect_scheme
from ktconvert.formats.inplace_sink import InplaceSink, expert_module
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.methods import METHODS
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
E, H, I = 3, 256, 256
NAME = "model.layers.{L}.mlp.experts.{e}.{p}_proj"
SHAPES = {"gate": (I, H), "up": (I, H), "down": (H, I)}


def _matrices(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for e in range(E):
        for p, shape in SHAPES.items():
            m = (rng.standard_t(3, shape) * 0.02).astype(np.float32)
            if e == 0 and p == "gate":
                m[0] = 0.0                                    # an all-zero row / group
            if e == 1 and p == "down":
                m[1, :7] = [3.0, -2.5, 1e-6, -0.0, 0.5, 0.25, -0.125]
            out[e, p] = f32_to_bf16_bits(m)
    return out


def _write(out, method, seed=0, numa=1) -> dict:
    mats = _matrices(seed)
    sink = InplaceSink(out, method, [0], E, H, I, numa=numa)
    w = sink.begin_layer(0)
    for (e, p), m in mats.items():
        w.put_matrix(p, e, m)
    w.finish()
    src = out.parent / f"{out.name}-source"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": H,
                                                 "moe_intermediate_size": I}))
    sink.finalize(copy_from=src)
    return mats


def _tensors(out) -> dict:
    sd = {}
    for shard in out.glob("*.safetensors"):
        sd.update(st_torch.load_file(str(shard)))
    return sd


def _bits(t) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _torch_w(bits: np.ndarray):
    return torch.from_numpy(bf16_bits_to_f32(bits))


# ---------------------------------------------------------------- (1) the files, bit exact

def test_fp8_perchannel_matches_torch_reference(tmp_path):
    mats = _write(tmp_path, METHODS.get("fp8_perchannel"))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fbgemm_fp8"
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    sd = _tensors(tmp_path)
    for (e, p), w in mats.items():
        base = NAME.format(L=0, e=e, p=p)
        q, s = sd[base + ".weight"], sd[base + ".weight_scale"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (w.shape[0], 1)
        wf = _torch_w(w)
        amax = wf.abs().amax(dim=1, keepdim=True)
        want_s = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
        assert torch.equal(s, want_s), base
        assert torch.equal(q.view(torch.uint8), (wf / want_s).to(torch.float8_e4m3fn).view(torch.uint8)), base
        # W = e4m3 * s[row] in float32, RNE to BF16: the same bits through ktconvert's decoder
        ref = (q.to(torch.float32) * s).to(torch.bfloat16)
        np.testing.assert_array_equal(decode_matrix(ck, base, scheme), _bits(ref), base)


def _gptq_reference(w_bits: np.ndarray, gs: int):
    """Independent AutoGPTQ-v1 symmetric RTN in torch: (qweight int32 [K/8, N], scales f16 [K/gs, N])."""
    wf = _torch_w(w_bits)                                   # [N, K]
    n, k = wf.shape
    amax = wf.reshape(n, k // gs, gs).abs().amax(dim=2)     # [N, G]
    scale = (2 * amax / 15).to(torch.float16)
    scale[scale == 0] = 1
    q = torch.clamp(torch.round(wf / scale.float().repeat_interleave(gs, dim=1)) + 8, 0, 15).to(torch.int64)
    qt = q.T.reshape(k // 8, 8, n)                          # element k at bits 4*(k%8) of row k/8
    words = sum(qt[:, j, :] << (4 * j) for j in range(8))
    return (words & 0xFFFFFFFF).to(torch.int64), scale.T.contiguous(), q


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_gptq_int4_matches_torch_reference(tmp_path, gs):
    mats = _write(tmp_path, METHODS.get("gptq_int4").configured(gs))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["group_size"] == gs and qc["sym"] is True \
        and qc["desc_act"] is False
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    sd = _tensors(tmp_path)
    for (e, p), w in mats.items():
        base = NAME.format(L=0, e=e, p=p)
        n, k = w.shape
        words, scale, q = _gptq_reference(w, gs)
        assert sd[base + ".qweight"].dtype == torch.int32 and sd[base + ".scales"].dtype == torch.float16
        assert torch.equal(sd[base + ".qweight"].to(torch.int64) & 0xFFFFFFFF, words), base
        assert torch.equal(sd[base + ".scales"], scale), base
        assert (sd[base + ".qzeros"].view(torch.int32).numpy().view(np.uint32) == 0x77777777).all()
        assert tuple(sd[base + ".qzeros"].shape) == (k // gs, n // 8)
        assert torch.equal(sd[base + ".g_idx"], torch.arange(k, dtype=torch.int32) // gs)
        # AutoGPTQ's torch dequantization: scales * (q - z) in float16, then BF16
        ref = ((q - 8).to(torch.float16) * scale.T.repeat_interleave(gs, dim=1)).to(torch.bfloat16)
        np.testing.assert_array_equal(decode_matrix(ck, base, scheme), _bits(ref), base)


def test_mxfp8_matches_ocp_reference(tmp_path):
    method = METHODS.get("mxfp8")
    mats = _write(tmp_path, method)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp8" and qc["weight_block_size"] == [1, 32]
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    sd = _tensors(tmp_path)
    for (e, p), w in mats.items():
        base = expert_module(method, 0, e, p)
        assert base == f"model.layers.0.block_sparse_moe.experts.{e}.{dict(gate='w1', up='w3', down='w2')[p]}"
        q, x = sd[base + ".weight"], sd[base + ".weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and x.dtype == torch.uint8
        # OCP MX: shared exponent floor(log2(amax)) - emax(e4m3) = 8, codes = e4m3(w / 2^e) saturating
        wf = _torch_w(w).double()
        n, k = wf.shape
        amax = wf.reshape(n, k // 32, 32).abs().amax(dim=2)
        e_ref = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 8
        stored = torch.where(amax > 0, torch.clamp(e_ref + 127, 1, 254), torch.zeros_like(amax)).to(torch.uint8)
        assert torch.equal(x, stored), base
        scale = torch.exp2(stored.double().clamp(min=1) - 127).repeat_interleave(32, dim=1)
        want_q = torch.clamp(wf / scale, -448, 448).float().to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), base
        # decode: e4m3 * 2^(e - 127) in float32, RNE to BF16 (an all-zero group: zero codes)
        ref = (q.to(torch.float32) * torch.exp2(x.float() - 127).repeat_interleave(32, dim=1)).to(torch.bfloat16)
        np.testing.assert_array_equal(decode_matrix(ck, base, scheme), _bits(ref), base)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1_values(packed) -> "torch.Tensor":
    """uint8 [n, k/2] -> float64 [n, k]: element 2j in the low nibble, bit 3 the sign (OCP E2M1)."""
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=2).reshape(p.shape[0], -1)
    return torch.where(codes >= 8, -1.0, 1.0).double() * E2M1[codes & 7]


def test_nvfp4_matches_modelopt_reference(tmp_path):
    mats = _write(tmp_path, METHODS.get("nvfp4"))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    sd = _tensors(tmp_path)
    for (e, p), w in mats.items():
        base = NAME.format(L=0, e=e, p=p)
        packed, ws, ws2 = sd[base + ".weight"], sd[base + ".weight_scale"], sd[base + ".weight_scale_2"]
        assert packed.dtype == torch.uint8 and ws.dtype == torch.float8_e4m3fn and ws2.shape == ()
        wf = _torch_w(w)
        n, k = wf.shape
        # ModelOpt: ws2 = amax / (6 * 448), ws = e4m3(block amax / 6 / ws2), elements e2m1(w / (e4m3(ws) * ws2))
        want_ws2 = wf.abs().max() / (6 * 448)
        assert torch.equal(ws2, want_ws2), base
        want_ws = (wf.reshape(n, k // 16, 16).abs().amax(dim=2) / 6 / want_ws2).to(torch.float8_e4m3fn)
        assert torch.equal(ws.view(torch.uint8), want_ws.view(torch.uint8)), base
        block = (want_ws.float() * want_ws2).repeat_interleave(16, dim=1)
        x = (wf / torch.where(block > 0, block, torch.ones_like(block))).double().clamp(-6, 6)
        dist = (x.abs()[..., None] - E2M1).abs()
        ties = dist == dist.amin(dim=-1, keepdim=True)
        even = ties & (torch.arange(8) % 2 == 0)            # round half to the even code
        mag = torch.where(even.any(-1), even.to(torch.int8).argmax(-1), ties.to(torch.int8).argmax(-1))
        np.testing.assert_array_equal(_e2m1_values(packed).abs().numpy(), E2M1[mag].numpy(), base)
        assert ((_e2m1_values(packed) < 0) == ((x < 0) & (mag > 0))).all(), base
        # W = e2m1 * (e4m3 * ws2), float32, RNE to BF16
        ref = (_e2m1_values(packed).float() * (ws.float() * ws2).repeat_interleave(16, dim=1)).to(torch.bfloat16)
        np.testing.assert_array_equal(decode_matrix(ck, base, scheme), _bits(ref), base)


# ---------------------------------------------------------------- (2) the command line end to end

def _run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("method", [("fp8_perchannel",), ("gptq_int4",), ("gptq_int4", "--group-size", "32"),
                                    ("mxfp8",), ("nvfp4",)])
def test_cpu_then_verify(tiny_model, tmp_path, arch, method):
    src = tiny_model(arch)
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", *method, "--quiet")
    assert rc == 0, output
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert manifest["method"] == METHODS.get(method[0]).kt_method
    rc, output = _run("verify", out, "--source", src, "--hashes", "--json")
    assert rc == 0, output
    result = json.loads(output)
    assert all(c["status"] in ("ok", "skipped") for c in result["checks"]), result["checks"]
    assert result["numerics"]["layers"]


# ---------------------------------------------------------------- (4) refusals before OUT exists

@pytest.mark.parametrize("args, code, message", [
    (("--method", "gptq_int4", "--group-size", "48"), 2, "expected 32 or 64 or 128, found 48"),
    (("--method", "gptq_int4", "--numa", "4"), 3, "returns zeros"),
    (("--method", "gptq_int4", "--group-size", "64", "--numa", "8"), 3, "valid NUMA counts: [1, 2, 4]"),
    (("--method", "fp8_perchannel", "--quant", "mse"), 2, "--quant mse"),
    (("--method", "mxfp8", "--group-size", "64"), 2, "expected 32, found 64"),
    (("--method", "nvfp4", "--group-size", "32"), 2, "expected 16, found 32"),
    (("--method", "nvfp4", "--numa", "32"), 3, "I/T % 16 == 0"),
])
def test_refusals_leave_no_output(tiny_model, tmp_path, args, code, message):
    out = tmp_path / "out"
    rc, output = _run("cpu", tiny_model("qwen3_moe"), out, *args)
    assert rc == code and message in output, output
    assert not out.exists()


def test_methods_and_runtime_notes():
    rc, output = _run("methods")
    assert rc == 0
    assert "FP8_PERCHANNEL" in output and "needs AVX-512" in output and "group sizes 32/64/128" in output
    fp8c = METHODS.get("fp8_perchannel")
    assert any("no AVX2 kernel" in n for n in fp8c.runtime_notes(["avx2"]))
    assert fp8c.runtime_notes(["avx2", "avx512f"]) == []
    assert METHODS.get("gptq_int4").runtime_notes(["avx2"]) == []
    assert METHODS.get("gptq_int4").group_size == 128


# ---------------------------------------------------------------- (5) carry-over from a source in the format

def _raw(folder) -> dict:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        data = shard.read_bytes()
        n = int.from_bytes(data[:8], "little")
        for name, info in json.loads(data[8:8 + n]).items():
            if name != "__metadata__":
                b, e = info["data_offsets"]
                out[name] = (info["dtype"], tuple(info["shape"]), data[8 + n + b:8 + n + e])
    return out


@pytest.mark.parametrize("dtype, method", [("gptq-int4", ("gptq_int4", "--group-size", "32")),
                                           ("fp8-channel", ("fp8_perchannel",)), ("mxfp8", ("mxfp8",)),
                                           ("nvfp4", ("nvfp4",))])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_carry_over_is_byte_identical(tiny_model, tmp_path, dtype, method, arch):
    src = tiny_model(arch, dtype=dtype)
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", *method, "--quiet")
    assert rc == 0, output
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert manifest["carried_over"]["source_format"]
    theirs, ours = _raw(src), _raw(out)
    experts = [n for n in ours if ".experts." in n]
    assert len(experts) == len([n for n in theirs if ".experts." in n])
    # the same bytes under the method's names (mxfp8 renames qwen3's gate/up/down_proj to w1/w3/w2)
    assert sorted(v for v in ours.values()) == sorted(v for n, v in theirs.items() if ".experts." in n)
    rc, output = _run("verify", out, "--source", src, "--hashes", "--json", "--sample-experts", "all")
    assert rc == 0, output
    assert all(r["weight_rel_l2"] == 0.0 for r in json.loads(output)["numerics"]["layers"])


@pytest.mark.parametrize("dtype, method", [("gptq-int4", ("gptq_int4",)),             # g32 source, g128 output
                                           ("gptq-int4-actorder", ("gptq_int4", "--group-size", "32")),
                                           ("gptq-int4-asym", ("gptq_int4", "--group-size", "32")),
                                           ("mxfp8", ("fp8_perchannel",)), ("fp8-channel", ("mxfp8",))])
def test_other_formats_are_converted(tiny_model, tmp_path, dtype, method):
    out = tmp_path / "out"
    rc, output = _run("cpu", tiny_model("qwen3_moe", dtype=dtype), out, "--method", *method, "--quiet")
    assert rc == 0, output
    assert "carried_over" not in json.loads((out / "ktconvert.json").read_text())


# ---------------------------------------------------------------- (3) kt-kernel's own forward

def _backend(kt_method: str) -> str:
    """The kt-kernel backend flag a method runs on: NVFP4 on the (AVX2) MXFP4 FP4 kernel."""
    return "MXFP4" if kt_method == "NVFP4" else kt_method


def _independent_decode(sd: dict, base: str) -> np.ndarray:
    """float64 [n, k] from the stored tensors by the format definitions (as kt-kernel's loaders read them)."""
    if base + ".qweight" in sd:                       # GPTQ: element k at bits 4*(k%8) of row k/8, (q - 8) * s
        words = sd[base + ".qweight"].to(torch.int64) & 0xFFFFFFFF
        q = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=1).reshape(-1, words.shape[1])
        s = sd[base + ".scales"].to(torch.float64)
        gs = q.shape[0] // s.shape[0]
        return ((q - 8).to(torch.float64) * s.repeat_interleave(gs, dim=0)).T.numpy()
    if base + ".weight_scale_2" in sd:                # NVFP4: e2m1 * e4m3 * ws2
        s = (sd[base + ".weight_scale"].to(torch.float64) * sd[base + ".weight_scale_2"].double())
        return (_e2m1_values(sd[base + ".weight"]) * s.repeat_interleave(16, dim=1)).numpy()
    scale = sd[base + ".weight_scale_inv" if base + ".weight_scale_inv" in sd else base + ".weight_scale"]
    if scale.dtype == torch.uint8:                     # MXFP8: E8M0 exponent per 32 in-features, 0 -> 0.0
        mult = torch.where(scale == 0, 0.0, torch.exp2(scale.to(torch.float64) - 127)).repeat_interleave(32, dim=1)
        return (sd[base + ".weight"].to(torch.float64) * mult).numpy()
    return (sd[base + ".weight"].to(torch.float64) * scale.to(torch.float64)).numpy()


def _kt_forward_rel_l2(path, kt_method: str, numa: int) -> float:
    from ktkernel_util import ktkernel_forward, reference_moe_forward, relative_l2

    sd = _tensors(path)
    method = METHODS.get(kt_method)
    mats = {p: np.stack([_independent_decode(sd, expert_module(method, 0, e, p)) for e in range(E)]) for p in SHAPES}
    rng = np.random.default_rng(1)
    x = f32_to_bf16_bits(rng.standard_normal((6, H)).astype(np.float32))
    ids = np.array([[0, 1], [2, 0], [1, 2], [0, 2], [2, 1], [1, 0]])
    wts = np.full((6, 2), 0.5, np.float32)
    got = ktkernel_forward(path, kt_method, num_experts=E, hidden=H, intermediate=I, threadpool_count=numa,
                           x_bf16=x, topk_ids=ids, topk_weights=wts, layer_idx=0)
    want = reference_moe_forward(bf16_bits_to_f32(x).astype(np.float64), ids, wts, mats["gate"], mats["up"],
                                 mats["down"])
    return relative_l2(got, want)


@pytest.mark.ktkernel
@pytest.mark.parametrize("name, gs, numa", [("gptq_int4", 32, 1), ("gptq_int4", 64, 2), ("gptq_int4", 128, 1),
                                            ("gptq_int4", 128, 2), ("mxfp8", 32, 1), ("mxfp8", 32, 2),
                                            ("nvfp4", 16, 1), ("nvfp4", 16, 2),
                                            ("fp8_perchannel", None, 1)])
def test_ktkernel_forward_agrees_with_the_decoded_files(tmp_path, name, gs, numa):
    from ktkernel_util import native_skip_reason

    method = METHODS.get(name)
    reason = native_skip_reason(_backend(method.kt_method))
    if reason:
        pytest.skip(reason + (" (kt-kernel 0.7.2 has no AVX2 kernel for it: amx / avx512_* builds only)"
                              if method.needs_avx512 else ""))
    _write(tmp_path, method.configured(gs), seed=gs or 0, numa=numa)
    # measured on an AVX2-only AMD EPYC (kt-kernel 0.7.2 avx2 build: AVX2GPTQInt4_MOE, AVX2MXFP8_MOE), two seeds:
    # GPTQ_INT4 0.36-0.44 % (g32 / g64 / g128, T = 1 and 2), MXFP8 0.36-0.42 %, NVFP4 0.50-0.52 % (on AVX2MXFP4_MOE)
    assert _kt_forward_rel_l2(tmp_path, method.kt_method, numa) < 0.02


@pytest.mark.parametrize("arch, dtype, method, as_is", [
    ("qwen3_moe", "gptq-int4", "gptq_int4", True),           # any group size kt-kernel runs (this one: 32)
    ("qwen3_moe", "gptq-int4-actorder", "gptq_int4", False),  # kt-kernel refuses desc_act: true
    ("qwen3_moe", "gptq-int4-asym", "gptq_int4", False),      # ... and sym: false
    ("qwen3_moe", "fp8-channel", "fp8_perchannel", True),
    ("minimax_m2", "mxfp8", "mxfp8", True),
    ("qwen3_moe", "mxfp8", "mxfp8", False),                   # kt-kernel's MXFP8 loader reads MiniMax names only
    ("qwen3_moe", "nvfp4", "nvfp4", True),
])
def test_inspect_says_what_kt_kernel_reads_as_is(tiny_model, arch, dtype, method, as_is):
    from ktconvert.formats.sources import open_source

    src = open_source(tiny_model(arch, dtype=dtype))
    assert bool(METHODS.get(method).reads_as_is(src)) is as_is


@pytest.mark.ktkernel
@pytest.mark.parametrize("arch, method", [("qwen3_moe", ("gptq_int4",)), ("deepseek_v3", ("gptq_int4", "--group-size",
                                                                                          "64")),
                                          ("mixtral", ("mxfp8",)), ("qwen3_moe", ("mxfp8",)),
                                          ("glm4_moe", ("nvfp4",))])
def test_ktkernel_forward_on_cli_output(tiny_model, tmp_path, arch, method):
    """What `ktconvert cpu` writes for a whole tiny model, loaded by kt-kernel from OUT as --kt-weight-path."""
    from ktkernel_util import ktkernel_forward, native_skip_reason, reference_moe_forward, relative_l2

    m = METHODS.get(method[0])
    reason = native_skip_reason(_backend(m.kt_method))
    if reason:
        pytest.skip(reason)
    out = tmp_path / "out"
    rc, output = _run("cpu", tiny_model(arch), out, "--method", *method, "--quiet")
    assert rc == 0, output
    model = json.loads((out / "ktconvert.json").read_text())["model"]
    layer, n_exp, hidden, inter = model["layers"][0], model["experts"], model["hidden"], model["intermediate"]
    sd = _tensors(out)
    mats = {p: np.stack([_independent_decode(sd, expert_module(m, layer, e, p)) for e in range(n_exp)])
            for p in SHAPES}
    rng = np.random.default_rng(2)
    x = f32_to_bf16_bits(rng.standard_normal((5, hidden)).astype(np.float32))
    ids = np.stack([rng.choice(n_exp, 2, replace=False) for _ in range(5)])
    wts = np.full((5, 2), 0.5, np.float32)
    got = ktkernel_forward(out, m.kt_method, num_experts=n_exp, hidden=hidden, intermediate=inter,
                           threadpool_count=1, x_bf16=x, topk_ids=ids, topk_weights=wts, layer_idx=layer)
    want = reference_moe_forward(bf16_bits_to_f32(x).astype(np.float64), ids, wts, mats["gate"], mats["up"],
                                 mats["down"])
    assert relative_l2(got, want) < 0.02


@pytest.mark.parametrize("method", ["gptq_int4", "mxfp8", "nvfp4", "fp8_perchannel"])
def test_check_identifies_the_output(tiny_model, tmp_path, method):
    """`ktconvert check OUT` (the launch-flag checker, headers only) names the method the files are for."""
    out = tmp_path / "out"
    rc, output = _run("cpu", tiny_model("qwen3_moe"), out, "--method", method, "--quiet")
    assert rc == 0, output
    rc, output = _run("check", out)
    assert f"works: --kt-method {METHODS.get(method).kt_method} " in output, output

"""--method mxfp4 (methods/mxfp4.py): the files against an OCP MX encoder and an E2M1 / E8M0 decoder written here from
the format definitions, --quant mse against rtn, the command line end to end with verify, refusals before OUT exists,
bytes carried over from DeepSeek-V4 experts and reproduced from gpt-oss's, and kt-kernel 0.7.2's own MXFP4 forward on
the files (marker ktkernel; its avx2 build runs MXFP4 on the AVX2 FP4 kernel)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert import api
from ktconvert.cli.main import cli
from ktconvert.distributed.merge import merge
from ktconvert.examples.tiny_deepseek_v4 import make_tiny_deepseek_v4
from ktconvert.formats.decoders import decode_matrix, detect_scheme
from ktconvert.formats.inplace_sink import InplaceSink, expert_module
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.formats.st_writer import StreamingSafetensorsWriter
from ktconvert.methods import METHODS

E, H, I = 3, 256, 256
SHAPES = {"gate": (I, H), "up": (I, H), "down": (H, I)}
W_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
# OCP E2M1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit): the magnitudes of codes 0..7
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits, round to nearest even (the input side only)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _widen(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _matrices(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for e in range(E):
        for p, shape in SHAPES.items():
            m = (rng.standard_t(3, shape) * 0.02).astype(np.float32)
            if e == 0 and p == "gate":
                m[0] = 0.0                                           # all-zero groups
            if e == 1 and p == "down":
                m[1, :32] = 0.0
                m[1, :8] = [3.0, -2.5, 1e-6, -0.0, 0.75, 0.25, -0.125, 3.5]    # ties at 5 and 0.25, 7 saturates
            if e == 2 and p == "up":
                m[2, :32] = 1.25                                     # 1.25 / 2^-2 = 5: a tie between 4 and 6
            out[e, p] = _bf16_bits(m)
    return out


def _write(out, method, seed=0, numa=1, quant="rtn") -> dict:
    mats = _matrices(seed)
    sink = InplaceSink(out, method, [0], E, H, I, numa=numa)
    w = sink.begin_layer(0)
    for (e, p), m in mats.items():
        method.write_matrix(w, p, e, m, numa=numa, quant=quant, where=p)
    w.finish()
    src = out.parent / f"{out.name}-source"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": H,
                                                 "moe_intermediate_size": I}))
    sink.finalize(copy_from=src)
    return mats


def _raw(folder) -> dict:
    """{name: (dtype, shape, bytes)} of every tensor in the folder's shards, from the safetensors headers."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        data = shard.read_bytes()
        n = int.from_bytes(data[:8], "little")
        for name, info in json.loads(data[8:8 + n]).items():
            if name != "__metadata__":
                b, e = info["data_offsets"]
                out[name] = (info["dtype"], tuple(info["shape"]), data[8 + n + b:8 + n + e])
    return out


def _u8(entry) -> np.ndarray:
    return np.frombuffer(entry[2], np.uint8).reshape(entry[1])


def ocp_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 MXFP4, float64: per 32-group, X = floor(log2(amax)) - emax(E2M1) = -2 (stored X + 127; an all-zero
    group stores 0 here), elements round-to-nearest-even into E2M1 with saturation at 6. -> (codes uint8 [n, k]
    with bit 3 the sign, stored uint8 [n, k/32])."""
    n, k = w.shape
    g = w.astype(np.float64).reshape(n, k // 32, 32)
    amax = np.abs(g).max(axis=2)
    x = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
    stored = np.where(amax > 0, np.clip(x + 127, 1, 254), 0)
    v = np.minimum(np.abs(g) / np.exp2(np.clip(x, -126, 127))[:, :, None], 6.0)
    dist = np.abs(v[..., None] - E2M1)
    ties = dist == dist.min(axis=-1, keepdims=True)
    even = ties & (np.arange(8) % 2 == 0)
    mag = np.where(even.any(-1), even.argmax(-1), ties.argmax(-1))
    codes = mag | (((g < 0) & (mag > 0)) << 3)
    return codes.reshape(n, k).astype(np.uint8), stored.astype(np.uint8)


def reference_decode(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """kt-kernel's MXFP4 loader's reading, float64: byte j holds element 2j (low nibble) and 2j+1 (high nibble),
    W = +-E2M1[code & 7] * 2^(e - 127)."""
    w = np.asarray(weight).view(np.uint8)
    codes = np.stack([w & 0xF, w >> 4], axis=-1).reshape(w.shape[0], -1)
    values = np.where(codes >= 8, -1.0, 1.0) * E2M1[codes & 7]
    return values * np.repeat(np.exp2(np.asarray(scale, np.float64) - 127), 32, axis=1)


def _exact_bf16(values: np.ndarray) -> np.ndarray:
    """float64 values exactly representable in BF16 -> their bits (asserts exactness)."""
    f = values.astype(np.float32)
    assert np.array_equal(f.astype(np.float64), values)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(_widen(bits).astype(np.float64), values)
    return bits


# ---------------------------------------------------------------- (1) the files, bit exact

def test_files_match_ocp_reference(tmp_path):
    method = METHODS.get("mxfp4")
    mats = _write(tmp_path, method)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["expert_dtype"] == "fp4" and qc["weight_block_size"] == [1, 32]
    raw = _raw(tmp_path)
    assert len(raw) == 2 * 3 * E
    ck = Checkpoint.open(tmp_path)
    scheme = detect_scheme(ck.config)
    for (e, p), w in mats.items():
        base = expert_module(method, 0, e, p)
        assert base == f"model.layers.0.ffn.experts.{e}.{W_NAMES[p]}"
        weight, scale = raw[base + ".weight"], raw[base + ".scale"]
        n, k = w.shape
        assert weight[:2] == ("I8", (n, k // 2)) and scale[:2] == ("F8_E8M0", (n, k // 32))
        codes, stored = ocp_reference(_widen(w))
        np.testing.assert_array_equal(_u8(scale), stored, base)
        np.testing.assert_array_equal(_u8(weight), (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), base)
        # ktconvert reads its own output back (verify does): the exact values, as BF16
        want = _exact_bf16(reference_decode(_u8(weight), _u8(scale)))
        np.testing.assert_array_equal(decode_matrix(ck, base, scheme), want, base)


def test_mse_is_never_worse_than_rtn_per_group(tmp_path):
    method = METHODS.get("mxfp4")
    mats = _write(tmp_path / "rtn", method)
    _write(tmp_path / "mse", method, quant="mse")
    rtn, mse = _raw(tmp_path / "rtn"), _raw(tmp_path / "mse")
    total = {"rtn": 0.0, "mse": 0.0}
    moved = 0
    for (e, p), w in mats.items():
        base = expert_module(method, 0, e, p)
        wf = _widen(w).astype(np.float64)
        n, k = wf.shape
        err = {}
        for name, files in (("rtn", rtn), ("mse", mse)):
            d = reference_decode(_u8(files[base + ".weight"]), _u8(files[base + ".scale"])) - wf
            err[name] = (d * d).reshape(n, k // 32, 32).sum(axis=2)
            total[name] += float(err[name].sum())
        assert (err["mse"] <= err["rtn"]).all(), base
        shift = _u8(mse[base + ".scale"]).astype(int) - _u8(rtn[base + ".scale"]).astype(int)
        assert set(np.unique(shift)) <= {-1, 0, 1}, base                      # OCP's exponent or a neighbour
        moved += int((shift != 0).sum())
    assert moved > 0 and total["mse"] < 0.97 * total["rtn"], (moved, total)


# ---------------------------------------------------------------- (2) the command line end to end

def _run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.mark.parametrize("arch, quant", [("qwen3_moe", "rtn"), ("deepseek_v3", "rtn"), ("mixtral", "mse")])
def test_cpu_then_verify(tiny_model, tmp_path, arch, quant):
    src = tiny_model(arch)
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", "mxfp4", "--quant", quant, "--quiet")
    assert rc == 0, output
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert manifest["method"] == "MXFP4" and manifest["group_size"] == 32 and "carried_over" not in manifest
    rc, output = _run("verify", out, "--source", src, "--hashes", "--json")
    assert rc == 0, output
    result = json.loads(output)
    assert all(c["status"] in ("ok", "skipped") for c in result["checks"]), result["checks"]
    # measured on the tiny heavy-tailed models: MoE output rel L2 0.24-0.28 (E2M1 with power-of-two scales)
    assert 0 < max(r["moe_rel_l2"] for r in result["numerics"]["layers"]) < 0.4
    rc, output = _run("check", out)                      # the launch-flag checker names the method from the headers
    assert rc == 0 and "works: --kt-method MXFP4 " in output, output


@pytest.mark.parametrize("args, message", [
    (("--group-size", "64"), "expected 32, found 64"),
    (("--quant", "gptq"), "expected rtn or mse, found gptq"),
])
def test_refusals_leave_no_output(tiny_model, tmp_path, args, message):
    out = tmp_path / "out"
    rc, output = _run("cpu", tiny_model("qwen3_moe"), out, "--method", "mxfp4", *args)
    assert rc == 2 and message in output, output
    assert not out.exists()


def test_numa_parts_must_hold_whole_groups():
    method = METHODS.get("mxfp4")
    assert method.valid_numa(256, 256) == [1, 2, 4, 8]          # I/T % 32 == 0
    assert not all(c["ok"] for c in method.alignment_checks(256, 256, 16))


# ---------------------------------------------------------------- (3) bytes of sources already in the format

def test_deepseek_v4_experts_are_carried_over(tmp_path):
    src = make_tiny_deepseek_v4(tmp_path / "src", layers=2, experts=4)
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", "mxfp4", "--quiet")
    assert rc == 0, output
    assert json.loads((out / "ktconvert.json").read_text())["carried_over"]["source_format"].startswith("DeepSeek-V4")
    theirs, ours = _raw(src), _raw(out)
    experts = {n: v for n, v in theirs.items() if ".ffn.experts." in n}
    assert len(ours) == len(experts) == 2 * 4 * 3 * 2
    assert ours == {"model." + n: v for n, v in experts.items()}              # names, dtypes, shapes and bytes
    rc, output = _run("verify", out, "--source", src, "--hashes", "--json", "--sample-experts", "all")
    assert rc == 0, output
    assert all(r["weight_rel_l2"] == 0.0 for r in json.loads(output)["numerics"]["layers"])


def test_gpt_oss_mxfp4_comes_back_byte_for_byte(tiny_model, tmp_path):
    """gpt-oss's fused MXFP4 (OCP rounding) is decoded and encoded again, not carried (the layouts differ: fused,
    gate/up interleaved): OCP's encoder gives every group its exponent and codes back."""
    src = tiny_model("gpt_oss", dtype="mxfp4")
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", "mxfp4", "--allow-drop-bias", "--quiet")   # kt has no biases
    assert rc == 0, output
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert "carried_over" not in manifest
    theirs, ours = _raw(src), _raw(out)
    for layer in manifest["model"]["layers"]:
        blocks = {role: _u8(theirs[f"model.layers.{layer}.mlp.experts.{role}_proj_blocks"]) for role in ("gate_up",
                                                                                                        "down")}
        scales = {role: _u8(theirs[f"model.layers.{layer}.mlp.experts.{role}_proj_scales"]) for role in ("gate_up",
                                                                                                        "down")}
        for e in range(manifest["model"]["experts"]):
            rows = {"gate": ("gate_up", slice(0, None, 2)), "up": ("gate_up", slice(1, None, 2)),
                    "down": ("down", slice(None))}
            for proj, (role, sel) in rows.items():
                base = f"model.layers.{layer}.ffn.experts.{e}.{W_NAMES[proj]}"
                b = blocks[role][e][sel]
                np.testing.assert_array_equal(_u8(ours[base + ".weight"]), b.reshape(b.shape[0], -1), base)
                np.testing.assert_array_equal(_u8(ours[base + ".scale"]), scales[role][e][sel], base)


# ---------------------------------------------------------------- (4) kt-kernel's own forward

def _kt_rel_l2(path, numa: int, layer: int, experts: int, hidden: int, inter: int, seed: int) -> float:
    from ktkernel_util import ktkernel_forward, reference_moe_forward, relative_l2

    raw = _raw(path)
    mats = {p: np.stack([reference_decode(_u8(raw[f"model.layers.{layer}.ffn.experts.{e}.{W_NAMES[p]}.weight"]),
                                          _u8(raw[f"model.layers.{layer}.ffn.experts.{e}.{W_NAMES[p]}.scale"]))
                         for e in range(experts)]) for p in SHAPES}
    rng = np.random.default_rng(seed)
    x = _bf16_bits(rng.standard_normal((6, hidden)).astype(np.float32))
    ids = np.stack([rng.choice(experts, 2, replace=False) for _ in range(6)])
    wts = np.full((6, 2), 0.5, np.float32)
    got = ktkernel_forward(path, "MXFP4", num_experts=experts, hidden=hidden, intermediate=inter,
                           threadpool_count=numa, x_bf16=x, topk_ids=ids, topk_weights=wts, layer_idx=layer)
    want = reference_moe_forward(_widen(x).astype(np.float64), ids, wts, mats["gate"], mats["up"], mats["down"])
    return relative_l2(got, want)


def _skip_without_mxfp4():
    from ktkernel_util import native_skip_reason

    reason = native_skip_reason("MXFP4")
    if reason:
        pytest.skip(reason)


@pytest.mark.ktkernel
@pytest.mark.parametrize("numa, quant", [(1, "rtn"), (2, "rtn"), (8, "mse")])
def test_ktkernel_forward_agrees_with_the_decoded_files(tmp_path, numa, quant):
    _skip_without_mxfp4()
    _write(tmp_path, METHODS.get("mxfp4"), seed=numa, numa=numa, quant=quant)
    # measured on an AVX2-only AMD EPYC (kt-kernel 0.7.2 avx2 build, AVX2MXFP4_MOE): 0.36-0.39 % (T = 1, 2, 8)
    assert _kt_rel_l2(tmp_path, numa, 0, E, H, I, seed=1) < 0.02


@pytest.mark.ktkernel
def test_ktkernel_forward_on_carried_deepseek_v4_experts(tmp_path):
    _skip_without_mxfp4()
    src = make_tiny_deepseek_v4(tmp_path / "src", layers=2, experts=4)
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", "mxfp4", "--quiet")
    assert rc == 0, output
    assert _kt_rel_l2(out, 1, 1, 4, 256, 128, seed=3) < 0.02


@pytest.mark.parametrize("source", ["deepseek_v4", "qwen3_moe"])
def test_parts_merge_equal_single_run(tiny_model, tmp_path, source):
    """Per-layer parts (carried-over and encoded alike) merge into the single run's bytes, every file."""
    src = make_tiny_deepseek_v4(tmp_path / "src") if source == "deepseek_v4" else tiny_model(source)
    options = dict(method="mxfp4", quant="mse", numa=2)
    api.convert_cpu(src, tmp_path / "single", **options)
    parts = [tmp_path / f"part-{layer}" for layer in (1, 0)]
    for part in parts:
        api.convert_cpu(src, part, layers=part.name.split("-")[1], **options)
    merge(tmp_path / "merged", parts)
    files = {folder: {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
                      if p.is_file()} for folder in (tmp_path / "single", tmp_path / "merged")}
    assert files[tmp_path / "merged"] == files[tmp_path / "single"]


def test_compressed_tensors_mxfp4_experts_are_carried_over(tiny_model, tmp_path):
    """compressed-tensors mxfp4-pack-quantized experts (written here: OCP encoder, weight_packed U8 + weight_scale U8)
    are kt-kernel's MXFP4 bytes under other names and dtype labels: carried over, renamed, bytes unchanged."""
    bf16 = tiny_model("qwen3_moe")
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                      "weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                  "strategy": "group", "group_size": 32},
                                      "format": "mxfp4-pack-quantized"}}}
    (src / "config.json").write_text(json.dumps(config))
    tensors, packed = {}, {}
    for name, (dtype, shape, data) in _raw(bf16).items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            codes, stored = ocp_reference(_widen(np.frombuffer(data, np.uint16).reshape(shape)))
            base = name[: -len(".weight")]
            packed[base] = ((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), stored)
            tensors[base + ".weight_packed"], tensors[base + ".weight_scale"] = (packed[base][0], "U8"), \
                (stored, "U8")
        else:
            tensors[name] = (np.frombuffer(data, {"BF16": np.uint16, "F32": np.float32}[dtype]).reshape(shape), dtype)
    specs = [(name, dtype, array.shape) for name, (array, dtype) in tensors.items()]
    with StreamingSafetensorsWriter(src / "model.safetensors", specs, metadata={"format": "pt"}) as writer:
        for name, (array, _) in tensors.items():
            writer.write(name, array)
    out = tmp_path / "out"
    rc, output = _run("cpu", src, out, "--method", "mxfp4", "--quiet")
    assert rc == 0, output
    assert "compressed-tensors" in json.loads((out / "ktconvert.json").read_text())["carried_over"]["source_format"]
    ours = _raw(out)
    assert len(ours) == 2 * len(packed)
    for base, (weight, scale) in packed.items():
        layer, e, proj = base.split(".")[2], base.split(".")[5], base.split(".")[6][: -len("_proj")]
        mine = f"model.layers.{layer}.ffn.experts.{e}.{W_NAMES[proj]}"
        assert ours[mine + ".weight"] == ("I8", weight.shape, weight.tobytes()), mine
        assert ours[mine + ".scale"] == ("F8_E8M0", scale.shape, scale.tobytes()), mine
    rc, output = _run("verify", out, "--source", src, "--hashes", "--json", "--sample-experts", "all")
    assert rc == 0, output
    assert all(r["weight_rel_l2"] == 0.0 for r in json.loads(output)["numerics"]["layers"])

"""The verification runtime's RAWINT4 weight type (kt-format.md §2.6) and ``ktconvert verify``'s RAWINT4 numerics.

Golden values: a reference written here from the format definition, element by element: weight_packed's int32
words as little-endian bytes, byte j holding column 2j in its low nibble and 2j+1 in its high nibble, each stored
q + 8; w = q * the BF16 scale of the column's group, in float64. ktconvert's own decoders are not used.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import EXIT_VERIFY, NativeError, ShapeError, VerifyError
from ktconvert.native import forward as rt
from check_folders import write_safetensors

pytestmark = pytest.mark.skipif(not rt.available(), reason="native library not built")
ROOT = Path(__file__).resolve().parents[1]
ALL_IMPLS = ("scalar", "avx2", "avx512")


@pytest.fixture(params=ALL_IMPLS)
def impl(request):
    """Every implementation of the dispatch table; one this CPU cannot run is skipped, saying what it lacks."""
    try:
        rt.impl_id(request.param)
    except NativeError as exc:
        pytest.skip(f"{request.param} RAWINT4 kernels are compiled in but cannot run on this CPU ({exc})")
    return request.param


# ---- the format definition, element by element ------------------------------------------------------------------

def spec_weights(packed: np.ndarray, scale_bits: np.ndarray, group: int) -> np.ndarray:
    """float64 [n, k] from weight_packed int32 [n, k/8] and weight_scale BF16 bits uint16 [n, k/group]."""
    n, words = packed.shape
    data = packed.astype("<i4").tobytes()
    q = np.empty((n, words * 8), np.float64)
    for r in range(n):
        for j in range(words * 4):
            byte = data[r * words * 4 + j]
            q[r, 2 * j] = (byte & 0x0F) - 8
            q[r, 2 * j + 1] = (byte >> 4) - 8
    scale = np.array([[struct.unpack("<f", struct.pack("<I", int(b) << 16))[0] for b in row] for row in scale_bits])
    return q * np.repeat(scale, group, axis=1)


def random_matrix(rng, n: int, k: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight_packed int32 [n, k/8] of arbitrary words: every nibble value; weight_scale BF16 bits [n, k/group]
    of both signs, one zero where there are several)."""
    packed = rng.integers(-2**31, 2**31, (n, k // 8), dtype=np.int64).astype(np.int32)
    scale = rng.uniform(-0.05, 0.05, (n, k // group)).astype(np.float32)
    scale.flat[0] = 0.0 if scale.size > 1 else scale.flat[0]
    return packed, (scale.view(np.uint32) >> 16).astype(np.uint16)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def silu_mul(g, u):
    return g / (1.0 + np.exp(-g)) * u


@pytest.mark.parametrize("n,k,group", [(5, 64, 32), (33, 256, 128), (64, 7168, 32), (17, 96, 24), (3, 48, 8),
                                       (40, 512, 64), (1, 32, 32)])
def test_gemm_matches_the_format_definition(impl, n, k, group):
    rng = np.random.default_rng(n * 7 + k + group)
    packed, scale = random_matrix(rng, n, k, group)
    w = spec_weights(packed, scale, group)
    for tokens in (1, 3, 7):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        got = rt.gemm("RAWINT4", packed, scale, n, k, x, impl=impl, threads=2)
        assert got.shape == (tokens, n) and got.dtype == np.float32
        assert rel_l2(got, x.astype(np.float64) @ w.T) < 1e-5
    as_bytes = rt.gemm("RAWINT4", packed.view(np.uint8), scale, n, k, x[0], impl=impl, group=group)
    assert as_bytes.shape == (n,) and np.array_equal(as_bytes, got[0])


def test_results_do_not_depend_on_thread_count(impl):
    rng = np.random.default_rng(3)
    packed, scale = random_matrix(rng, 200, 1024, 32)
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    one = rt.gemm("RAWINT4", packed, scale, 200, 1024, x, impl=impl, threads=1)
    for threads in (2, 3, 8, 64):
        assert np.array_equal(one, rt.gemm("RAWINT4", packed, scale, 200, 1024, x, impl=impl, threads=threads))
    parts = rt.rawint4_parts(*(random_matrix(rng, *shape, 32) for shape in ((256, 128), (256, 128), (128, 256))), 2)
    xs = rng.standard_normal((3, 128)).astype(np.float32)
    first = rt.expert_forward("RAWINT4", 128, 128, parts, xs, impl=impl, threads=1)
    assert np.array_equal(first, rt.expert_forward("RAWINT4", 128, 128, parts, xs, impl=impl, threads=5))


@pytest.mark.parametrize("numa", [1, 2, 4])
def test_moe_forward_splits_numa_parts_as_ktkernel(impl, numa):
    """Parts are views into the whole matrices (gate/up row ranges, down column ranges of every row with the
    matching scale groups); the forward of the split layer equals a float64 reference on the whole matrices."""
    hidden, inter, group, experts, tokens = 256, 256, 32, 3, 5
    rng = np.random.default_rng(numa)
    layer = [[random_matrix(rng, n, k, group) for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]
             for _ in range(experts)]
    parts = {e: rt.rawint4_parts(*layer[e], numa) for e in range(experts)}
    part = inter // numa
    down_w, down_s = parts[0][numa - 1][2]
    assert np.shares_memory(down_w, layer[0][2][0]) and down_w.shape == (hidden, part // 2)
    assert np.array_equal(down_w, layer[0][2][0].view(np.uint8)[:, (numa - 1) * part // 2:])
    assert np.array_equal(down_s, layer[0][2][1][:, (numa - 1) * part // group:])
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(experts, 2, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, 2)).astype(np.float32)
    got = np.zeros((tokens, hidden), np.float32)
    for e in range(experts):          # one expert at a time into the same output
        rt.moe_forward("RAWINT4", hidden, part, {e: parts[e]}, x, ids, weights, out=got, impl=impl, threads=2)
    want = np.zeros((tokens, hidden))
    x64 = x.astype(np.float64)
    for e in range(experts):
        gate, up, down = (spec_weights(p, s, group) for p, s in layer[e])
        out_e = silu_mul(x64 @ gate.T, x64 @ up.T) @ down.T
        for j in range(2):
            want += (ids[:, j] == e)[:, None] * weights[:, j:j + 1].astype(np.float64) * out_e
    assert rel_l2(got, want) < 1e-5


def test_force_impl_and_disabled_features_choose_the_rawint4_kernels():
    """The dispatch table decides RAWINT4 like every other family: KTCONVERT_FORCE_IMPL forces a row, hidden CPU
    features drop to the next one; the results stay within the tolerance of the reference."""
    code = ("import numpy as np\nfrom ktconvert.native import forward as rt\n"
            "from test_runtime_rawint4 import random_matrix, spec_weights, rel_l2\n"
            "rng = np.random.default_rng(0)\np, s = random_matrix(rng, 24, 256, 64)\n"
            "x = rng.standard_normal((3, 256)).astype(np.float32)\n"
            "err = rel_l2(rt.gemm('RAWINT4', p, s, 24, 256, x), x.astype(np.float64) @ spec_weights(p, s, 64).T)\n"
            "print(rt.variant(None, 'RAWINT4'), err < 1e-5)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTCONVERT_")}
    auto = rt.variant(None, "RAWINT4") if len(env) == len(os.environ) else None    # this process's choice
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    for extra, want in (({"KTCONVERT_FORCE_IMPL": "scalar"}, "scalar"),
                        ({"KTCONVERT_DISABLE_CPU_FEATURES": "avx2,avx512f"}, "scalar"), ({}, auto)):
        proc = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        variant, ok = proc.stdout.split()
        assert ok == "True" and (want is None or variant == want), (extra, proc.stdout)


def test_bad_rawint4_inputs_are_refused():
    rng = np.random.default_rng(0)
    packed, scale = random_matrix(rng, 8, 64, 32)
    x = np.ones(64, np.float32)
    with pytest.raises(VerifyError, match="weight_scale") as err:
        rt.gemm("RAWINT4", packed, scale[:-1], 8, 64, x, group=32, name="layer 0 expert 1 up")
    assert "layer 0 expert 1 up" in str(err.value)
    with pytest.raises(VerifyError, match="weight_packed"):
        rt.gemm("RAWINT4", packed[:, :-1], scale, 8, 64, x)
    with pytest.raises(VerifyError, match="weight_scale"):         # float scales, not BF16 bits
        rt.gemm("RAWINT4", packed, scale.astype(np.float32), 8, 64, x, group=32)
    with pytest.raises(ShapeError, match="cannot be inferred"):
        rt.gemm("RAWINT4", packed, np.zeros((8, 3), np.uint16), 8, 64, x)
    with pytest.raises(ShapeError, match="incompatible with RAWINT4"):     # group 12: not whole int32 words
        rt.gemm("RAWINT4", random_matrix(rng, 8, 48, 8)[0], np.zeros((8, 4), np.uint16), 8, 48, x[:48])
    with pytest.raises(ShapeError, match="NUMA parts"):                   # I/T = 16 is half a group of 32
        rt.rawint4_parts(random_matrix(rng, 64, 64, 32), random_matrix(rng, 64, 64, 32),
                         random_matrix(rng, 64, 64, 32), 4)
    lib, y = rt.runtime_lib(), np.zeros((1, 8), np.float32)
    for wtype, group in ((41, 0), (4, 32), (99, 0)):     # RAWINT4 without a group, AMXINT4 with one, unknown type
        assert lib.kt_rt_gemm_grouped(wtype, group, packed, scale, 8, 64, x[None], 1, y, 0, 1) == 4
    assert lib.kt_rt_gemm_grouped(41, 12, packed, scale, 8, 48, x[None, :48], 1, y, 0, 1) == 1


@pytest.mark.parametrize("source", ["runtime_kernels_avx512.c", "runtime_kernels_vnni.c"])
def test_kernels_this_cpu_cannot_run_compile(source, tmp_path):
    """The AVX-512 RAWINT4 kernel (shared by the avx512-vnni row) compiles on its own where a C compiler is at hand:
    on a CPU without AVX-512 the tests above skip it (a failed build would only leave the library out)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        pytest.skip(f"no C compiler ({cc})")
    proc = subprocess.run([cc, "-std=c11", "-O2", "-c", "-o", str(tmp_path / "kernels.o"), f"-I{ROOT / 'native'}",
                           str(ROOT / "native" / source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---- ktconvert verify ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def g32(tiny_model, tmp_path_factory):
    from ktconvert.cpu.convert import convert_cpu

    model = tiny_model("deepseek_v3")
    out = tmp_path_factory.mktemp("rawint4") / "g32"
    convert_cpu(model, out, method="rawint4", numa=2)
    return model, out


def test_verify_runs_rawint4_through_the_runtime(g32):
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.methods import CpuMethod
    from ktconvert.verification.numeric_inplace import check_inplace_numerics
    from ktconvert.verification.run import verify

    model, out = g32
    result = verify(out, source=str(model), experts="all", layers="all")
    assert result["ok"], result["problems"]
    numerics = result["numerics"]
    assert numerics["variant"] == rt.variant(None, "RAWINT4") and numerics["thresholds"]["kernel_rel"] == 1e-5
    assert "native runtime" in numerics["summary"] and "2 NUMA part(s)" in numerics["summary"]
    for row in numerics["layers"]:
        assert row["kernel_rel"] < 1e-5 and row["moe_kernel_rel"] < 1e-5 and 0 < row["moe_rel_l2"] < 0.6
        # the runtime's products are exact, the decoder's BF16-rounded: against the source they differ a little
        assert abs(row["runtime_moe_rel_l2"] - row["moe_rel_l2"]) < 0.01
    manifest = load_manifest(out)
    scalar = check_inplace_numerics(out, manifest, str(model), 4, "all", "all", None, method=CpuMethod.from_manifest(
        manifest), impl="scalar", threads=3)
    assert scalar["ok"] and scalar["variant"] == "scalar"
    for a, b in zip(scalar["layers"], numerics["layers"]):   # other kernels and tokens, the same agreement
        assert a["moe_kernel_rel"] < 1e-5 and abs(a["moe_rel_l2"] - b["moe_rel_l2"]) < 0.1


def group128_folder(src: Path, out: Path) -> Path:
    """The g32 output rewritten as a group-128 one, which the CLI no longer writes (an older ktconvert or
    llmcompressor's W4A16 did): each weight_scale keeps every 4th group's scale (the same packed bytes), the
    index's total size, the config's group_size and ktconvert.json (group size, tensor hashes, file records)
    follow."""
    from ktconvert.formats.safetensors_reader import Checkpoint

    shutil.copytree(src, out)
    ck = Checkpoint.open(out)
    manifest = json.loads((out / "ktconvert.json").read_text())
    for shard in sorted(out.glob("model-*.safetensors")):
        tensors = {}
        for name, ref in ck.tensors.items():
            if ref.file.name == shard.name:
                array = ck.read(name)
                tensors[name] = (ref.dtype, array[:, ::4] if name.endswith(".weight_scale") else array)
        write_safetensors(shard, tensors)
        manifest["tensors"].update({name: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
                                    for name, (_, a) in tensors.items()})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = sum(ck.tensors[name].nbytes if not name.endswith(".weight_scale")
                                          else ck.tensors[name].nbytes // 4 for name in index["weight_map"])
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["group_size"] = 128
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for rel in manifest["files"]:
        data = (out / rel).read_bytes()
        git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        manifest["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "git_sha1": git}
    manifest["group_size"] = 128
    from ktconvert.formats.out_manifest import manifest_bytes
    (out / "ktconvert.json").write_bytes(manifest_bytes(manifest))      # as written (self hash recomputed)
    return out


def test_group_128_folder_fails_verify_with_one_line(g32, tmp_path):
    """Everything else about it is sound (structure, flags, hashes, runtime against numpy at group 128): the one
    problem is that kt-kernel 0.7.2 cannot run it."""
    out = group128_folder(g32[1], tmp_path / "g128")
    result = CliRunner().invoke(cli, ["verify", str(out), "--hashes", "--sample-experts", "2"])
    assert result.exit_code == EXIT_VERIFY, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("  - ")]
    assert problems == ["  - group size 128: kt-kernel 0.7.2's RAWINT4 returns NaN/garbage at group sizes other "
                        "than 32 (measured); reconvert with --method rawint4 (group 32)"], result.output
    from ktconvert.verification.run import verify

    numerics = verify(out, experts="2")["numerics"]
    assert numerics["variant"] and all(row["moe_kernel_rel"] < 1e-5 for row in numerics["layers"])
    statuses = {c["name"]: c["status"] for c in verify(out, hashes=True)["checks"]}
    assert statuses == {"manifest": "ok", "integrity": "ok", "structure": "ok", "flags": "ok", "hashes": "ok",
                        "numerics": "failed", "source": "skipped", "remote": "skipped"}


def test_down_scale_at_another_group_size_is_named(g32, tmp_path):
    """kt-kernel takes the group size from the gate scale only: a down scale of another group size is named."""
    from ktconvert.verification.numeric_rawint4 import ktkernel_group
    from ktconvert.formats.safetensors_reader import Checkpoint

    ck = Checkpoint.open(g32[1])
    layer = json.loads((g32[1] / "ktconvert.json").read_text())["model"]["layers"][0]
    assert ktkernel_group(ck, layer, 256, 256, 2) == (32, [])
    group, problems = ktkernel_group(ck, layer, 256, 512, 2)       # as if I were 512: 8 columns are groups of 64
    assert group is None and "down_proj.weight_scale" in problems[0] and "not groups of 32" in problems[0]
    group, problems = ktkernel_group(ck, layer, 256, 256, 16)      # I/T = 16: half a group
    assert group is None and "16 NUMA parts of whole groups" in problems[0]


def test_verify_without_the_native_library_says_so(g32):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTCONVERT_")}
    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", "verify", str(g32[1]), "--sample-experts", "1",
                           "--layers", "1"], env={**env, "KTCONVERT_NO_NATIVE": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "native runtime not run (disabled by KTCONVERT_NO_NATIVE)" in proc.stdout

"""Verification runtime: native kernels on kt-kernel's tile layouts in place, and the strict output-folder reader.

Golden values: numpy dequantization of the same bytes (ktconvert.methods, from the layout spec), an
element-by-element decoder written here from the byte formulas of kt-format.md §2.1/§2.2, a float64 SwiGLU MoE
(tests/ktkernel_util.reference_moe_forward) and, where it can run, kt-kernel 0.7.2's own forward.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ktconvert.errors import InputError, ShapeError, VerifyError
from ktconvert.native import forward as rt
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from ktconvert.methods import METHODS

pytestmark = pytest.mark.skipif(not rt.available(), reason="native library not built")

def _impl_ok(name: str) -> bool:
    try:
        rt.impl_id(name)
    except Exception:
        return False
    return True


IMPLS = [name for name in ("scalar", "avx2", "avx512") if rt.available() and _impl_ok(name)]


def heavy_tailed(rng, shape, scale=0.02):
    """BF16 bits: Gaussian with 1% of entries at 12 sigma (kt-format §6.1's outlier case)."""
    w = rng.standard_normal(shape) * scale
    mask = rng.random(shape) < 0.01
    w[mask] = np.sign(w[mask]) * 12 * scale
    return f32_to_bf16_bits(w.astype(np.float32))


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- the byte formulas of kt-format.md §2.1 / §2.2, element by element (independent of layouts/tiles.py) --------

def spec_decode(blob: np.ndarray, n: int, k: int, bits: int) -> np.ndarray:
    """int8 codes [n, k] read from a tiled blob with the spec's per-element byte formula."""
    n_block, tile_k = (128, 128) if bits == 4 else (64, 64)
    r = np.arange(n)[:, None]
    c = np.arange(k)[None, :]
    nb0 = r // n_block * n_block
    nbs = np.minimum(n_block, n - nb0)
    kb0 = c // 3584 * 3584
    kbs = np.minimum(3584, k - kb0)
    s0, rr = (r - nb0) // 32 * 32, (r - nb0) % 32
    t0, cc = (c - kb0) // tile_k * tile_k, (c - kb0) % tile_k
    base = nb0 * k + kb0 * nbs + s0 * kbs + t0 * 32
    if bits == 8:
        byte = base + (rr // 16) * 1024 + (cc // 4) * 64 + (rr % 16) * 4 + cc % 4
        return blob[byte].view(np.int8)
    j = cc % 64
    byte = base // 2 + (rr // 16) * 1024 + (j // 4) * 64 + (rr % 16) * 4 + j % 4
    nib = np.where(cc < 64, blob[byte] & 0x0F, blob[byte] >> 4).astype(np.int8)
    return np.where(nib >= 8, nib - 16, nib).astype(np.int8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits,n,k", [(4, 96, 3584 + 256), (8, 96, 3584 + 192), (4, 32, 128), (8, 64, 64)])
def test_gemm_random_bytes_match_spec_decoder(impl, bits, n, k):
    """Arbitrary bytes (every nibble value, -8 included) through the kernel == the spec's element formula."""
    rng = np.random.default_rng(bits * 1000 + n + k)
    blob = rng.integers(0, 256, n * k * bits // 8, dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, n).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    codes = spec_decode(blob, n, k, bits).astype(np.float64)
    want = x.astype(np.float64) @ (codes * (16.0 if bits == 4 else 1.0) * scale[:, None].astype(np.float64)).T
    got = rt.gemm(f"AMXINT{bits}", blob, scale, n, k, x, impl=impl)
    assert rel_l2(got, want) < 1e-5


_QUANTIZED: dict = {}


def quantized(method: str, n: int, k: int):
    """(blob, scale, float64 dequantized weights) of a seeded heavy-tailed [n, k], cached across parameters."""
    if (method, n, k) not in _QUANTIZED:
        m = METHODS.get(method)
        blob, scale = m.quantize(heavy_tailed(np.random.default_rng(n + k), (n, k)))
        _QUANTIZED[method, n, k] = blob, scale, m.dequantize(blob, scale, n, k).astype(np.float64)
    return _QUANTIZED[method, n, k]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ["amxint4", "amxint8"])
@pytest.mark.parametrize("n,k", [(256, 256), (160, 7168 + 256)])
def test_gemm_matches_numpy_dequantized(impl, method, n, k):
    """N-block and K-block tails included (160 = 128 + 32 rows; 7424 = 3584 * 2 + 256 columns)."""
    blob, scale, w = quantized(method, n, k)
    kt_method = METHODS.get(method).kt_method
    rng = np.random.default_rng(1)
    for tokens in (1, 2, 5):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        got = rt.gemm(kt_method, blob, scale, n, k, x, impl=impl, threads=2)
        assert got.shape == (tokens, n)
        assert rel_l2(got, x.astype(np.float64) @ w.T) < 1e-5
    vec = rt.gemm(kt_method, blob, scale, n, k, x[0], impl=impl)
    assert vec.shape == (n,)


@pytest.mark.parametrize("impl", IMPLS)
def test_gemm_bf16_rows(impl):
    rng = np.random.default_rng(5)
    for n, k in ((5, 37), (64, 256), (33, 1000)):
        w = f32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
        x = rng.standard_normal((3, k)).astype(np.float32)
        got = rt.gemm("BF16", w, None, n, k, x, impl=impl)
        assert rel_l2(got, x.astype(np.float64) @ bf16_bits_to_f32(w).astype(np.float64).T) < 1e-5


def test_results_do_not_depend_on_thread_count():
    m = METHODS.get("amxint4")
    rng = np.random.default_rng(9)
    blob, scale = m.quantize(heavy_tailed(rng, (1024, 512)))
    x = rng.standard_normal((3, 512)).astype(np.float32)
    one = rt.gemm("AMXINT4", blob, scale, 1024, 512, x, threads=1)
    for threads in (2, 3, 8):
        assert np.array_equal(one, rt.gemm("AMXINT4", blob, scale, 1024, 512, x, threads=threads))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ["amxint4", "amxint8"])
def test_heavy_tailed_activations_within_tolerance(impl, method):
    """Activations spanning many binades (Student t with 1.5 degrees of freedom, one 1e4 outlier per token) through
    every kernel, the VNNI one rounding them to 23-bit integers per token: still within the tolerance above."""
    n, k = 96, 3584 + 512
    blob, scale, w = quantized(method, n, k)
    rng = np.random.default_rng(11)
    x = rng.standard_t(1.5, (4, k)).astype(np.float32)
    x[np.arange(4), rng.integers(0, k, 4)] = 1e4
    got = rt.gemm(METHODS.get(method).kt_method, blob, scale, n, k, x, impl=impl, threads=2)
    assert rel_l2(got, x.astype(np.float64) @ w.T) < 1e-5


def test_avx512_fma_path_without_vnni():
    """The AVX-512 fp32 kernels (chosen when the CPU lacks VNNI), forced here by hiding the feature."""
    if "avx512" not in IMPLS:
        pytest.skip("CPU lacks AVX-512")
    script = (
        "import numpy as np\n"
        "from ktconvert.native import forward as rt\n"
        "from ktconvert.methods import METHODS\n"
        "from ktconvert.quant.bf16 import f32_to_bf16_bits\n"
        "print(rt.variant('avx512'))\n"
        "rng = np.random.default_rng(0)\n"
        "for name, n, k in (('amxint4', 96, 3840), ('amxint8', 96, 3776)):\n"
        "    m = METHODS.get(name)\n"
        "    blob, s = m.quantize(f32_to_bf16_bits(rng.standard_t(3, (n, k)).astype(np.float32)))\n"
        "    x = rng.standard_normal((5, k)).astype(np.float32)\n"
        "    ref = x.astype(np.float64) @ m.dequantize(blob, s, n, k).astype(np.float64).T\n"
        "    got = rt.gemm(m.kt_method, blob, s, n, k, x, impl='avx512')\n"
        "    print(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))\n"
    )
    env = dict(os.environ, KTCONVERT_DISABLE_CPU_FEATURES="avx512vnni")
    lines = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    assert lines[0] == "avx512"
    assert all(float(v) < 1e-5 for v in lines[1:]) and len(lines) == 3


def test_gemm_rejects_bad_input():
    m = METHODS.get("amxint4")
    blob, scale = m.quantize(heavy_tailed(np.random.default_rng(0), (64, 256)))
    x = np.ones(256, np.float32)
    with pytest.raises(VerifyError, match="wrong size"):
        rt.gemm("AMXINT4", blob[:-1], scale, 64, 256, x, name="blk.0.ffn_up_exps.0.numa.0.weight")
    with pytest.raises(VerifyError, match="scale"):
        rt.gemm("AMXINT4", blob, scale[:-1], 64, 256, x)
    with pytest.raises(VerifyError, match="wrong size"):   # an INT4 blob read as INT8
        rt.gemm("AMXINT8", blob, scale, 64, 256, x)
    with pytest.raises(ShapeError):
        rt.gemm("AMXINT4", blob, scale, 64, 256, np.full(256, np.nan, np.float32))
    with pytest.raises(ShapeError):
        rt.gemm("AMXINT4", blob, scale, 64, 200, x[:200])


# ---- MoE forward ------------------------------------------------------------------------------------------------

def _layer(rng, experts, hidden, inter):
    return (heavy_tailed(rng, (experts, inter, hidden)), heavy_tailed(rng, (experts, inter, hidden)),
            heavy_tailed(rng, (experts, hidden, inter)))


@pytest.mark.parametrize("method,inter,numa", [("AMXINT4", 512, 1), ("AMXINT4", 512, 2), ("AMXINT4", 512, 4),
                                               ("AMXINT8", 256, 1), ("AMXINT8", 256, 2), ("AMXINT8", 256, 4)])
def test_moe_forward_from_kt_tree_matches_reference(tmp_path, method, inter, numa):
    from ktkernel_util import dequantized_experts, numpy_kt_files, reference_moe_forward, write_kt_files

    from ktconvert.verification.reader import KtOutput

    experts, hidden, tokens = 4, 256, 6
    rng = np.random.default_rng(numa * 7 + inter)
    gate, up, down = _layer(rng, experts, hidden, inter)
    write_kt_files(tmp_path, 3, numpy_kt_files(method, gate, up, down, numa))
    manifest = {"method": method, "numa": numa, "layout": "kt", "tensors": {},
                "model": {"layers": [3], "experts": experts, "hidden": hidden, "intermediate": inter}}
    out = KtOutput.open(tmp_path, manifest, methods=METHODS)
    out.check_layer(3)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice(experts, 2, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, 2)).astype(np.float32)
    got = np.zeros((tokens, hidden), np.float32)
    for e in range(experts):            # one expert in memory at a time
        rt.moe_forward(method, hidden, inter // numa, {e: out.read_expert(3, e).parts}, x, ids, weights, out=got,
                       threads=2)
    want = reference_moe_forward(x, ids, weights, *dequantized_experts(method, gate, up, down, numa))
    assert rel_l2(got, want) < 1e-5
    single = rt.expert_forward(method, hidden, inter // numa, out.read_expert(3, 1).parts, x)
    ones = np.ones((tokens, 1), np.float32)
    want1 = reference_moe_forward(x, np.full((tokens, 1), 1), ones, *dequantized_experts(method, gate, up, down,
                                                                                          numa))
    assert rel_l2(single, want1) < 1e-5


# ---- the strict reader: one clear error per broken-output case -------------------------------------------------

def write_output(src_dir, out, method, numa, layout):
    """Convert src_dir's routed experts with ktconvert's quantizer + KtSink and write ktconvert.json (test writer,
    independent of pipeline.py)."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.formats.kt_sink import KtSink
    from ktconvert.formats.out_manifest import build_manifest, source_fingerprint, write_manifest
    from ktconvert.layouts.numa import split_expert

    src = HFSource.open(src_dir)
    info, m = src.info, METHODS.get(method)
    layers = list(info.moe_layers)
    sink = KtSink(out, layout, m, numa, layers, info.n_experts, info.hidden, info.intermediate)
    files, tensors = [], {}
    for layer in layers:
        writer = sink.begin_layer(layer)
        for e in range(info.n_experts):
            for t, part in enumerate(split_expert(src.read_expert(layer, e), numa)):
                for proj, w in part.projections():
                    writer.put(proj, e, t, *m.quantize(w))
        result = writer.finish()
        files += result.files
        tensors.update(result.tensors)
    files += sink.finalize()
    model = {"layers": layers, "experts": info.n_experts, "hidden": info.hidden, "intermediate": info.intermediate}
    manifest = build_manifest(method=m.kt_method, numa=numa, layout=layout, model=model,
                              source=source_fingerprint(src_dir, src.files()), files=files, tensors=tensors,
                              packages={})
    write_manifest(out, manifest)
    return Path(out)


def write_bf16_safetensors(path, tensors: dict) -> None:
    """A plain safetensors file of BF16 tensors (uint16 bit arrays), keys sorted (safetensors.numpy has no BF16)."""
    import json
    import struct

    header, offset = {}, 0
    for name in sorted(tensors):
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + tensors[name].nbytes]}
        offset += tensors[name].nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def make_source(root, seed=3, layers=2, experts=4, hidden=256, inter=256) -> Path:
    """A minimal Qwen3-MoE checkpoint (config + routed experts only) with heavy-tailed BF16 experts."""
    import json

    root = Path(root)
    root.mkdir(parents=True)
    config = {"model_type": "qwen3_moe", "num_hidden_layers": layers, "num_experts": experts, "hidden_size": hidden,
              "moe_intermediate_size": inter, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "intermediate_size": 4 * hidden, "vocab_size": 64}
    (root / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for e in range(experts):
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = heavy_tailed(rng, shape)
    write_bf16_safetensors(root / "model.safetensors", tensors)
    return root


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("src") / "tiny")


def _open(out, **changes):
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.verification.reader import KtOutput

    manifest = load_manifest(out)
    manifest.update(changes)
    return KtOutput.open(out, manifest, methods=METHODS)


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_reader_reads_what_was_written(tiny_src, tmp_path, layout):
    out = _open(write_output(tiny_src, tmp_path / "o", "amxint4", 2, layout))
    assert out.mode == layout and out.numa == 2 and out.inter_part == 128
    for layer in out.layers:
        out.check_layer(layer)
    blobs = out.read_expert(out.layers[0], 3)
    assert len(blobs.parts) == 2 and blobs.parts[1][2][0].nbytes == 256 * 128 // 2
    assert all(out.manifest["tensors"][k] == v for k, v in blobs.sha256.items()) and len(blobs.sha256) == 12


def test_truncated_kt_blob(tiny_src, tmp_path):
    root = write_output(tiny_src, tmp_path / "o", "amxint4", 2, "kt")
    victim = next((root / "_layer_0" / "_numa_1").glob("INT4_down_2_*_quant_.kt"))
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(VerifyError, match="truncated") as err:
        _open(root).read_expert(0, 2)
    assert victim.name in str(err.value)


def test_truncated_merged_shard(tiny_src, tmp_path):
    root = write_output(tiny_src, tmp_path / "o", "amxint4", 1, "safetensors")
    shard = sorted(root.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(InputError, match=shard.name):
        _open(root)


def test_wrong_size_scale_in_merged_shard(tiny_src, tmp_path):
    from safetensors.numpy import load_file, save_file

    root = write_output(tiny_src, tmp_path / "o", "amxint8", 1, "safetensors")
    shard = sorted(root.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    key = "blk.0.ffn_gate_exps.1.numa.0.scale"
    tensors[key] = np.concatenate([tensors[key], np.ones(1, np.float32)])
    save_file(tensors, shard)
    with pytest.raises(VerifyError, match=key.replace(".", r"\.")) as err:
        _open(root).read_expert(0, 1)
    assert "1028 bytes" in str(err.value) and "1024 bytes" in str(err.value)


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_int8_output_loaded_as_int4(tiny_src, tmp_path, layout):
    """The classic: converted AMXINT8, loaded as AMXINT4. Byte counts give it away, with the hint."""
    root = write_output(tiny_src, tmp_path / "o", "amxint8", 2, layout)
    with pytest.raises(VerifyError) as err:
        _open(root, method="AMXINT4").read_expert(0, 0)
    assert "AMXINT8 with numa 2" in str(err.value)


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_numa_count_mismatch(tiny_src, tmp_path, layout):
    root = write_output(tiny_src, tmp_path / "o", "amxint8", 2, layout)
    with pytest.raises(VerifyError, match="extra NUMA parts"):
        _open(root, numa=1).check_layer(0)
    with pytest.raises(VerifyError, match="missing NUMA parts"):
        _open(root, numa=4).check_layer(0)


def test_extra_numa_folder_in_kt_tree(tiny_src, tmp_path):
    root = write_output(tiny_src, tmp_path / "o", "amxint4", 2, "kt")
    (root / "_layer_1" / "_numa_2").mkdir()
    with pytest.raises(VerifyError, match="extra NUMA parts"):
        _open(root).check_layer(1)


def test_missing_expert(tiny_src, tmp_path):
    from safetensors.numpy import load_file, save_file

    root = write_output(tiny_src, tmp_path / "o", "amxint4", 1, "safetensors")
    shard = sorted(root.glob("model-*.safetensors"))[1]
    tensors = {k: v for k, v in load_file(shard).items() if "_exps.2." not in k}
    save_file(tensors, shard)
    with pytest.raises(VerifyError, match="fewer experts"):
        _open(root).check_layer(1)
    kt_root = write_output(tiny_src, tmp_path / "k", "amxint4", 1, "kt")
    for path in (kt_root / "_layer_1" / "_numa_0").glob("INT4_*_3_*"):
        path.unlink()
    with pytest.raises(VerifyError, match="file missing"):
        _open(kt_root).read_expert(1, 3)


# ---- kt-kernel itself on the same files and activations ----------------------------------------------------------

@pytest.mark.ktkernel
@pytest.mark.parametrize("method,numa", [("AMXINT4", 2), ("AMXINT8", 1)])
def test_agrees_with_ktkernel_forward(tmp_path, method, numa):
    from ktkernel_util import ktkernel_forward, ktkernel_skip_reason, numpy_kt_files, write_kt_files

    from ktconvert.verification.reader import KtOutput

    reason = ktkernel_skip_reason(method)
    if reason:
        pytest.skip(reason)
    experts, hidden, inter, tokens = 4, 256, 256, 8
    rng = np.random.default_rng(11)
    gate, up, down = _layer(rng, experts, hidden, inter)
    write_kt_files(tmp_path, 0, numpy_kt_files(method, gate, up, down, numa))
    x_bf16 = f32_to_bf16_bits(rng.standard_normal((tokens, hidden)).astype(np.float32))
    ids = np.stack([rng.choice(experts, 2, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, 2)).astype(np.float32)
    theirs = ktkernel_forward(tmp_path, method, num_experts=experts, hidden=hidden, intermediate=inter,
                              threadpool_count=numa, x_bf16=x_bf16, topk_ids=ids, topk_weights=weights)
    manifest = {"method": method, "numa": numa, "layout": "kt", "tensors": {},
                "model": {"layers": [0], "experts": experts, "hidden": hidden, "intermediate": inter}}
    out = KtOutput.open(tmp_path, manifest, methods=METHODS)
    ours = np.zeros((tokens, hidden), np.float32)
    for e in range(experts):
        rt.moe_forward(method, hidden, inter // numa, {e: out.read_expert(0, e).parts}, bf16_bits_to_f32(x_bf16),
                       ids, weights, out=ours)
    assert rel_l2(theirs, ours) < 0.05   # kt-kernel quantizes activations to int8: ~1-3%

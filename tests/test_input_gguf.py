"""GGUF input: native ggml dequantization bit-identical to gguf-py, the GGUF expert source, and `ktconvert cpu`
end to end on GGUF fixtures.

Golden values: gguf-py's own ``gguf.quants.dequantize`` (numpy) on the same bytes, read with ``gguf.GGUFReader``;
for the end-to-end test, kt-kernel's AMXINT4 quantizer (ktconvert.methods, checked byte for byte elsewhere)
applied to gguf-py's dequantized weights rounded to BF16. K-quant / IQ fixtures in tests/golden/gguf/ were produced
by llama.cpp's quantizer (see SOURCES.json, make_fixtures.py); the others are written here with gguf-py.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import blake3
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGUFReader, quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from ktconvert.errors import InputError, ManifestError, ShapeError  # noqa: E402
from ktconvert.quant import ggml  # noqa: E402
from ktconvert.quant.bf16 import f32_to_bf16_bits  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "gguf"
SOURCES_JSON = json.loads((GOLDEN / "SOURCES.json").read_text()) if (GOLDEN / "SOURCES.json").exists() else {}
GGUFPY_QUANTIZABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]
NATIVE_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"]


def _load_make_fixtures():
    spec = importlib.util.spec_from_file_location("gguf_make_fixtures", GOLDEN / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


write_moe_gguf = _load_make_fixtures().write_moe_gguf


def _native_impls() -> list[str]:
    from ktconvert.native import gguf as native_gguf

    return native_gguf.usable_impls()


IMPLS = _native_impls()
needs_native = pytest.mark.skipif(not IMPLS, reason="native library not built")


def random_blocks(type_name: str, n_blocks: int, seed: int) -> np.ndarray:
    return ggml.random_blocks(type_name, n_blocks, seed)


def _ieee_mode() -> bool:
    """False once a library in this process switched on FTZ/DAZ (importing kt_kernel does): numpy then flushes
    subnormal results, and gguf-py's reference must be computed in a fresh process."""
    tiny = np.array([1e-40, 1e-30], dtype=np.float32)
    return bool(tiny[0] * np.float32(1) != 0 and tiny[1] * np.float32(1e-9) != 0)


_REFERENCE_SCRIPT = """import sys, numpy as np
from gguf import GGMLQuantizationType as T, quants
raw = np.fromfile(sys.argv[1], dtype=np.uint8)
with np.errstate(all="ignore"):
    np.asarray(quants.dequantize(raw, T[sys.argv[2]]), dtype=np.float32).reshape(-1).tofile(sys.argv[3])
"""


def gguf_py_f32(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's dequantize, in IEEE mode (a subprocess when this process has FTZ/DAZ on)."""
    if _ieee_mode():
        with np.errstate(all="ignore"):
            return np.asarray(quants.dequantize(raw, T[type_name]), dtype=np.float32).reshape(-1)
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "raw.bin", Path(tmp) / "out.bin"
        np.ascontiguousarray(raw).tofile(src)
        subprocess.run([sys.executable, "-c", _REFERENCE_SCRIPT, str(src), type_name, str(dst)], check=True)
        return np.fromfile(dst, dtype=np.float32)


def first_mismatch(got: np.ndarray, want: np.ndarray, block: int) -> str:
    bad = np.flatnonzero(got != want)
    return f"{bad.size} values differ in {np.unique(bad // block).size} blocks; first at element {bad[0]}" \
        if bad.size else "equal"


# ---------------------------------------------------------------- native dequantization vs gguf-py

@needs_native
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_native_dequant_bit_identical_to_gguf_py(type_name):
    from ktconvert.native import gguf as native_gguf

    block = GGML_QUANT_SIZES[T[type_name]][0]
    n_blocks = 65536 // block if block > 1 else 4096
    raw = random_blocks(type_name, n_blocks, seed=T[type_name].value)
    want = gguf_py_f32(raw, type_name)
    want_bf16 = f32_to_bf16_bits(want)
    assert native_gguf.supports(T[type_name].value)
    for impl in IMPLS:
        got = native_gguf.dequantize_f32(raw, T[type_name].value, impl=impl)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
            f"{type_name} {impl}: " + first_mismatch(got.view(np.uint32), want.view(np.uint32), block)
        got_bf16 = native_gguf.dequantize_bf16(raw, T[type_name].value, impl=impl)
        assert np.array_equal(got_bf16, want_bf16), f"{type_name} {impl} bf16: " + \
            first_mismatch(got_bf16, want_bf16, block)


@needs_native
def test_native_mxfp4_subnormal_scales_match_numpy():
    """e8m0 exponents 0..3 give subnormal float32 results; the call must not flush them (FTZ/DAZ off)."""
    from ktconvert.native import gguf as native_gguf

    raw = random_blocks("MXFP4", 1024, seed=5).reshape(1024, 17)
    raw[:, 0] = np.arange(1024) % 4
    raw = raw.reshape(-1)
    want = gguf_py_f32(raw, "MXFP4")
    bits = want.view(np.uint32)
    assert np.any(((bits & 0x7F800000) == 0) & ((bits & 0x007FFFFF) != 0))   # subnormals present (bit test: DAZ-proof)
    for impl in IMPLS:
        assert np.array_equal(native_gguf.dequantize_f32(raw, T.MXFP4.value, impl=impl).view(np.uint32),
                              want.view(np.uint32))


@needs_native
def test_native_f16_every_finite_half():
    from ktconvert.native import gguf as native_gguf

    halves = np.arange(1 << 16, dtype=np.uint16)
    halves = halves[(halves & 0x7C00) != 0x7C00]
    want = halves.view(np.float16).astype(np.float32).view(np.uint32)
    for impl in IMPLS:
        assert np.array_equal(native_gguf.dequantize_f32(halves.view(np.uint8), T.F16.value, impl=impl)
                              .view(np.uint32), want), impl


@needs_native
def test_native_threads_do_not_change_bits():
    from ktconvert.native import gguf as native_gguf

    raw = random_blocks("Q4_K", 3001, seed=9)
    one = native_gguf.dequantize_bf16(raw, T.Q4_K.value, threads=1)
    assert np.array_equal(one, native_gguf.dequantize_bf16(raw, T.Q4_K.value, threads=3))


def test_ggml_numpy_path_and_geometry():
    raw = random_blocks("IQ2_XS", 64, seed=3)     # no native kernel: gguf-py's numpy path
    assert not ggml.native_supported(T.IQ2_XS.value)
    assert np.array_equal(ggml.dequantize_bf16(raw, T.IQ2_XS.value), f32_to_bf16_bits(gguf_py_f32(raw, "IQ2_XS")))
    raw = random_blocks("Q6_K", 64, seed=4)
    assert np.array_equal(ggml.dequantize(raw, T.Q6_K.value, impl="numpy").view(np.uint32),
                          gguf_py_f32(raw, "Q6_K").view(np.uint32))
    for qtype, (elems, nbytes) in GGML_QUANT_SIZES.items():
        if qtype.value in ggml.GGML_TYPES:
            assert ggml.geometry(qtype.value) == (elems, nbytes), qtype.name
    with pytest.raises(InputError, match="Q8_1"):
        ggml.dequantize(np.zeros(40, np.uint8), T.Q8_1.value, name="t")
    with pytest.raises(ShapeError, match="whole number of blocks"):
        ggml.dequantize(np.zeros(35, np.uint8), T.Q8_0.value)


# ---------------------------------------------------------------- the source on gguf-py-written files

def _reference_expert(path: Path, layer: int, e: int) -> dict[str, np.ndarray]:
    """BF16 bits of expert e from gguf-py: GGUFReader + quants.dequantize + RNE rounding."""
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    out = {}
    for proj in ("gate", "up", "down"):
        t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
        with np.errstate(all="ignore"):
            out[proj] = f32_to_bf16_bits(quants.dequantize(t.data, t.tensor_type)[e])
    return out


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("type_name", GGUFPY_QUANTIZABLE)
def test_source_reads_gguf_py_files(gguf_dir, type_name):
    from ktconvert.formats.sources import open_source
    from ktconvert.formats.gguf_source import GGUFSource

    path = gguf_dir / f"tiny-{type_name}.gguf"
    write_moe_gguf(path, T[type_name], seed=1)
    src = open_source(path)
    assert isinstance(src, GGUFSource) and src.input_format == "gguf"
    src.validate()
    info = src.info
    assert (info.family, info.moe_layers, info.n_experts, info.hidden, info.intermediate, info.experts_per_tok) == \
        ("qwen3_moe", (0, 1), 2, 256, 256, 2)
    for layer in info.moe_layers:
        for e in range(info.n_experts):
            ew, want = src.read_expert(layer, e), _reference_expert(path, layer, e)
            for proj in ("gate", "up", "down"):
                got = getattr(ew, proj)
                assert got.dtype == np.uint16 and np.array_equal(got, want[proj]), (type_name, layer, e, proj)


def test_matrix_jobs_cover_expert_slices(gguf_dir):
    from ktconvert.formats.gguf_source import GGUFSource

    path = gguf_dir / "jobs-Q8_0.gguf"
    write_moe_gguf(path, T.Q8_0, seed=2)
    src = GGUFSource.open(path)
    jobs = src.matrix_jobs(src.all_layers(False))
    assert len(jobs) == 2 * 3 * 2
    blob = path.read_bytes()
    for job in jobs:
        raw = np.frombuffer(blob[job.offset:job.offset + job.nbytes], dtype=np.uint8)
        want = _reference_expert(path, job.layer, job.expert)
        (proj, got), = src.decode(job, raw).items()
        assert proj == job.projs[0] and np.array_equal(got, want[proj])
    assert not src.nonzero_expert_biases(src.all_layers()) and not src.has_expert_biases()


def test_numpy_and_native_source_paths_agree(gguf_dir, monkeypatch):
    from ktconvert.formats.gguf_source import GGUFSource

    path = gguf_dir / "paths-Q5_1.gguf"
    write_moe_gguf(path, T.Q5_1, seed=3)
    native_down = GGUFSource.open(path).read_expert(1, 0).down
    monkeypatch.setenv("KTCONVERT_FORCE_IMPL", "numpy")
    assert not ggml.native_supported(T.Q5_1.value)
    assert np.array_equal(GGUFSource.open(path).read_expert(1, 0).down, native_down)


def test_split_set_and_directory(gguf_dir):
    from ktconvert.formats.gguf_source import GGUFSource

    one = gguf_dir / "single-Q4_0.gguf"
    write_moe_gguf(one, T.Q4_0, seed=4)
    split_dir = gguf_dir / "split"
    split_dir.mkdir()
    write_moe_gguf(split_dir / "m.gguf", T.Q4_0, seed=4, split_max_tensors=10)
    parts = sorted(split_dir.glob("*.gguf"))
    assert len(parts) >= 3 and parts[0].name.endswith("-00001-of-%05d.gguf" % len(parts))
    by_file, by_dir = GGUFSource.open(parts[1]), GGUFSource.open(split_dir)
    assert by_file.files() == by_dir.files() == parts
    ref = GGUFSource.open(one)
    for layer, e in ((0, 1), (1, 0)):
        a, b = ref.read_expert(layer, e), by_dir.read_expert(layer, e)
        assert all(np.array_equal(getattr(a, p), getattr(b, p)) for p in ("gate", "up", "down"))
    jobs = by_dir.matrix_jobs([0, 1])
    assert {j.file for j in jobs} <= set(parts) and len(jobs) == 12
    parts[-1].rename(gguf_dir / "moved.gguf")
    with pytest.raises(InputError, match="incomplete"):
        GGUFSource.open(parts[0])


def _write_custom(path: Path, arch: str, meta: dict, experts: dict[str, np.ndarray], raw_types: dict | None = None):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        w.add_uint32(key, value)
    for name, arr in experts.items():
        qtype = (raw_types or {}).get(name)
        w.add_tensor(name, arr, raw_dtype=qtype) if qtype is not None else w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_deepseek2_dense_and_nextn_layers(tmp_path):
    from ktconvert.formats.gguf_source import GGUFSource

    rng = np.random.default_rng(0)
    E, H, I = 4, 128, 64
    meta = {"deepseek2.block_count": 3, "deepseek2.leading_dense_block_count": 1, "deepseek2.nextn_predict_layers": 1,
            "deepseek2.expert_count": E, "deepseek2.embedding_length": H, "deepseek2.expert_used_count": 2,
            "deepseek2.expert_feed_forward_length": I, "deepseek2.expert_shared_count": 1}
    tensors = {f"blk.{L}.ffn_{p}_exps.weight": rng.standard_normal((E, H, I) if p == "down" else (E, I, H))
               .astype(np.float16) for L in (1, 2) for p in ("gate", "up", "down")}
    _write_custom(tmp_path / "ds.gguf", "deepseek2", meta, tensors)
    src = GGUFSource.open(tmp_path / "ds.gguf")
    info = src.info
    assert (info.family, info.n_layers, info.moe_layers, info.mtp_layers, info.first_dense, info.n_shared) == \
        ("deepseek", 2, (1,), (2,), 1, 1)
    assert src.all_layers(include_mtp=False) == (1,) and src.all_layers() == (1, 2)
    down = src.read_expert(2, 3).down
    assert np.array_equal(down, f32_to_bf16_bits(tensors["blk.2.ffn_down_exps.weight"][3].astype(np.float32)))


def test_bad_inputs_name_file_and_tensor(tmp_path):
    from ktconvert.formats.gguf_source import GGUFSource

    E, H, I = 2, 256, 256
    base = {"qwen3moe.block_count": 1, "qwen3moe.expert_count": E, "qwen3moe.embedding_length": H,
            "qwen3moe.expert_used_count": 1, "qwen3moe.expert_feed_forward_length": I}
    zeros = {f"blk.0.ffn_{p}_exps.weight": np.zeros((E, I, H), np.float16) for p in ("gate", "up", "down")}
    _write_custom(tmp_path / "wrong.gguf", "qwen3moe", {**base, "qwen3moe.expert_feed_forward_length": 128}, zeros)
    with pytest.raises(ShapeError, match=r"wrong\.gguf: blk\.0\.ffn_gate_exps\.weight"):
        GGUFSource.open(tmp_path / "wrong.gguf").validate()
    _write_custom(tmp_path / "arch.gguf", "llama4", {"llama4.block_count": 1}, zeros)
    with pytest.raises(ManifestError, match="llama4"):
        GGUFSource.open(tmp_path / "arch.gguf")
    q81 = dict(zeros)
    q81["blk.0.ffn_up_exps.weight"] = np.zeros((E, I, H // 32 * 40), np.uint8)
    _write_custom(tmp_path / "q81.gguf", "qwen3moe", base, q81, {"blk.0.ffn_up_exps.weight": T.Q8_1})
    with pytest.raises(InputError, match=r"q81\.gguf: blk\.0\.ffn_up_exps\.weight: .*found Q8_1"):
        GGUFSource.open(tmp_path / "q81.gguf").validate()
    from ktconvert.cpu.convert import convert_cpu

    with pytest.raises(InputError, match="Q8_1"):
        convert_cpu(tmp_path / "q81.gguf", tmp_path / "out", method="amxint4", numa=1)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_sniff_and_registry(tmp_path, gguf_dir):
    from ktconvert.formats.base import SOURCES
    from ktconvert.formats.gguf_source import GGUFSource
    from ktconvert.formats.sources import source_class

    assert SOURCES.get("gguf") is GGUFSource and SOURCES.get("llama.cpp") is GGUFSource
    assert source_class(next(gguf_dir.glob("*.gguf"))) is GGUFSource
    (tmp_path / "x.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert not GGUFSource.sniff(tmp_path / "x.safetensors") and not GGUFSource.sniff(tmp_path)
    assert GGUFSource.sniff(next(gguf_dir.glob("*.gguf")))


# ---------------------------------------------------------------- llama.cpp-quantized fixtures (committed)

LLAMA_FIXTURES = sorted(SOURCES_JSON)


def test_fixture_files_match_sources_json():
    assert LLAMA_FIXTURES, "tests/golden/gguf/SOURCES.json lists no fixtures"
    for name, rec in SOURCES_JSON.items():
        data = (GOLDEN / name).read_bytes()
        assert len(data) == rec["bytes"] < 1 << 20 and hashlib.sha256(data).hexdigest() == rec["sha256"], name


@pytest.mark.parametrize("name", LLAMA_FIXTURES)
def test_llama_cpp_fixture_decodes_like_gguf_py(name, monkeypatch):
    from ktconvert.formats.gguf_source import GGUFSource

    path = GOLDEN / name
    src = GGUFSource.open(path)
    src.validate()
    types = {t.name: t for t in GGUFReader(path).tensors}
    for job in src.matrix_jobs(src.all_layers()):
        t = types[job.tensor]
        raw = np.ascontiguousarray(t.data[job.expert]).reshape(-1).view(np.uint8)
        want = f32_to_bf16_bits(gguf_py_f32(raw, t.tensor_type.name)).reshape(t.data.shape[1], -1)
        for impl in IMPLS + ["numpy"]:
            got = ggml.dequantize_bf16(raw, int(t.tensor_type), impl=impl).reshape(want.shape)
            assert np.array_equal(got, want), (name, job.tensor, impl)
        assert np.array_equal(src.decode(job, raw)[job.projs[0]], want)
    assert set(src.ggml_types()) == set(SOURCES_JSON[name]["expert_tensor_types"].values())


def _fixture_with(type_name: str) -> Path:
    for name, rec in SOURCES_JSON.items():
        if type_name in rec["expert_tensor_types"].values():
            return GOLDEN / name
    pytest.skip(f"no fixture with {type_name} experts")


def test_inspect_and_plan_show_gguf(tmp_path):
    from ktconvert.api import plan
    from ktconvert.run.inspection import inspect, render

    path = _fixture_with("Q4_K")
    info = inspect(path)
    assert info["input_format"] == "gguf" and info["family"] == "qwen3_moe" and info["experts"] == 2
    assert "Q4_K" in info["quantization"]["gguf_expert_types"] and "gguf" in render(info)
    p = plan(path, method="amxint4", numa=2, out=str(tmp_path / "o")).cpu
    assert p["input_format"] == "gguf" and p["layers"] == [0, 1] and p["source_config_sha256"] is None


# ---------------------------------------------------------------- end to end

def _reference_conversion(path: Path, numa: int) -> dict[str, bytes]:
    """Output tensor key -> bytes, built from gguf-py's dequantization rounded to BF16 and kt-kernel's AMXINT4."""
    from ktconvert.layouts.naming import merged_key
    from ktconvert.methods import METHODS

    method = METHODS.get("amxint4")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    out = {}
    for name, t in tensors.items():
        if "_exps.weight" not in name:
            continue
        layer, proj = int(name.split(".")[1]), name.split(".")[2][4:-5]
        for e in range(t.data.shape[0]):
            raw = np.ascontiguousarray(t.data[e]).reshape(-1).view(np.uint8)
            w = f32_to_bf16_bits(gguf_py_f32(raw, t.tensor_type.name)).reshape(t.data.shape[1], -1)
            inter = w.shape[1] if proj == "down" else w.shape[0]
            step = inter // numa
            for part in range(numa):
                piece = w[:, part * step:(part + 1) * step] if proj == "down" else w[part * step:(part + 1) * step]
                blob, scale = method.quantize(np.ascontiguousarray(piece))
                out[merged_key(layer, proj, e, part, "weight")] = np.asarray(blob).tobytes()
                out[merged_key(layer, proj, e, part, "scale")] = np.asarray(scale, np.float32).tobytes()
    return out


@pytest.mark.parametrize("numa", [1, 2])
def test_convert_cpu_end_to_end(tmp_path, numa):
    from safetensors.numpy import load_file

    from ktconvert.cpu.convert import convert_cpu

    path = _fixture_with("Q4_K")
    out = tmp_path / "out"
    convert_cpu(path, out, method="amxint4", numa=numa, threads=2)
    got = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        got.update({k: v.tobytes() for k, v in load_file(shard).items()})
    want = _reference_conversion(path, numa)
    assert set(got) == set(want)
    assert [k for k in want if got[k] != want[k]] == []
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert list(manifest["source"]["files"]) == [path.name]
    assert manifest["source"]["files"][path.name]["blake3"] == blake3.blake3(path.read_bytes()).hexdigest()

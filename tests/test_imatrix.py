"""Importance matrices (ktconvert.quant.imatrix) and quantizing with one (ggml_quant.quantize(imatrix=...), native
kt_ggml_quantize_imatrix, --method llamafile --imatrix).

Golden values: llama.cpp's own quantizer, ``ggml_quantize_chunk`` with an importance matrix, of the llama.cpp that
llama-cpp-python 0.3.36 vendors (golden/gguf/make_imatrix_fixtures.py, SOURCES-imatrix.json): sha256 of the
hand-picked rows of make_ggml_quant_fixture.cases() under six importance vectors (ggml-imatrix-cases.json), and of
every routed-expert tensor of the tiny qwen3_moe model quantized with the importance matrix committed as
tiny-qwen3moe-imatrix.gguf / .dat, each expert with its slice (ggml-imatrix-expert-hashes.json). That GGUF was read
back by llama.cpp's own GGUF parser when written. And llama-cpp-python's llama_model_quantize with params.imatrix
(llama-quantize-imatrix.json): per-expert slicing and type choices as llama-quantize makes them. The reader's
derivation (in_sum2 / lround(count), 1 for count 0; legacy sums / ncall) is checked on hand-made files with values
worked out here from quantize.cpp's rules.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ktconvert import native  # noqa: E402
from ktconvert.errors import UsageError  # noqa: E402
from ktconvert.native import ggml_quant as native_ggml  # noqa: E402
from ktconvert.quant import ggml_quant as gq  # noqa: E402
from ktconvert.quant import imatrix  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "gguf"
CASES = json.loads((GOLDEN / "ggml-imatrix-cases.json").read_text())
EXPERTS = json.loads((GOLDEN / "ggml-imatrix-expert-hashes.json").read_text())
SOURCES = json.loads((GOLDEN / "SOURCES-imatrix.json").read_text())
IMATRIX_GGUF, IMATRIX_DAT = GOLDEN / "tiny-qwen3moe-imatrix.gguf", GOLDEN / "tiny-qwen3moe-imatrix.dat"
SHAPE = dict(hidden=256, intermediate=512, experts=4, layers=2)

needs_native = pytest.mark.skipif(not native.available() or not native_ggml.supports("Q4_K"),
                                  reason="native library not built")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"golden_{name}", GOLDEN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _impls() -> list[str]:
    return native.usable_impls()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("imx") / "qwen3", "qwen3_moe", **SHAPE)


# ---------------------------------------------------------------- the quantizers against ggml_quantize_chunk

def test_fixtures_are_the_recorded_files():
    for name, rec in SOURCES.items():
        data = (GOLDEN / name).read_bytes()
        assert len(data) == rec["bytes"] and hashlib.sha256(data).hexdigest() == rec["sha256"], name
        assert rec["tool_version"] == "0.3.36"
    assert set(CASES["sha256"]) == {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@needs_native
@pytest.mark.parametrize("kind", sorted(CASES["sha256"]))
def test_every_type_with_an_importance_matrix_equals_ggml(kind):
    """Zero, constant, spiky, tiny, huge, BF16-valued rows and sub-blocks of very different size, under chi-square,
    all-ones, 30 %-zero, nine-decade, all-zero and overflowing (1e30) importances: llama.cpp's bytes, every
    implementation this CPU runs, also threaded (rows on the pool)."""
    x = _load("make_ggml_quant_fixture").cases()
    qws = _load("make_imatrix_fixtures").importance_cases(n=x.shape[1])
    want = CASES["sha256"][kind]
    assert len(want) == len(qws) == 6
    for impl in _impls():
        got = [_sha(gq.quantize(x, kind, imatrix=qw, impl=impl)) for qw in qws]
        assert got == want, (kind, impl, [i for i, (a, b) in enumerate(zip(got, want)) if a != b])
    assert [_sha(gq.quantize(x, kind, imatrix=qw, threads=3)) for qw in qws] == want
    if kind == "Q4_0":          # rows of 13 blocks: the row's own mean square, a partial group of 8 blocks
        n = _load("make_imatrix_fixtures").Q4_0_SHORT
        for impl in _impls():
            got = [_sha(gq.quantize(np.ascontiguousarray(x[:, :n]), kind, imatrix=qw[:n], impl=impl)) for qw in qws]
            assert got == CASES["q4_0_first_416_columns"], impl


@needs_native
@pytest.mark.parametrize("kind", gq.IMATRIX_TYPES)
def test_importance_changes_the_bytes_and_lowers_the_weighted_error(kind):
    """The imatrix path is not the plain one: its bytes differ, and the error weighted by the importances (what the
    search minimises) is lower than the plain quantizer's on Gaussian rows."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((32, 512)) * 0.02).astype(np.float32)
    qw = rng.chisquare(1, 512).astype(np.float32)
    plain, weighted = gq.quantize(x, kind), gq.quantize(x, kind, imatrix=qw)
    assert not np.array_equal(plain, weighted)
    err = {name: float((qw * (gq.dequantize(q, kind, 512) - x) ** 2).sum()) for name, q in
           (("plain", plain), ("weighted", weighted))}
    assert err["weighted"] < err["plain"], err


@needs_native
def test_types_ggml_does_not_weight_ignore_the_matrix():
    x = _load("make_ggml_quant_fixture").cases()
    qw = np.arange(x.shape[1], dtype=np.float32)
    for kind in ("Q8_0", "F16", "BF16"):
        assert np.array_equal(gq.quantize(x, kind, imatrix=qw), gq.quantize(x, kind)), kind


def test_bad_importance_slices_are_refused():
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(Exception, match="256 values"):
        gq.quantize(x, "Q4_K", imatrix=np.ones(128, np.float32), where="t")
    with pytest.raises(Exception, match="NaN or Inf in the importance"):
        gq.quantize(x, "Q4_K", imatrix=np.full(256, np.inf, np.float32), where="t")


# ---------------------------------------------------------------- the reader

def _write_gguf(path: Path, entries: dict, keys: bool = True) -> Path:
    w = gguf.GGUFWriter(str(path), arch=None)
    w.add_type("imatrix")
    if keys:
        w.add_array("imatrix.datasets", ["d"])
        w.add_uint32("imatrix.chunk_count", 3)
        w.add_uint32("imatrix.chunk_size", 512)
    for name, tensors in entries.items():
        for suffix, value in tensors.items():
            w.add_tensor(name + suffix, np.asarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_values_are_sums_over_rounded_counts(tmp_path):
    """quantize.cpp: count = lround(counts) (half away from zero), value = in_sum2 / count; a count of 0 (rounded)
    gives 1 for that matrix's values."""
    sums = np.array([[8, 2, 1], [5, 5, 5], [9, 3, 6], [7, 7, 7], [1, 2, 4]], np.float32)
    counts = np.array([[4], [0], [2.5], [0.49], [2.49]], np.float32)
    path = _write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_up_exps.weight": {".in_sum2": sums, ".counts": counts}})
    imx = imatrix.load(path)
    want = [2, 0.5, 0.25, 1, 1, 1, 3, 1, 2, 1, 1, 1, 0.5, 1, 2]
    assert imx.format == "gguf" and imx.datasets == ["d"] and imx.chunk_count == 3
    assert imx.values("blk.0.ffn_up_exps.weight").tolist() == want
    assert imx.expert("blk.0.ffn_up_exps.weight", 2, 3).tolist() == [3, 1, 2]
    assert imx.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    imx.check({"blk.0.ffn_up_exps.weight": (5, 3)})


def test_legacy_values_are_sums_over_ncall(tmp_path):
    """legacy .dat: value = sums / ncall; ncall <= 0: the sums as stored; the trailing chunk count / dataset."""
    def entry(name: str, ncall: int, values) -> bytes:
        v = np.asarray(values, "<f4")
        return struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, v.size) + v.tobytes()

    path = tmp_path / "m.dat"
    path.write_bytes(struct.pack("<i", 2) + entry("a.weight", 4, [8, 2, 3]) + entry("b.weight", 0, [8, 2]) +
                     struct.pack("<ii", 7, 4) + b"wiki")
    imx = imatrix.load(path)
    assert imx.format == "legacy" and imx.chunk_count == 7 and imx.datasets == ["wiki"]
    assert imx.values("a.weight").tolist() == [2, 0.5, 0.75] and imx.values("b.weight").tolist() == [8, 2]


def test_committed_gguf_and_dat_give_the_make_scripts_values():
    """Both committed files (powers-of-two counts, one expert with count 0) read as the values the fixtures were
    quantized with, the same for both formats."""
    make = _load("make_imatrix_fixtures")
    entries = make.expert_importance()
    a, b = imatrix.load(IMATRIX_GGUF), imatrix.load(IMATRIX_DAT)
    assert sorted(a.sums) == sorted(b.sums) == sorted(entries)
    for name, (sums, counts) in entries.items():
        want = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], 1).reshape(-1)
        assert np.array_equal(a.values(name), want) and np.array_equal(b.values(name), want), name
    name, expert = make.ZERO_COUNT
    assert (a.expert(name, expert, 256) == 1).all()


@pytest.mark.parametrize("case", ["missing", "size", "nan", "no-keys", "half", "garbage", "absent"])
def test_bad_files_and_entries_are_one_line_usage_errors(tmp_path, case):
    ok = {".in_sum2": np.ones((2, 4)), ".counts": np.ones((2, 1))}
    name = "blk.0.ffn_gate_exps.weight"
    path = tmp_path / "m.gguf"
    if case == "missing":
        _write_gguf(path, {"blk.0.ffn_up_exps.weight": ok})
    elif case == "size":
        _write_gguf(path, {name: {".in_sum2": np.ones((2, 3)), ".counts": np.ones((2, 1))}})
    elif case == "nan":
        _write_gguf(path, {name: {".in_sum2": np.full((2, 4), np.nan), ".counts": np.ones((2, 1))}})
    elif case == "no-keys":
        _write_gguf(path, {name: ok}, keys=False)
    elif case == "half":
        _write_gguf(path, {name: {".in_sum2": np.ones((2, 4))}})
    elif case == "garbage":
        path.write_bytes(b"\x01\x00\x00\x00\xff\xff")
    with pytest.raises(UsageError) as err:
        imatrix.load(path).check({name: (2, 4)})
    text = str(err.value)
    assert "\n" not in text and str(path) in text, text
    expect = {"missing": name, "size": "2 x 4 = 8 values", "nan": "non-finite", "no-keys": "imatrix.chunk_size",
              "half": ".counts", "garbage": "file ends early", "absent": "cannot read"}[case]
    assert expect in text, text


# ---------------------------------------------------------------- --method llamafile --imatrix

def _convert(model, out, ggml_type: str, imatrix_path: Path):
    from ktconvert.formats.sources import open_source
    from ktconvert.methods.llamafile import Llamafile

    source = open_source(model)
    method = Llamafile.configured(ggml_type=ggml_type, imatrix=str(imatrix_path))
    sink = method.open_sink(out, list(source.info.moe_layers), source.info, 1, "gguf", False)
    tensors = {}
    for layer in source.info.moe_layers:
        writer = sink.begin_layer(layer)
        for e in range(source.info.n_experts):
            weights = source.read_expert(layer, e)
            for proj in ("gate", "up", "down"):
                method.write_matrix(writer, proj, e, getattr(weights, proj), numa=1, quant="rtn", where="")
        tensors.update(writer.finish().tensors)
    return method, tensors


@needs_native
@pytest.mark.parametrize("ggml_type", sorted(EXPERTS["sha256"]))
def test_expert_tensors_equal_llama_cpp_with_the_imatrix(model, tmp_path, ggml_type):
    """Every routed-expert tensor written with --imatrix (GGUF file) is llama.cpp's ggml_quantize_chunk of the
    same experts, each with its own slice of the matrix."""
    assert EXPERTS["model"].endswith(json.dumps(SHAPE) + ")")
    method, tensors = _convert(model, tmp_path / "out", ggml_type, IMATRIX_GGUF)
    assert tensors == EXPERTS["sha256"][ggml_type]
    assert method.manifest_fields()["imatrix_sha256"] == SOURCES[IMATRIX_GGUF.name]["sha256"]


@needs_native
def test_legacy_dat_gives_the_same_experts(model, tmp_path):
    _, tensors = _convert(model, tmp_path / "out", "Q6_K", IMATRIX_DAT)
    assert tensors == EXPERTS["sha256"]["Q6_K"]


def _cli(*args, code: int = 0) -> str:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", *map(str, args)], capture_output=True,
                          text=True)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return proc.stdout or proc.stderr


@needs_native
def test_cli_imatrix_end_to_end_and_refusals(model, tmp_path):
    """`ktconvert cpu --method llamafile --ggml-type Q4_K --imatrix FILE`: llama.cpp's bytes, the file's sha256 in
    ktconvert.json, verify passes; an imatrix of another model (an entry missing / of the wrong size) or --imatrix
    with another method: exit 2, one line, OUT never made."""
    out = tmp_path / "out"
    _cli("cpu", model, out, "--method", "llamafile", "--ggml-type", "Q4_K", "--imatrix", IMATRIX_GGUF, "--quiet")
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert manifest["tensors"] == EXPERTS["sha256"]["Q4_K"]
    assert manifest["imatrix_sha256"] == SOURCES[IMATRIX_GGUF.name]["sha256"]
    assert manifest["imatrix_file"] == IMATRIX_GGUF.name
    report = json.loads(_cli("verify", out, "--source", model, "--hashes", "--json"))
    assert report["ok"], report["problems"]

    bad = tmp_path / "other.gguf"
    _write_gguf(bad, {"blk.0.ffn_gate_exps.weight": {".in_sum2": np.ones((4, 128)), ".counts": np.ones((4, 1))}})
    for args, words in (((bad,), [str(bad), "blk.0.ffn_gate_exps.weight", "4 x 256 = 1024 values"]),
                        ((tmp_path / "none.gguf",), ["none.gguf", "cannot read"])):
        err = _cli("cpu", model, tmp_path / "o2", "--method", "llamafile", "--imatrix", *args, code=2)
        assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    err = _cli("cpu", model, tmp_path / "o2", "--method", "amxint4", "--imatrix", IMATRIX_GGUF, code=2)
    assert "--imatrix does not apply to --method amxint4" in err
    assert not (tmp_path / "o2").exists()


@needs_native
def test_llama_model_quantize_with_an_imatrix_equals_ours(tmp_path):
    """llama_model_quantize itself (params.imatrix, pure Q4_K / Q5_K / Q6_K / Q4_0 / Q8_0 and the Q4_K_M mix) on the
    F16 model of make_fixtures.py: every expert tensor, its type and its bytes, is ours from the same F16 values
    with each expert's slice (llama-quant.cpp's per-expert imatrix rows), and the mix picks the types expert_type
    does (an imatrix does not change the K mixes' expert choices)."""
    from ktconvert.methods.llamafile import Llamafile

    record = json.loads((GOLDEN / "llama-quantize-imatrix.json").read_text())
    fixtures, make = _load("make_fixtures"), _load("make_imatrix_fixtures")
    path = tmp_path / "tiny-qwen3moe-F16.gguf"
    fixtures.write_moe_gguf(path, **fixtures.TINY)
    source = {t.name: np.asarray(t.data).astype(np.float32) for t in gguf.GGUFReader(path).tensors}
    importance = make.model_importance()
    mix = Llamafile.configured(ggml_type="Q4_K_M")
    checked = 0
    for label, tensors in record["tensors"].items():
        assert len(tensors) == 6, label
        for name, (kind, digest) in tensors.items():
            x = source[name]                                             # [E, rows, k]
            qw = importance[name].reshape(x.shape[0], x.shape[-1])
            ours = np.stack([gq.quantize(x[e], kind, imatrix=qw[e]) for e in range(x.shape[0])])
            assert _sha(ours) == digest, (label, name, kind)
            if label == "Q4_K_M":
                layer, proj = int(name.split(".")[1]), name.split(".")[2].split("_")[1]
                assert mix.expert_type(proj, layer, 2) == kind, name
            else:
                assert kind == label, (label, name)
            checked += 1
    assert checked == 36


@needs_native
def test_resume_with_other_imatrix_contents_at_the_same_path_is_refused(model, tmp_path):
    """The journal records the importance matrix's sha256, not its path: a resumed run whose --imatrix file now
    holds other values is refused (exit 2) like any other option change; the same contents resume to the bytes of
    one uninterrupted run."""
    import os
    import shutil
    import subprocess
    import sys

    imx, out = tmp_path / "imatrix.gguf", tmp_path / "out"
    shutil.copyfile(IMATRIX_GGUF, imx)
    args = [sys.executable, "-m", "ktconvert.cli.main", "cpu", str(model), str(out), "--method", "llamafile",
            "--ggml-type", "Q6_K", "--imatrix", str(imx), "--quiet"]
    env = {**os.environ, "KTCONVERT_NO_PROGRESS": "1"}
    first = subprocess.run(args, env={**env, "KTCONVERT_FAULT_AFTER_JOBS": "2"}, capture_output=True, text=True)
    assert first.returncode != 0 and not (out / "ktconvert.json").exists(), first.stderr
    shutil.copyfile(IMATRIX_DAT, imx)           # other bytes (the same values in the legacy format)
    other = subprocess.run(args + ["--resume"], env=env, capture_output=True, text=True)
    assert other.returncode == 2 and "imatrix" in other.stderr, other.stderr
    shutil.copyfile(IMATRIX_GGUF, imx)
    again = subprocess.run(args + ["--resume"], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert manifest["tensors"] == EXPERTS["sha256"]["Q6_K"]


def test_help_names_the_values():
    """--help shows what the values are (FILE, SIZE), on `cpu` and on `convert`'s targets alike."""
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    for command in ("cpu", "convert"):
        text = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
        assert "--imatrix FILE" in text and "--split-max-size SIZE" in text, command

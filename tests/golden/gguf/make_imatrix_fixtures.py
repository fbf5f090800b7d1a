"""Regenerate the importance-matrix fixtures of this directory with llama.cpp's own quantizer (SLOW, not run by tests).

Needs libggml-base of the llama.cpp that llama-cpp-python 0.3.36 vendors, built as make_ggml_quant_fixture.py says
(ggml-base: no -march flags, no FMA contraction), and for llama-quantize-imatrix.json llama-cpp-python 0.3.36 itself
(its own venv, as make_fixtures.py says):

    python tests/golden/gguf/make_imatrix_fixtures.py build/bin/libggml-base.so
    /path/to/llama-venv/bin/python tests/golden/gguf/make_imatrix_fixtures.py --llama

Writes:

* ggml-imatrix-cases.json: sha256 of ``ggml_quantize_chunk(type, cases(), ..., imatrix=qw)`` (llama.cpp's
  quantize_row_<type>_impl, what ``llama_model_quantize`` runs with an importance matrix; the same qw for every row,
  as for the rows of one expert) for the hand-picked rows of make_ggml_quant_fixture.cases() and each importance
  vector of importance_cases(); for Q4_0 also their first 416 columns (13 blocks a row).
* tiny-qwen3moe-imatrix.gguf: an importance matrix of the routed experts of ``make_tiny_model(qwen3_moe, **TINY)``
  in llama-imatrix's GGUF layout (general.type "imatrix", imatrix.datasets / chunk_count / chunk_size, per tensor
  F32 ``NAME.in_sum2`` [n_expert, n_per_row] and ``NAME.counts`` [n_expert, 1]), written with gguf-py. The counts
  are powers of two (so in_sum2 / count is exact) and expert 3 of blk.1.ffn_up_exps has count 0 (llama-quantize
  then uses 1 for its columns).
* tiny-qwen3moe-imatrix.dat: the same values in the legacy format (ncall 2, sums = 2 x values: exact).
* SOURCES-imatrix.json: tool, version, bytes and sha256 of each file above (SOURCES.json lists llama_model_quantize
  model fixtures only: its readers open each entry as a model).
* llama-quantize-imatrix.json (--llama): type and sha256 of every routed-expert tensor ``llama_model_quantize``
  writes from make_fixtures.write_moe_gguf's F16 model with params.imatrix = model_importance() (pure Q4_K / Q5_K /
  Q6_K / Q4_0 / Q8_0, and the Q4_K_M mix): llama-quantize's own slicing per expert and its type choices.
* ggml-imatrix-expert-hashes.json: sha256 of every routed-expert tensor of that model quantized by
  ``ggml_quantize_chunk`` with those values, expert e's rows with the slice [e * n_per_row, (e + 1) * n_per_row)
  (llama-quant.cpp llama_tensor_quantize_impl: ``imatrix + (row / nrows_per_expert) * n_per_row``).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import struct
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TINY = dict(hidden=256, intermediate=512, experts=4, layers=2)
TYPES = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}   # ggml_type ids
TOOL = "llama-cpp-python 0.3.36 vendored llama.cpp, libggml-base ggml_quantize_chunk with an importance matrix"
ZERO_COUNT = ("blk.1.ffn_up_exps.weight", 3)      # (tensor, expert) whose count is 0 in the imatrix
Q4_0_SHORT = 416                                  # a Q4_0 row of 13 blocks


def importance_cases(seed: int = 1, n: int = 512) -> np.ndarray:
    """float32 [6, n]: chi-square(1) (squared activations), all ones, 30 % zeros, values over nine decades, all
    zero (every weighted sum 0) and 1e30 (weighted sums overflow to Inf)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.chisquare(1, n), np.ones(n), np.where(rng.random(n) < 0.3, 0, rng.random(n)),
                     10.0 ** rng.uniform(-6, 3, n), np.zeros(n), np.full(n, 1e30)]).astype(np.float32)


def expert_importance(seed: int = 2) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{tensor name: (in_sum2 float32 [E, n_per_row], counts float32 [E])} of the tiny model's expert tensors."""
    rng = np.random.default_rng(seed)
    h, i, e = TINY["hidden"], TINY["intermediate"], TINY["experts"]
    out = {}
    for layer in range(TINY["layers"]):
        for proj, k in (("gate", h), ("up", h), ("down", i)):
            name = f"blk.{layer}.ffn_{proj}_exps.weight"
            counts = (2.0 ** rng.integers(4, 12, e)).astype(np.float32)
            if name == ZERO_COUNT[0]:
                counts[ZERO_COUNT[1]] = 0
            act = rng.standard_normal((e, k)).astype(np.float32) * np.float32(0.5) + \
                rng.standard_t(3, k).astype(np.float32)[None, :]
            sums = (act * act * counts[:, None]).astype(np.float32)
            out[name] = (sums, counts)
    return out


def importance_values(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """llama-quantize's values (quantize.cpp load_imatrix): in_sum2 / count per expert, 1 where the count is 0."""
    return np.where(counts[:, None] > 0, sums / np.where(counts > 0, counts, 1)[:, None], 1).astype(np.float32)


def _quantize(lib, type_id: int, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], lib.ggml_row_size(type_id, x.shape[1])), np.uint8)
    qw = None if qw is None else np.ascontiguousarray(qw, dtype=np.float32)
    n = fn(type_id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None if qw is None else qw.ctypes.data)
    assert n == out.size, (n, out.size)
    return out


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def write_imatrix_gguf(path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch=None)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["ktconvert-test-activations"])
    w.add_uint32("imatrix.chunk_count", 16)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, counts) in sorted(entries.items()):
        w.add_tensor(f"{name}.in_sum2", sums)
        w.add_tensor(f"{name}.counts", counts.reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_with_ggml(lib, path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """llama.cpp's own GGUF parser (gguf_init_from_file of libggml-base, as common_imatrix_load opens the file)
    reads the imatrix GGUF: its three keys and, per entry, F32 tensors NAME.in_sum2 / NAME.counts of the sizes
    written."""
    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
    for fn, res, args in (("gguf_find_key", ctypes.c_int64, [ctypes.c_char_p]),
                          ("gguf_get_n_tensors", ctypes.c_int64, []),
                          ("gguf_get_tensor_name", ctypes.c_char_p, [ctypes.c_int64]),
                          ("gguf_get_tensor_type", ctypes.c_int, [ctypes.c_int64]),
                          ("gguf_get_tensor_size", ctypes.c_size_t, [ctypes.c_int64]),
                          ("gguf_free", None, [])):
        getattr(lib, fn).restype = res
        getattr(lib, fn).argtypes = [ctypes.c_void_p] + args
    ctx = lib.gguf_init_from_file(str(path).encode(), Params(True, None))
    assert ctx, path
    for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):
        assert lib.gguf_find_key(ctx, key.encode()) >= 0, key
    found = {lib.gguf_get_tensor_name(ctx, i).decode(): (lib.gguf_get_tensor_type(ctx, i),
                                                           lib.gguf_get_tensor_size(ctx, i))
             for i in range(lib.gguf_get_n_tensors(ctx))}
    lib.gguf_free(ctx)
    want = {}
    for name, (sums, counts) in entries.items():
        want[f"{name}.in_sum2"] = (0, sums.nbytes)     # GGML_TYPE_F32
        want[f"{name}.counts"] = (0, counts.nbytes)
    assert found == want, (found, want)


def write_imatrix_dat(path: Path, values: dict[str, np.ndarray], ncall: int = 2) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(values)))
        for name, v in sorted(values.items()):
            f.write(struct.pack("<i", len(name.encode())) + name.encode())
            flat = (v.reshape(-1) * np.float32(ncall)).astype("<f4")
            f.write(struct.pack("<ii", ncall, flat.size) + flat.tobytes())
        dataset = b"ktconvert-test-activations"
        f.write(struct.pack("<ii", 16, len(dataset)) + dataset)


def write_sources() -> None:
    """SOURCES-imatrix.json: tool, version, bytes and sha256 of each fixture file this script wrote."""
    llama = "llama-cpp-python llama_model_quantize with params.imatrix"
    files = (("ggml-imatrix-cases.json", TOOL, "sha256 of ggml_quantize_chunk(type, cases(), imatrix=qw)"),
             ("ggml-imatrix-expert-hashes.json", TOOL, "sha256 of the tiny model's expert tensors, "
                                                       "ggml_quantize_chunk with each expert's imatrix slice"),
             ("tiny-qwen3moe-imatrix.gguf", TOOL, "imatrix in llama-imatrix's GGUF layout, written with gguf "
                                                  f"{version('gguf')}, read back by libggml-base gguf_init_from_file"),
             ("tiny-qwen3moe-imatrix.dat", TOOL, "the same values in llama-imatrix's legacy format"),
             ("llama-quantize-imatrix.json", llama, "types and sha256 of the expert tensors llama_model_quantize "
                                                    "wrote (main_llama)"))
    records = {}
    for name, tool, what in files:
        if (HERE / name).exists():
            data = (HERE / name).read_bytes()
            records[name] = {"tool": tool, "tool_version": "0.3.36", "what": what, "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest(), "script": Path(__file__).name}
    (HERE / "SOURCES-imatrix.json").write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")


def main(lib_path: str) -> int:
    spec = importlib.util.spec_from_file_location("cases", HERE / "make_ggml_quant_fixture.py")
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)
    lib = ctypes.CDLL(lib_path)

    x = fixture.cases()
    qws = importance_cases(n=x.shape[1])
    cases = {name: [_sha(_quantize(lib, tid, x, qw)) for qw in qws] for name, tid in TYPES.items()}
    # Q4_0 rows of 13 blocks (its sigma2 is the whole row's mean square; not a multiple of 8 blocks)
    short = [_sha(_quantize(lib, TYPES["Q4_0"], x[:, :Q4_0_SHORT], qw[:Q4_0_SHORT])) for qw in qws]
    (HERE / "ggml-imatrix-cases.json").write_text(json.dumps(
        {"tool": TOOL, "rows": "make_ggml_quant_fixture.cases()", "importance": "importance_cases(seed 1)",
         "sha256": cases, "q4_0_first_416_columns": short}, indent=2, sort_keys=True) + "\n")

    entries = expert_importance()
    values = {name: importance_values(*pair) for name, pair in entries.items()}
    write_imatrix_gguf(HERE / "tiny-qwen3moe-imatrix.gguf", entries)
    check_with_ggml(lib, HERE / "tiny-qwen3moe-imatrix.gguf", entries)
    write_imatrix_dat(HERE / "tiny-qwen3moe-imatrix.dat", values)
    hashes: dict[str, dict[str, str]] = {name: {} for name in TYPES}
    spec = importlib.util.spec_from_file_location("expert_hashes", HERE / "make_ggml_expert_hashes.py")
    expert_hashes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(expert_hashes)
    for name, matrices in expert_hashes.tiny_expert_matrices(TINY):
        for type_name, tid in TYPES.items():
            raw = [_quantize(lib, tid, x, values[name][e]) for e, x in enumerate(matrices)]
            hashes[type_name][name] = _sha(np.stack(raw))
    (HERE / "ggml-imatrix-expert-hashes.json").write_text(json.dumps(
        {"tool": TOOL, "model": f"ktconvert.examples.tiny.make_tiny_model(qwen3_moe, seed 0, {json.dumps(TINY)})",
         "imatrix": "tiny-qwen3moe-imatrix.gguf (= tiny-qwen3moe-imatrix.dat)", "sha256": hashes},
        indent=2, sort_keys=True) + "\n")
    write_sources()
    return 0


# --------------------------------------------------------------------- llama_model_quantize with an imatrix

MODEL_FTYPES = {"Q4_K": ("Q4_K_M", True), "Q5_K": ("Q5_K_M", True), "Q6_K": ("Q6_K", True), "Q4_0": ("Q4_0", True),
                "Q8_0": ("Q8_0", True), "Q4_K_M": ("Q4_K_M", False)}   # name -> (llama_ftype, pure)


def model_importance(seed: int = 3) -> dict[str, np.ndarray]:
    """{expert tensor name: float32 [E * n_per_row]}: importances of make_fixtures.write_moe_gguf's model (TINY of
    make_fixtures.py), as llama-quantize hands them to llama_model_quantize (already in_sum2 / count)."""
    spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    rng = np.random.default_rng(seed)
    t = fixtures.TINY
    return {f"blk.{L}.ffn_{proj}_exps.weight": rng.chisquare(1, t["experts"] * k).astype(np.float32)
            for L in range(t["layers"]) for proj, k in (("gate", t["hidden"]), ("up", t["hidden"]),
                                                        ("down", t["inter"]))}


def main_llama() -> int:
    """llama-cpp-python's llama_model_quantize (the whole of llama-quantize but the file reading) of
    make_fixtures.write_moe_gguf's F16 model with model_importance() as params.imatrix, per MODEL_FTYPES: sha256
    and ggml type of every routed-expert tensor -> llama-quantize-imatrix.json. Run with llama-cpp-python's venv
    (make_fixtures.py says how to build it; needs no ktconvert)."""
    import llama_cpp
    from gguf import GGUFReader

    spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    importance = model_importance()
    names = sorted(importance)
    table = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
    keep = []
    for i, name in enumerate(names):
        keep.append((name.encode(), importance[name]))
        table[i].name = keep[-1][0]
        table[i].data = importance[name].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        table[i].size = importance[name].size
    table[len(names)].name = None
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tiny-qwen3moe-F16.gguf"
        fixtures.write_moe_gguf(src, **fixtures.TINY)
        for label, (ftype, pure) in MODEL_FTYPES.items():
            out = Path(tmp) / f"{label}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.nthread = 1
            params.pure = pure
            params.imatrix = ctypes.cast(table, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
            assert rc == 0, (label, rc)
            records[label] = {t.name: [t.tensor_type.name, _sha(np.asarray(t.data).view(np.uint8))]
                              for t in GGUFReader(out).tensors if "_exps." in t.name}
    (HERE / "llama-quantize-imatrix.json").write_text(json.dumps(
        {"tool": "llama-cpp-python llama_model_quantize, params.imatrix = model_importance(seed 3), nthread 1",
         "tool_version": llama_cpp.__version__, "source": "make_fixtures.write_moe_gguf(F16, seed 0, TINY)",
         "ftypes": {k: {"ftype": f"LLAMA_FTYPE_MOSTLY_{v[0]}", "pure": v[1]} for k, v in MODEL_FTYPES.items()},
         "tensors": records}, indent=2, sort_keys=True) + "\n")
    write_sources()
    return 0


if __name__ == "__main__":
    sys.exit(main_llama() if sys.argv[1:] == ["--llama"] else main(sys.argv[1]))

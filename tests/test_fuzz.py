"""Property-based fuzzing of the parsers that read files from elsewhere (issue 14, "Fuzzing"): the safetensors header
parser, the GGUF header reader, the bundle reader and the batch-file loader. Whatever the bytes, they return a result or raise one of our
errors (KtConvertError), never anything else, never hang, and never write outside their destination.

Each test runs a few hundred examples in the default suite ("quick") and many more under `-m slow` ("deep"); the
budget is a parameter, so the marker picks it. No example database is written (database=None).
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ktconvert.errors import KtConvertError  # noqa: E402
from test_bundle import _zst_tar  # noqa: E402  (a .tar.zst written by hand: tarfile + zstandard)

BUDGETS = [pytest.param(200, id="quick"), pytest.param(2000, id="deep", marks=pytest.mark.slow)]


def _fuzz(examples: int, strategy, check) -> None:
    """check(example) for `examples` examples of `strategy` (derandomized in the quick budget, no database)."""
    budget = settings(max_examples=examples, deadline=None, database=None, derandomize=examples <= 200,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    budget(given(strategy)(check))()


def _ours(fn) -> tuple[str, object]:
    """("ok", result) or ("refused", KtConvertError); any other exception fails the example."""
    try:
        return "ok", fn()
    except KtConvertError as exc:
        assert "\n" not in str(exc), str(exc)
        return "refused", exc


JSON_LEAF = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                                            inner, max_size=4),
                    max_leaves=20)
DTYPES = st.sampled_from(["U8", "I8", "BF16", "F16", "F32", "I64", "BOOL", "F8_E4M3", "Q4", "", "u8"])


@st.composite
def header_entries(draw):
    """A header that is mostly well-formed: tensors with plausible dtype/shape/offsets, sometimes broken."""
    entries = {}
    offset = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(DTYPES)
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = {"U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8}.get(dtype, 1)
        nbytes = size * math.prod(shape)
        begin = offset + draw(st.sampled_from([0, 0, 0, 1, -1]))
        end = begin + nbytes + draw(st.sampled_from([0, 0, 0, 1, -1]))
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.booleans()) and draw(st.booleans()):
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JSON)
        entries[draw(st.sampled_from([f"t{i}", "t0", "__metadata__"]))] = entry
        offset = max(offset, end)
    if draw(st.booleans()):
        entries["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), JSON_LEAF, max_size=3))
    tail = draw(st.sampled_from([0, 0, 1, 3]))
    return entries, max(offset, 0) + tail


def _safetensors_accepts(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:      # pt: the numpy framework has no BF16 / F8
            for key in f.keys():
                f.get_tensor(key)
        return True
    except Exception:  # noqa: BLE001  (any refusal)
        return False


@pytest.mark.parametrize("examples", BUDGETS)
def test_fuzz_safetensors_header_bytes(examples):
    from ktconvert.formats.safetensors_reader import parse_header

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"

        def check(data):
            path.write_bytes(data)
            _ours(lambda: parse_header(path))

        _fuzz(examples, st.binary(max_size=300) | st.builds(lambda n, body: struct.pack("<Q", n) + body,
                                                            st.integers(0, 2**64 - 1), st.binary(max_size=200)),
              check)


@pytest.mark.parametrize("examples", BUDGETS)
def test_fuzz_safetensors_header_json_is_never_laxer_than_safetensors(examples):
    """Headers that are JSON and mostly well-formed: whatever we accept, safetensors accepts too."""
    pytest.importorskip("torch")
    from ktconvert.formats.safetensors_reader import parse_header

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"

        def check(drawn):
            (header, data_len), pad = drawn
            text = (json.dumps(header) + pad).encode()
            path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(range(256)) * (data_len // 256)
                             + bytes(data_len % 256))
            verdict, _ = _ours(lambda: parse_header(path))
            if verdict == "ok":
                assert _safetensors_accepts(path), header

        _fuzz(examples, st.tuples(header_entries() | JSON.map(lambda v: (v, 0)), st.sampled_from(["", " ", "  \n"])),
              check)


# ---------------------------------------------------------------- bundles

NAMES = st.sampled_from(["a", "a/b", "b.bin", "../x", "/abs", "a\\b", "", ".", "a/./b", "x" * 300, "ktconvert.json",
                         "sub/c.kt"]) | st.text(min_size=1, max_size=12)


@st.composite
def bundles(draw):
    members = [(draw(NAMES), draw(st.binary(max_size=40))) for _ in range(draw(st.integers(0, 4)))]
    files = {}
    for name, data in members:
        if draw(st.booleans()):
            files[name] = {"bytes": len(data) + draw(st.sampled_from([0, 0, 1, -1, 2**40])),
                           "sha256": hashlib.sha256(data).hexdigest() if draw(st.booleans()) else draw(JSON),
                           "git_sha1": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    manifest = draw(st.sampled_from(["ours", "ours", "json"]))
    raw = json.dumps({"files": files}) if manifest == "ours" else json.dumps(draw(JSON))
    first = [] if draw(st.integers(0, 9)) == 0 else [("ktconvert.json", raw.encode())]
    return first + members


@pytest.mark.parametrize("examples", BUDGETS)
def test_fuzz_bundle_reader(examples):
    from ktconvert.ops.bundle import unbundle, verify_bundle

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def check(drawn):
            work = Path(tempfile.mkdtemp(dir=root))
            path = work / "b.tar.zst"
            if isinstance(drawn, bytes):
                path.write_bytes(drawn)
            else:
                _zst_tar(path, drawn)
            verdict, report = _ours(lambda: verify_bundle(path))
            assert verdict == "refused" or isinstance(report, dict)
            dest = work / "dest"
            unpacked, _ = _ours(lambda: unbundle(path, dest))
            if verdict == "ok" and report["ok"]:
                assert unpacked == "ok"
            if unpacked == "refused":
                assert not dest.exists()
            assert {p.name for p in work.iterdir()} <= {"b.tar.zst", "dest"}     # nothing beside DEST

        _fuzz(examples, bundles() | st.binary(max_size=200).map(lambda b: b"\x28\xb5\x2f\xfd" + b), check)


# ---------------------------------------------------------------- batch job files

def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


KEYS = st.sampled_from(["name", "source", "revision", "out", "method", "numa", "layout", "quant", "group_size",
                        "threads", "include_dense", "include_mtp", "allow_drop_bias", "bundle", "publish",
                        "outputs", "hub", "repo", "private", "endpoint", "zzz"])
TOML_LEAF = st.booleans() | st.integers(-3, 2**63 - 1) | st.floats(allow_nan=False, width=32) | \
    st.sampled_from(["amxint4", "hf", "org/repo", "hf://org/r", "x", "safetensors", "kt", "", "false"])
TOML_VALUE = st.recursive(TOML_LEAF, lambda inner: st.lists(inner, max_size=3) |
                          st.dictionaries(KEYS, inner, max_size=5), max_leaves=12)


@st.composite
def near_valid_jobs(draw):
    """A loadable job with up to three keys set to arbitrary TOML values (the values the schema must check)."""
    job = {"name": draw(st.sampled_from(["a", "b", "c"])), "source": "model", "out": "o", "method": "amxint4"}
    for _ in range(draw(st.integers(0, 3))):
        job[draw(KEYS)] = draw(TOML_VALUE)
    return job


@pytest.mark.parametrize("examples", BUDGETS)
def test_fuzz_batch_loader(examples):
    from ktconvert.ops.batch import load_jobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "jobs.toml"

        def check(doc):
            text = doc if isinstance(doc, str) else "".join(f"{k} = {_toml_value(v)}\n" for k, v in doc.items())
            path.write_text(text, encoding="utf-8")
            verdict, jobs = _ours(lambda: load_jobs(path))
            if verdict == "ok":
                for job in jobs:
                    assert isinstance(job["name"], str) and isinstance(job["source"], str) and job["outputs"]
                    for output in job["outputs"]:
                        for key, value in output["cpu"].items():
                            if key.startswith(("include", "allow")):
                                assert type(value) is bool
                            elif key in ("numa", "threads", "group_size"):
                                assert type(value) is int and value >= 1
                            else:
                                assert type(value) is str

        any_doc = st.dictionaries(st.sampled_from(["jobs", "defaults", "x"]),
                                  st.lists(st.dictionaries(KEYS, TOML_VALUE, max_size=6), max_size=3) |
                                  st.dictionaries(KEYS, TOML_VALUE, max_size=4) | TOML_LEAF, max_size=3)
        near_valid = st.builds(lambda jobs: {"jobs": jobs}, st.lists(near_valid_jobs() | TOML_LEAF, min_size=1,
                                                                    max_size=3))
        _fuzz(examples, any_doc | near_valid | st.text(max_size=120), check)


# ---------------------------------------------------------------- GGUF headers

def _small_gguf(path: Path) -> tuple[int, list[int]]:
    """A valid two-layer MoE GGUF (F16 experts [2, 32, 32], a Q8_0 tensor, metadata). Returns where its data
    starts and the byte positions of every tensor info's dims, type and offset fields (as gguf-py reads them)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    w = GGUFWriter(str(path), "qwen3moe")
    for key, value in (("block_count", 2), ("expert_count", 2), ("embedding_length", 32), ("expert_used_count", 1),
                       ("expert_feed_forward_length", 32)):
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    for layer in range(2):
        for proj in ("gate", "up", "down"):
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.full((2, 32, 32), layer + 1, np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 34), np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    fields = [part.ctypes.data - base for t in reader.tensors for part in t.field.parts[3:]]
    return reader.data_offset, fields


def _tiles_its_file(tensors: dict, size: int) -> bool:
    """Accepted tensors lie inside the file and do not overlap (checked here from the TensorRefs alone)."""
    spans = sorted((ref.offset, ref.offset + ref.nbytes) for ref in tensors.values())
    return all(end <= size for _, end in spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _gguf_py_accepts(path: Path) -> bool:
    from gguf import GGUFReader

    try:
        GGUFReader(path)
        return True
    except Exception:  # noqa: BLE001  (any refusal)
        return False


@pytest.mark.parametrize("examples", BUDGETS)
def test_fuzz_gguf_header(examples):
    """Arbitrary bytes, and valid files with header bytes changed or cut: GGUFSource.open returns or raises our error;
    whatever read_header accepts tiles its file and gguf-py's reader accepts too."""
    pytest.importorskip("gguf")
    from ktconvert.formats.gguf_source import GGUFSource, read_header

    with tempfile.TemporaryDirectory() as tmp:
        valid = Path(tmp) / "valid.gguf"
        header_end, fields = _small_gguf(valid)
        original = valid.read_bytes()
        path = Path(tmp) / "model.gguf"

        def check(drawn):
            if isinstance(drawn, bytes):
                data = drawn
            else:
                flips, cut = drawn
                buf = bytearray(original)
                for pos, value in flips:
                    buf[pos] = value
                data = bytes(buf[:cut]) if cut is not None else bytes(buf)
            path.write_bytes(data)
            verdict, header = _ours(lambda: read_header(path))
            if verdict == "ok":
                assert _tiles_its_file(header[1], len(data)) and _gguf_py_accepts(path)
            _ours(lambda: GGUFSource.open(path))

        raw = st.binary(max_size=200) | st.builds(lambda body: b"GGUF\x03\x00\x00\x00" + body, st.binary(max_size=200))
        anywhere = st.integers(0, header_end - 1)
        in_tensor_info = st.builds(lambda pos, delta: pos + delta, st.sampled_from(fields), st.integers(0, 7))
        mutated = st.tuples(st.lists(st.tuples(anywhere | in_tensor_info, st.integers(0, 255)), min_size=1,
                                     max_size=4), st.none() | st.integers(0, len(original)))
        _fuzz(examples, raw | mutated, check)

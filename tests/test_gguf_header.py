"""GGUF header faults are refused when the header is read (issue 14, item 13): one line naming the file and the
tensor (or metadata key), exit 3, for inspect, plan and cpu alike, and nothing written under OUT.

The tensor-info rules are llama.cpp's (gguf.cpp ``gguf_init_from_file_impl``): known type, whole blocks per row,
element count in int64, offsets aligned and each equal to the previous tensor's end rounded up to the alignment.
Faults are made by patching one field of a valid file written by gguf-py, at the byte position gguf-py's own reader
reports for that field.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import struct
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
from click.testing import CliRunner  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGUFReader, GGUFValueType  # noqa: E402

from ktconvert.cli.main import cli  # noqa: E402
from ktconvert.errors import InputError  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "gguf"


def _write_moe_gguf():
    spec = importlib.util.spec_from_file_location("gguf_make_fixtures", GOLDEN / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_moe_gguf


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> Path:
    """Two MoE layers x 4 experts, Q8_0 experts, everything else F16/F32 (tensors in llama.cpp's order)."""
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    _write_moe_gguf()(path, T.Q8_0, layers=2, experts=4, hidden=256, inter=256)
    return path


def field_positions(path: Path, name: str) -> dict[str, int]:
    """Byte positions of one tensor info's name, dims, type and offset fields, and its relative data offset, as
    gguf-py's reader finds them."""
    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    tensor = next(t for t in reader.tensors if t.name == name)
    _len, name_data, _n_dims, dims, raw_type, offset = tensor.field.parts
    return {"name": name_data.ctypes.data - base, "dims": dims.ctypes.data - base, "type": raw_type.ctypes.data - base,
            "offset": offset.ctypes.data - base, "relative": tensor.data_offset - reader.data_offset}


def patched(src: Path, dst: Path, name: str, field: str, value) -> Path:
    """A copy of `src` with tensor `name`'s `field` ("type", "offset", "dim0", "name") set to `value` (a callable
    gets the tensor's relative data offset)."""
    pos = field_positions(src, name)
    value = value(pos["relative"]) if callable(value) else value
    data = {"type": lambda: struct.pack("<I", value), "offset": lambda: struct.pack("<Q", value),
            "dim0": lambda: struct.pack("<Q", value), "name": lambda: value.encode()}[field]()
    shutil.copy(src, dst)
    with open(dst, "r+b") as fh:
        fh.seek(pos["dims" if field == "dim0" else field])
        fh.write(data)
    return dst


UP, GATE, DOWN1 = "blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"
EXPERT_BYTES = 4 * 256 * 256 // 32 * 34     # one Q8_0 expert tensor

TENSOR_FAULTS = [
    pytest.param(UP, "offset", lambda rel: rel - EXPERT_BYTES, UP, "overlaps the previous tensor " + GATE,
                 id="overlapping-offset"),
    pytest.param(UP, "offset", lambda rel: rel + 1, UP, "offset is not aligned; expected a multiple of 32",
                 id="misaligned-offset"),
    pytest.param(UP, "offset", lambda rel: rel + 32, UP, "a gap of 32 bytes", id="gap"),
    pytest.param(UP, "offset", lambda rel: 2 ** 62, UP, "a gap of", id="offset-far-past-the-end"),
    pytest.param(UP, "type", 99, UP, "unknown ggml tensor type id.*found 99", id="unknown-type-id"),
    pytest.param(UP, "type", 4, UP, "unknown ggml tensor type id.*found 4", id="removed-type-id"),
    pytest.param(UP, "type", int(T.Q4_K), "blk.0.ffn_down_exps.weight", UP + r" \(Q4_K .*does not account",
                 id="changed-type-smaller"),
    pytest.param(UP, "type", int(T.Q8_1), "blk.0.ffn_down_exps.weight", "overlaps the previous tensor " + UP +
                 r" \(Q8_1", id="changed-type-larger"),
    pytest.param(DOWN1, "type", int(T.Q4_K), DOWN1, "continues past the last tensor", id="changed-type-last"),
    pytest.param(DOWN1, "type", int(T.F32), DOWN1, "lies outside the file", id="changed-type-last-larger"),
    pytest.param("blk.0.attn_q_norm.weight", "type", int(T.Q4_K), "blk.0.attn_q_norm.weight",
                 "row size is not a multiple of the Q4_K block size", id="row-not-whole-blocks"),
    pytest.param(UP, "dim0", 2 ** 63, UP, "does not fit ggml's int64", id="element-count-overflow"),
    pytest.param(UP, "dim0", 255, UP, "row size is not a multiple of the Q8_0 block size", id="changed-shape"),
    pytest.param("blk.0.attn_v.weight", "name", "blk.0.attn_k.weight", "blk.0.attn_k.weight", "appears twice",
                 id="duplicate-name"),
]


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _assert_refused(result, file_name: str, tensor: str, message: str) -> None:
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"error: {file_name}: {tensor}: "), line
    assert re.search(message, line), line


@pytest.mark.parametrize("name, field, value, named, message", TENSOR_FAULTS)
def test_tensor_info_fault_is_refused_by_every_command(valid_gguf, tmp_path, name, field, value, named, message):
    bad = patched(valid_gguf, tmp_path / "bad.gguf", name, field, value)
    out = tmp_path / "out"
    for args in (("inspect", bad), ("plan", bad, "--method", "amxint4", out),
                 ("cpu", bad, out, "--method", "amxint4", "--quiet")):
        _assert_refused(_cli(*args), "bad.gguf", named, message)
    assert not out.exists() or not any(out.iterdir())


def test_valid_file_is_read_and_its_tensors_tile_the_data_section(valid_gguf):
    """The checks accept what gguf-py writes; every TensorRef agrees with gguf-py's reader."""
    from ktconvert.formats.gguf_source import read_header

    _meta, tensors = read_header(valid_gguf)
    reader = GGUFReader(valid_gguf)
    assert sorted(tensors) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        ref = tensors[t.name]
        assert (ref.offset, ref.nbytes, ref.shape) == (t.data_offset, t.n_bytes, tuple(int(d) for d in t.shape[::-1]))


def _custom_gguf(path: Path, meta: dict, layers=(0,), arch: str = "qwen3moe") -> Path:
    """Expert tensors of `layers` (2 experts, I = H = 32, F16) and metadata {key: (value, GGUFValueType)}."""
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in meta.items():
        w.add_key_value(key, value, vtype)
    for layer in layers:
        for proj in ("gate", "up", "down"):
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.zeros((2, 32, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


U32, I32, F32, STR = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
GOOD_META = {"qwen3moe.block_count": (2, U32), "qwen3moe.expert_count": (2, U32),
             "qwen3moe.embedding_length": (32, U32), "qwen3moe.expert_used_count": (2, U32),
             "qwen3moe.expert_feed_forward_length": (32, U32)}

META_FAULTS = [
    pytest.param("qwen3moe.block_count", ("two", STR), "block_count is not usable.*found 'two'", id="string"),
    pytest.param("qwen3moe.block_count", (2 ** 32 - 1, U32), r"block_count is not usable; expected an integer in "
                 r"\[1, 65536\]", id="huge-block-count"),
    pytest.param("qwen3moe.block_count", (1, U32), "blk.1.ffn_down_exps.weight: tensor of block 1, outside the 1 "
                 "blocks", id="block-count-drops-a-layer"),
    pytest.param("qwen3moe.block_count", (5, U32), "block 4 has no tensors", id="block-count-too-large"),
    pytest.param("qwen3moe.expert_count", (2.5, F32), "expert_count is not usable.*found 2.5", id="float"),
    pytest.param("qwen3moe.expert_used_count", (99, U32), r"expert_used_count is not usable; expected an integer in "
                 r"\[0, 2\]", id="top-k-over-experts"),
    pytest.param("qwen3moe.expert_used_count", (-1, I32), "expert_used_count is not usable", id="negative"),
    pytest.param("qwen3moe.nextn_predict_layers", (5, U32), "nextn_predict_layers is not usable", id="mtp-over-blocks"),
    pytest.param("qwen3moe.embedding_length", ("x", STR), "embedding_length is not usable", id="hidden-string"),
    pytest.param("split.count", ("z", STR), "split.count is not usable", id="split-count-string"),
]


@pytest.mark.parametrize("key, value, message", META_FAULTS)
def test_metadata_fault_is_refused_naming_the_key(tmp_path, key, value, message):
    bad = _custom_gguf(tmp_path / "meta.gguf", {**GOOD_META, key: value}, layers=(0, 1))
    for args in (("inspect", bad), ("cpu", bad, tmp_path / "out", "--method", "amxint4", "--quiet")):
        result = _cli(*args)
        assert result.exit_code == 3 and "Traceback" not in result.output, result.output
        line = result.output.strip().splitlines()[-1]
        assert line.startswith("error: meta.gguf: ") and re.search(message, line), line


def test_good_metadata_opens(tmp_path):
    from ktconvert.formats.gguf_source import GGUFSource

    info = GGUFSource.open(_custom_gguf(tmp_path / "ok.gguf", GOOD_META, layers=(0, 1))).info
    assert (info.n_layers, info.moe_layers, info.n_experts, info.experts_per_tok) == (2, (0, 1), 2, 2)


def test_big_endian_file_is_refused(tmp_path):
    import numpy as np

    from ktconvert.formats.gguf_source import read_header

    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((2, 32, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="be.gguf: big-endian GGUF files are not supported"):
        read_header(path)


@pytest.mark.parametrize("shape", [(0,), (32,), (2, 31), (1, 32), (2, 32, 1)])
def test_misshapen_expert_bias_is_refused(tmp_path, shape):
    """Before: a [0] bias was a ZeroDivisionError traceback in verify --source, [1, 32] a read past the tensor,
    [32] and [2, 31] were read as wrong slices without a word."""
    import numpy as np

    path = tmp_path / "bias.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, (value, vtype) in GOOD_META.items():
        w.add_key_value(key.replace("qwen3moe", "gpt-oss"), 1 if "block_count" in key else value, vtype)
    for proj in ("gate", "up", "down"):
        w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", np.zeros((2, 32, 32), np.float16))
    w.add_tensor("blk.0.ffn_gate_exps.bias", np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    result = _cli("cpu", path, tmp_path / "out", "--method", "bf16", "--quiet", "--allow-drop-bias")
    _assert_refused(result, "bias.gguf", "blk.0.ffn_gate_exps.bias", r"expert bias disagrees with the GGUF metadata; "
                    rf"expected \[2, 32\] of a dequantizable type, found \[{', '.join(map(str, shape))}\] F32")


def _field_start(path: Path, key: str, part: int) -> int:
    """Byte position of part `part` of metadata field `key` (0: key length, ..., the value's length or count)."""
    reader = GGUFReader(path)
    return reader.fields[key].parts[part].ctypes.data - reader.data.ctypes.data


@pytest.mark.parametrize("where, patch, section", [
    pytest.param("GGUF.kv_count", 0, "tensor infos", id="no-metadata-count"),
    pytest.param("general.architecture", 0, "metadata", id="empty-string-length-misparses"),
    pytest.param("GGUF.tensor_count", 10 ** 6, "tensor infos", id="tensor-count-past-the-end"),
    pytest.param("tokenizer-array", 10 ** 6, "metadata", id="array-count-past-the-end"),
])
def test_header_cut_short_is_one_line_naming_the_section(valid_gguf, tmp_path, where, patch, section):
    """gguf-py reads a field past the end of the file as an empty array and then indexes it: before, the one line
    was "not a readable GGUF file (index 0 is out of bounds for axis 0 with size 0)"."""
    bad = tmp_path / "cut.gguf"
    shutil.copy(valid_gguf, bad)
    if where == "tokenizer-array":         # metadata only, its last field an array of three strings
        w = gguf.GGUFWriter(str(bad), "qwen3moe")
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        position = _field_start(bad, "tokenizer.ggml.tokens", 4)      # the array's element count
    else:
        position = _field_start(bad, where, 0 if where.startswith("GGUF.") else 2)
    with open(bad, "r+b") as fh:
        fh.seek(position)
        fh.write(struct.pack("<Q", patch))
    for args in (("inspect", bad), ("plan", bad, "--method", "bf16", "--numa", "1")):
        result = _cli(*args)
        assert result.exit_code == 3, result.output
        line = result.output.strip().splitlines()[-1]
        assert line == (f"error: cut.gguf: GGUF header is cut short: its {section} run past the end of the file (a "
                        "count or length field promises more than the file holds)"), line

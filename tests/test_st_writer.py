"""StreamingSafetensorsWriter: bytes identical to the safetensors library's own writer, atomic finish."""
from __future__ import annotations

import fnmatch
import hashlib
import random

import blake3
import numpy as np
import pytest
from huggingface_hub.utils.sha import git_hash
from safetensors.numpy import load_file, save_file

from ktconvert.errors import OutputError
from ktconvert.formats.fileio import temp_path_for
from ktconvert.formats.st_writer import StreamingSafetensorsWriter

NUMPY_TO_ST = {np.dtype(k): v for k, v in {
    "int8": "I8", "uint8": "U8", "float32": "F32", "float64": "F64", "int16": "I16", "uint16": "U16",
    "float16": "F16", "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64", "bool": "BOOL"}.items()}


def _random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.integers(0, 120, size=shape).astype(dtype)


def _stream(path, tensors: dict, metadata=None, seed=0) -> StreamingSafetensorsWriter:
    specs = [(name, NUMPY_TO_ST[a.dtype], a.shape) for name, a in tensors.items()]
    writer = StreamingSafetensorsWriter(path, specs, metadata=metadata)
    order = list(tensors)
    random.Random(seed).shuffle(order)
    for name in order:
        writer.write(name, tensors[name])
    writer.close()
    return writer


NAMES_THAT_SORT_DIFFERENTLY = ["blk.10.w", "blk.9.w", "blk.2.w", "blk.1.w", "a10", "a9", "a2", "B", "b", "_x"]


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}])
def test_bytes_equal_library_mixed_dtypes(tmp_path, metadata):
    rng = np.random.default_rng(1)
    dtypes = ["int8", "float32", "uint8", "float64", "int16", "uint16", "float16", "int32", "uint32", "int64",
              "uint64", "bool"]
    tensors = {name: _random_array(rng, dtypes[i % len(dtypes)], (i + 1, 3))
               for i, name in enumerate(NAMES_THAT_SORT_DIFFERENTLY + ["z.scale", "z.weight"])}
    tensors["empty"] = np.zeros((0, 4), np.float32)
    tensors["scalar"] = np.array(2.5, np.float64)
    tensors["ünï.名前\t\"q\""] = np.arange(3, dtype=np.int8)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    _stream(tmp_path / "out.safetensors", tensors, metadata=metadata)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize("seed", range(25))
def test_bytes_equal_library_random_sets(tmp_path, seed):
    rng = np.random.default_rng(seed)
    dtypes = ["int8", "float32", "uint8", "int16", "float16", "int64"]
    tensors = {}
    for i in range(int(rng.integers(1, 12))):
        layer, expert = int(rng.integers(0, 40)), int(rng.integers(0, 300))
        name = f"blk.{layer}.ffn_up_exps.{expert}.numa.{i % 3}.{'weight' if i % 2 else 'scale'}"
        shape = tuple(int(x) for x in rng.integers(0, 9, size=int(rng.integers(0, 4))))
        tensors[name] = _random_array(rng, dtypes[int(rng.integers(0, len(dtypes)))], shape)
    metadata = None if seed % 3 == 0 else ({} if seed % 3 == 1 else {"seed": str(seed)})
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    _stream(tmp_path / "out.safetensors", tensors, metadata=metadata, seed=seed)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_bytes_equal_torch_bf16_fp8(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as torch_save

    rng = np.random.default_rng(3)
    bf16_bits = rng.integers(0, 1 << 16, size=(4, 8), dtype=np.uint16)
    fp8_bits = rng.integers(0, 1 << 8, size=(3, 5), dtype=np.uint8) & 0x7E  # avoid NaN patterns
    i8 = rng.integers(-128, 128, size=(100,), dtype=np.int8)
    f32 = rng.standard_normal(7).astype(np.float32)
    torch_save({"model.layers.10.w": torch.from_numpy(bf16_bits.view(np.int16)).view(torch.bfloat16),
                "model.layers.9.w": torch.from_numpy(fp8_bits).view(torch.float8_e4m3fn),
                "blk.1.ffn_up_exps.0.numa.0.weight": torch.from_numpy(i8),
                "blk.1.ffn_up_exps.0.numa.0.scale": torch.from_numpy(f32)}, str(tmp_path / "ref.safetensors"))
    specs = [("blk.1.ffn_up_exps.0.numa.0.weight", "I8", (100,)), ("model.layers.10.w", "BF16", (4, 8)),
             ("blk.1.ffn_up_exps.0.numa.0.scale", "F32", (7,)), ("model.layers.9.w", "F8_E4M3", (3, 5))]
    writer = StreamingSafetensorsWriter(tmp_path / "out.safetensors", specs)
    writer.write("model.layers.9.w", fp8_bits)
    writer.write("blk.1.ffn_up_exps.0.numa.0.scale", f32)
    writer.write("model.layers.10.w", bf16_bits)
    writer.write("blk.1.ffn_up_exps.0.numa.0.weight", i8)
    writer.close()
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_hashes_after_close(tmp_path):
    rng = np.random.default_rng(4)
    tensors = {"w": rng.integers(-9, 9, size=(1000,), dtype=np.int8), "s": rng.standard_normal(10).astype(np.float32)}
    writer = _stream(tmp_path / "a.safetensors", tensors)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert writer.size == len(data)
    assert writer.sha256 == hashlib.sha256(data).hexdigest()
    assert writer.git_sha1 == git_hash(data)
    loaded = load_file(str(tmp_path / "a.safetensors"))
    assert writer.tensor_sha256 == {n: "blake3:" + blake3.blake3(a.tobytes()).hexdigest() for n, a in loaded.items()}


def test_scratch_mode_same_bytes_no_hashes(tmp_path, monkeypatch):
    """fsync_and_hash=False (tiny models): the library's bytes, nothing fsynced, no hashes."""
    import ktconvert.formats.st_writer as st_writer

    rng = np.random.default_rng(5)
    tensors = {"w": rng.integers(-9, 9, size=(300, 7), dtype=np.int8), "s": rng.standard_normal(9).astype(np.float32)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    fsynced = []
    monkeypatch.setattr(st_writer.os, "fsync", fsynced.append)
    specs = [(name, NUMPY_TO_ST[a.dtype], a.shape) for name, a in tensors.items()]
    with StreamingSafetensorsWriter(tmp_path / "out.safetensors", specs, {"format": "pt"}, fsync_and_hash=False) as w:
        for name, array in tensors.items():
            w.write(name, array)
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert (w.sha256, w.git_sha1, w.tensor_sha256, fsynced) == (None, None, {"w": "", "s": ""}, [])


def test_temp_file_never_matches_shard_glob(tmp_path):
    path = tmp_path / "model-00001-of-00002.safetensors"
    writer = StreamingSafetensorsWriter(path, [("w", "I8", (4,))])
    names = [p.name for p in tmp_path.iterdir()]
    assert names == [temp_path_for(path).name]
    assert not fnmatch.fnmatch(names[0], "*.safetensors") and not list(tmp_path.glob("*.safetensors"))
    assert not list(tmp_path.rglob("*.safetensors"))
    writer.write("w", np.arange(4, dtype=np.int8))
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_missing_tensor_at_close_raises_and_leaves_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    writer = StreamingSafetensorsWriter(path, [("a", "I8", (4,)), ("b", "F32", (2,))])
    writer.write("a", np.zeros(4, np.int8))
    with pytest.raises(OutputError, match="b"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


def test_abort_leaves_nothing(tmp_path):
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", "I8", (4,))])
    writer.write("a", np.zeros(4, np.int8))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_context_manager_aborts_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", "I8", (4,))]) as writer:
            writer.write("a", np.zeros(4, np.int8))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [np.zeros(5, np.int8), np.zeros(4, np.uint8), np.zeros((2, 2), np.int8),
                                 np.zeros(4, np.float32)])
def test_wrong_array_raises(tmp_path, bad):
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", "I8", (4,))])
    with pytest.raises(OutputError, match="a"):
        writer.write("a", bad)
    writer.abort()


def test_wrong_byte_count_for_bit_pattern_dtype(tmp_path):
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", "BF16", (4,))])
    with pytest.raises(OutputError):
        writer.write("a", np.zeros(4, np.uint8))   # 4 bytes, BF16 [4] needs 8
    writer.write("a", np.zeros(4, np.uint16))
    writer.close()


def test_write_twice_unknown_name_and_duplicates(tmp_path):
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", "I8", (4,))])
    writer.write("a", np.zeros(4, np.int8))
    with pytest.raises(OutputError, match="twice"):
        writer.write("a", np.zeros(4, np.int8))
    with pytest.raises(OutputError, match="not declared"):
        writer.write("b", np.zeros(4, np.int8))
    writer.abort()
    with pytest.raises(OutputError, match="duplicate"):
        StreamingSafetensorsWriter(tmp_path / "y.safetensors", [("a", "I8", (4,)), ("a", "F32", (1,))])
    assert list(tmp_path.iterdir()) == []


def test_non_contiguous_input_written_in_logical_order(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base.T  # not C-contiguous
    save_file({"t": np.ascontiguousarray(view)}, str(tmp_path / "ref.safetensors"))
    _stream(tmp_path / "out.safetensors", {"t": view})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize("park_bytes, threads", [(0, 1), (0, 4), (1 << 30, 4), (3000, 4)])
def test_file_hash_fed_while_written_any_order(tmp_path, monkeypatch, park_bytes, threads):
    """The file's sha256 / git blob id, fed from the bytes as they go out (pieces ahead of the hashed prefix parked
    as copies up to park_bytes, the rest read back), equal hashlib / huggingface_hub over the finished file, for
    any arrival order and thread count; written in file order nothing is read back."""
    from concurrent.futures import ThreadPoolExecutor

    from ktconvert.formats import ordered_hash

    monkeypatch.setattr(ordered_hash, "PARK_BYTES", park_bytes)
    rng = np.random.default_rng(5)
    tensors = {f"t.{i}": _random_array(rng, dtype, (int(rng.integers(0, 900)),))
               for i, dtype in enumerate(["int8", "float32", "uint16", "int64", "float32", "int8"] * 6)}
    order = sorted(tensors)
    random.Random(park_bytes + threads).shuffle(order)
    specs = [(name, NUMPY_TO_ST[a.dtype], a.shape) for name, a in tensors.items()]
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", specs)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda name: writer.write(name, tensors[name]), order))
    writer.close()
    data = (tmp_path / "x.safetensors").read_bytes()
    assert (writer.sha256, writer.git_sha1) == (hashlib.sha256(data).hexdigest(), git_hash(data))
    assert writer.read_back <= len(data)
    if park_bytes == 0:
        assert writer.read_back > 0

    in_file_order = sorted(writer._spans, key=writer._spans.get)
    writer = StreamingSafetensorsWriter(tmp_path / "y.safetensors", specs)
    for name in in_file_order:
        writer.write(name, tensors[name])
    writer.close()
    assert (tmp_path / "y.safetensors").read_bytes() == data
    assert (writer.sha256, writer.read_back) == (hashlib.sha256(data).hexdigest(), 0)

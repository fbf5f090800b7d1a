"""KtSink: the two kt-kernel layouts (kt-format.md §2.3, §3.3, §3.4) with random blobs of the planned sizes."""
from __future__ import annotations

import hashlib
import json

import blake3
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ktconvert.errors import OutputError
from ktconvert.formats.kt_sink import KtSink
from ktconvert.layouts.naming import dense_key


class Int4Sizes:
    """AMXINT4 sizes straight from kt-format.md §2.1: quant n*k/2 bytes (I8), scale n fp32 values, prefix INT4."""

    file_prefix = "INT4"

    @staticmethod
    def tensor_specs(n, k):
        return {"weight": ("I8", (n * k // 2,)), "scale": ("F32", (n,))}


def _blobs(seed: int, layer: int, E: int, T: int, H: int, I: int) -> dict:
    """{(proj, e, t): (uint8 blob, float32 scale)} with §2.1 sizes for NUMA part t."""
    rng = np.random.default_rng(seed * 1000 + layer)
    It = I // T
    shapes = {"gate": (It, H), "up": (It, H), "down": (H, It)}
    return {(p, e, t): (rng.integers(0, 256, size=n * k // 2, dtype=np.uint8),
                        rng.standard_normal(n).astype(np.float32))
            for p, (n, k) in shapes.items() for e in range(E) for t in range(T)}


def _write_layers(sink: KtSink, E, T, H, I, seed=0):
    results, blobs = {}, {}
    for layer in sink.moe_layers:
        blobs[layer] = _blobs(seed, layer, E, T, H, I)
        writer = sink.begin_layer(layer)
        for (proj, e, t), (blob, scale) in reversed(list(blobs[layer].items())):  # any order
            writer.put(proj, e, t, blob, scale)
        results[layer] = writer.finish()
    return results, blobs


def test_kt_tree_worked_example(tmp_path):
    """E=2, H=256, I=256, T=2: gate/up quant 16384 B, scale 512 B; down quant 16384 B, scale 1024 B."""
    sink = KtSink(tmp_path, "kt", Int4Sizes, numa=2, moe_layers=[1], experts=2, hidden=256, intermediate=256)
    results, blobs = _write_layers(sink, 2, 2, 256, 256)
    want = {}
    for t in range(2):
        for e in range(2):
            for proj, q, s in (("gate", 16384, 512), ("up", 16384, 512), ("down", 16384, 1024)):
                want[f"_layer_1/_numa_{t}/INT4_{proj}_{e}_{q}Byte_quant_.kt"] = q
                want[f"_layer_1/_numa_{t}/INT4_{proj}_{e}_{s}Byte_scale_.kt"] = s
    assert "_layer_1/_numa_0/INT4_gate_0_16384Byte_quant_.kt" in want
    assert "_layer_1/_numa_0/INT4_down_0_1024Byte_scale_.kt" in want
    found = {p.relative_to(tmp_path).as_posix(): p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}
    assert found == want
    assert not list(tmp_path.glob("*.safetensors"))
    blob, scale = blobs[1][("down", 1, 1)]
    assert (tmp_path / "_layer_1/_numa_1/INT4_down_1_16384Byte_quant_.kt").read_bytes() == blob.tobytes()
    assert (tmp_path / "_layer_1/_numa_1/INT4_down_1_1024Byte_scale_.kt").read_bytes() == scale.tobytes()
    files, tensors = results[1]
    assert {r.path: r.bytes for r in files} == want
    for rec in files:
        data = (tmp_path / rec.path).read_bytes()
        assert rec.sha256 == hashlib.sha256(data).hexdigest()
    assert tensors["blk.1.ffn_down_exps.1.numa.1.scale"] == hashlib.sha256(scale.tobytes()).hexdigest()
    assert len(tensors) == 3 * 2 * 2 * 2


def test_merged_keys_dtypes_shapes_and_library_bytes(tmp_path):
    E, T, H, I = 3, 2, 64, 64
    sink = KtSink(tmp_path, "safetensors", Int4Sizes, numa=T, moe_layers=[3, 1], experts=E, hidden=H,
                  intermediate=I)
    results, blobs = _write_layers(sink, E, T, H, I)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"]
    for i, layer in enumerate([1, 3], start=1):
        shard = tmp_path / f"model-{i:05d}-of-00002.safetensors"
        ref = {}
        for (proj, e, t), (blob, scale) in blobs[layer].items():
            ref[f"blk.{layer}.ffn_{proj}_exps.{e}.numa.{t}.weight"] = blob.view(np.int8)
            ref[f"blk.{layer}.ffn_{proj}_exps.{e}.numa.{t}.scale"] = scale
        loaded = load_file(str(shard))
        assert set(loaded) == set(ref)
        for key, arr in loaded.items():
            assert arr.dtype == ref[key].dtype and arr.shape == ref[key].shape and arr.ndim == 1
            np.testing.assert_array_equal(arr, ref[key])
        save_file(ref, str(tmp_path / "ref.bin"))  # kt-kernel's converter writes with the library, no metadata
        assert shard.read_bytes() == (tmp_path / "ref.bin").read_bytes()
        (tmp_path / "ref.bin").unlink()
        assert results[layer].files[0].path == shard.name
    assert loaded["blk.3.ffn_down_exps.0.numa.0.scale"].shape == (H,)
    assert loaded["blk.3.ffn_gate_exps.0.numa.1.weight"].shape == (I // T * H // 2,)


def test_index_total_size_and_copies(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "cl100k.tiktoken", "model.safetensors",
                 "README.md"):
        (src / name).write_bytes(f"content of {name}".encode())
    sink = KtSink(out, "safetensors", Int4Sizes, numa=1, moe_layers=[0, 2], experts=2, hidden=32, intermediate=32)
    _write_layers(sink, 2, 1, 32, 32)
    records = sink.finalize(copy_from=src)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        for key, arr in load_file(str(shard)).items():
            tensors[key] = (shard.name, arr.nbytes)
    assert index["metadata"]["total_size"] == sum(n for _, n in tensors.values())
    assert index["weight_map"] == {k: shard for k, (shard, _) in tensors.items()}
    copied = sorted(r.path for r in records)
    assert copied == ["cl100k.tiktoken", "config.json", "model.safetensors.index.json", "tokenizer.json",
                      "tokenizer_config.json"]
    assert (out / "config.json").read_bytes() == b"content of config.json"
    assert not (out / "model.safetensors").exists() and not (out / "README.md").exists()


def test_dense_shard_renaming(tmp_path):
    rng = np.random.default_rng(5)
    dense = {"model.embed_tokens.weight": ("BF16", rng.integers(0, 1 << 16, (8, 4), dtype=np.uint16)),
             "model.layers.0.self_attn.q_proj.weight": ("BF16", rng.integers(0, 1 << 16, (4, 4), dtype=np.uint16)),
             "model.layers.1.mlp.model.x": ("F32", rng.standard_normal(3).astype(np.float32)),
             "model.norm.weight": ("F32", rng.standard_normal(4).astype(np.float32)),
             "lm_head.weight": ("F32", rng.standard_normal(2).astype(np.float32))}
    sink = KtSink(tmp_path, "safetensors", Int4Sizes, numa=1, moe_layers=[1], experts=1, hidden=32,
                  intermediate=32, include_dense=True)
    _write_layers(sink, 1, 1, 32, 32)
    reads = []
    result = sink.write_dense([(n, d, a.shape) for n, (d, a) in dense.items()],
                              lambda name: reads.append(name) or dense[name][1])
    assert sorted(reads) == sorted(dense)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    assert result.files[0].path == shard.name
    from ktconvert.formats.safetensors_reader import parse_header

    keys = set(parse_header(shard).tensors)
    assert keys == {"embed_tokens.weight", "blk.0.self_attn.q_proj.weight", "blk.1.mlp.model.x", "norm.weight",
                    "lm_head.weight"}
    assert dense_key("model.model.layers.3.x") == "model.layers.3.x"  # only one leading "model." goes
    sink.finalize()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["norm.weight"] == shard.name
    assert index["weight_map"]["blk.1.ffn_up_exps.0.numa.0.weight"] == "model-00001-of-00002.safetensors"


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_layer_invisible_until_finish_and_abort_cleans(tmp_path, layout):
    sink = KtSink(tmp_path, layout, Int4Sizes, numa=2, moe_layers=[4], experts=1, hidden=256, intermediate=256)
    writer = sink.begin_layer(4)
    blob, scale = _blobs(0, 4, 1, 2, 256, 256)[("gate", 0, 0)]
    writer.put("gate", 0, 0, blob, scale)
    assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / "_layer_4").exists()
    assert not sink.layer_done(4)
    with pytest.raises(OutputError):
        writer.finish()  # incomplete
    assert list(tmp_path.iterdir()) == []
    writer = sink.begin_layer(4)
    writer.put("gate", 0, 0, blob, scale)
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputError, match="not written"):
        sink.finalize()


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_put_checks(tmp_path, layout):
    sink = KtSink(tmp_path, layout, Int4Sizes, numa=2, moe_layers=[0], experts=2, hidden=256, intermediate=256)
    writer = sink.begin_layer(0)
    blob, scale = _blobs(0, 0, 2, 2, 256, 256)[("down", 1, 1)]
    with pytest.raises(OutputError, match="wrong quant blob"):
        writer.put("down", 1, 1, blob[:-1], scale)
    with pytest.raises(OutputError, match="wrong scale"):
        writer.put("down", 1, 1, blob, scale[:128])
    with pytest.raises(OutputError, match="out of range"):
        writer.put("down", 2, 1, blob, scale)
    writer.put("down", 1, 1, blob, scale)
    with pytest.raises(OutputError, match="twice"):
        writer.put("down", 1, 1, blob, scale)
    writer.abort()
    with pytest.raises(OutputError):
        sink.begin_layer(7)


def test_same_tensor_hashes_in_both_layouts(tmp_path):
    hashes = {}
    for layout in ("safetensors", "kt"):
        sink = KtSink(tmp_path / layout, layout, Int4Sizes, numa=2, moe_layers=[1, 2], experts=2, hidden=256,
                      intermediate=256)
        results, _ = _write_layers(sink, 2, 2, 256, 256, seed=9)
        hashes[layout] = {k: v for r in results.values() for k, v in r.tensors.items()}
    # the same names; a .kt file is one tensor, recorded by its file sha256 (not hashed twice), a shard's tensors by
    # BLAKE3: the same bytes either way
    assert hashes["safetensors"].keys() == hashes["kt"].keys() and len(hashes["kt"]) == 2 * 3 * 2 * 2 * 2
    kt_bytes = {hashlib.sha256(p.read_bytes()).hexdigest(): p.read_bytes() for p in (tmp_path / "kt").rglob("*.kt")}
    assert {k: "blake3:" + blake3.blake3(kt_bytes[v]).hexdigest() for k, v in hashes["kt"].items()} \
        == hashes["safetensors"]


def test_redo_finished_kt_layer_replaces_it(tmp_path):
    sink = KtSink(tmp_path, "kt", Int4Sizes, numa=1, moe_layers=[0], experts=1, hidden=256, intermediate=256)
    _write_layers(sink, 1, 1, 256, 256, seed=1)
    _, blobs = _write_layers(sink, 1, 1, 256, 256, seed=2)
    blob = blobs[0][("up", 0, 0)][0]
    assert (tmp_path / "_layer_0/_numa_0/INT4_up_0_32768Byte_quant_.kt").read_bytes() == blob.tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_layer_0"]


def test_bad_configurations(tmp_path):
    with pytest.raises(OutputError, match="merged"):
        KtSink(tmp_path, "kt", Int4Sizes, numa=1, moe_layers=[0], experts=1, hidden=256, intermediate=256,
               include_dense=True)
    with pytest.raises(OutputError):
        KtSink(tmp_path, "gguf", Int4Sizes, numa=1, moe_layers=[0], experts=1, hidden=256, intermediate=256)
    from ktconvert.errors import ShapeError

    with pytest.raises(ShapeError, match="multiple of the NUMA"):
        KtSink(tmp_path, "kt", Int4Sizes, numa=3, moe_layers=[0], experts=1, hidden=256, intermediate=256)


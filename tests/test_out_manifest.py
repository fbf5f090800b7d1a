"""ktconvert.json (build / write / load / verify_hashes) and `verify`'s structure checks on small outputs."""
from __future__ import annotations

import hashlib
import json
import shutil
import socket

import blake3
import numpy as np
import pytest
from huggingface_hub.utils.sha import git_hash
from safetensors.numpy import load_file, save_file

from ktconvert.errors import InputError
from ktconvert.formats import fileio, out_manifest as om
from ktconvert.formats.kt_sink import KtSink
from ktconvert.verification.hashes import verify_hashes
from ktconvert.verification.run import render, verify


class Int4Sizes:
    """AMXINT4 sizes from kt-format.md §2.1 (quant n*k/2 bytes, scale n fp32 values)."""

    file_prefix = "INT4"
    tensor_specs = staticmethod(lambda n, k: {"weight": ("I8", (n * k // 2,)), "scale": ("F32", (n,))})


def make_output(out, layout="safetensors", numa=2, layers=(1, 2), experts=2, hidden=256, intermediate=256,
                manifest_numa=None, seed=0):
    """Write a small AMXINT4 output (random blobs) + ktconvert.json; returns the manifest dict."""
    src = out.parent / "src"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text('{"model_type": "tiny"}')
    (src / "model.safetensors").write_bytes(b"weights")
    sink = KtSink(out, layout, Int4Sizes, numa=numa, moe_layers=layers, experts=experts, hidden=hidden,
                  intermediate=intermediate)
    rng = np.random.default_rng(seed)
    files, tensors = [], {}
    for layer in layers:
        writer = sink.begin_layer(layer)
        for proj in ("gate", "up", "down"):
            n, k = sink.shapes[proj]
            for e in range(experts):
                for t in range(numa):
                    writer.put(proj, e, t, rng.integers(0, 256, n * k // 2, dtype=np.uint8),
                               rng.standard_normal(n).astype(np.float32))
        result = writer.finish()
        files += result.files
        tensors.update(result.tensors)
    files += sink.finalize(copy_from=src)
    model = {"family": "tiny", "model_type": "tiny", "layers": list(layers), "experts": experts, "hidden": hidden,
             "intermediate": intermediate}
    manifest = om.build_manifest(method="AMXINT4", numa=numa if manifest_numa is None else manifest_numa,
                                 layout=layout, model=model, source=om.source_fingerprint(src, [src / "model.safetensors"]),
                                 files=files, tensors=tensors)
    om.write_manifest(out, manifest)
    return manifest


def test_hash_file_matches_hashlib_and_git(tmp_path):
    rng = np.random.default_rng(0)
    for size in (0, 1, fileio.HASH_CHUNK, fileio.HASH_CHUNK + 123):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (tmp_path / "f").write_bytes(data)
        assert fileio.hash_file(tmp_path / "f") == (size, hashlib.sha256(data).hexdigest(), git_hash(data))
        assert fileio.hash_bytes(data) == (size, hashlib.sha256(data).hexdigest(), git_hash(data))


def test_git_blob_of_lfs_sized_file_is_its_pointer(tmp_path):
    """From LFS_THRESHOLD on, the git blob id a hub lists is the blob of the git-lfs pointer (spec v1 text)."""
    rng = np.random.default_rng(3)
    for size in (fileio.LFS_THRESHOLD - 1, fileio.LFS_THRESHOLD, fileio.LFS_THRESHOLD + 4097):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (tmp_path / "f").write_bytes(data)
        sha256 = hashlib.sha256(data).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
        want = git_hash(data) if size < fileio.LFS_THRESHOLD else git_hash(pointer)
        assert fileio.hash_file(tmp_path / "f") == (size, sha256, want)
        assert fileio.hash_bytes(data) == (size, sha256, want)
        assert fileio.hash_file(tmp_path / "f", content_git=True) == (size, sha256, git_hash(data))


def test_format_version_1_manifest_still_verifies(tmp_path):
    """A manifest written before format_version 2 (content git blob for every file) still verifies, and a flipped
    git_sha1 in it is still caught."""
    manifest = make_output(tmp_path / "out")
    path = tmp_path / "out" / om.MANIFEST_NAME
    manifest["format_version"] = 1
    for rel, entry in manifest["files"].items():
        entry["git_sha1"] = git_hash((tmp_path / "out" / rel).read_bytes())
    path.write_bytes(om.manifest_bytes(manifest))
    assert verify_hashes(tmp_path / "out")["ok"]
    rel = sorted(manifest["files"])[0]
    manifest["files"][rel]["git_sha1"] = "0" * 40
    path.write_bytes(om.manifest_bytes(manifest))
    assert verify_hashes(tmp_path / "out")["mismatched"] == [rel]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_hash_safetensors_one_pass(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(fileio, "HASH_CHUNK", chunk)
    rng = np.random.default_rng(1)
    tensors = {"a": rng.standard_normal(33).astype(np.float32), "b": rng.integers(-9, 9, 50).astype(np.int8),
               "empty": np.zeros(0, np.uint8), "z": np.zeros((0, 3), np.float32)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    data = (tmp_path / "x.safetensors").read_bytes()
    size, sha, git, per_tensor = fileio.hash_safetensors(tmp_path / "x.safetensors")
    assert (size, sha, git) == (len(data), hashlib.sha256(data).hexdigest(), git_hash(data))
    assert per_tensor == {n: "blake3:" + blake3.blake3(a.tobytes()).hexdigest() for n, a in tensors.items()}


def test_manifest_deterministic_and_clean(tmp_path):
    texts = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        make_output(tmp_path / run / "out")
        texts.append((tmp_path / run / "out" / om.MANIFEST_NAME).read_bytes())
    assert texts[0] == texts[1] and texts[0].endswith(b"}\n")
    text = texts[0].decode()
    assert str(tmp_path) not in text and socket.gethostname() not in text
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    assert manifest["flags"] == {"kt-method": "AMXINT4", "kt-weight-path": ".", "kt-threadpool-count": 2}
    assert manifest["sglang_args"] == "--kt-method AMXINT4 --kt-weight-path . --kt-threadpool-count 2"
    assert om.sglang_args(manifest, "/models/x") == "--kt-method AMXINT4 --kt-weight-path /models/x " \
                                                    "--kt-threadpool-count 2"
    assert set(manifest["packages"]) == {"ktconvert", "numpy"}   # safetensors writes no byte of ours
    assert manifest["packages"]["numpy"] == np.__version__
    assert manifest["source"]["files"] == {"model.safetensors": {"bytes": 7,
                                                                 "blake3": blake3.blake3(b"weights").hexdigest()}}
    assert manifest["source"]["config_sha256"] == hashlib.sha256(b'{"model_type": "tiny"}').hexdigest()
    out = tmp_path / "a" / "out"
    listed = set(manifest["files"])
    assert listed == set(om.output_files(out)) and "config.json" in listed
    shard = "model-00001-of-00002.safetensors"
    assert manifest["files"][shard]["git_sha1"] == git_hash((out / shard).read_bytes())
    loaded = load_file(str(out / shard))
    assert manifest["tensors"]["blk.1.ffn_up_exps.1.numa.1.weight"] == \
        "blake3:" + blake3.blake3(loaded["blk.1.ffn_up_exps.1.numa.1.weight"].tobytes()).hexdigest()


def test_load_manifest_errors(tmp_path):
    with pytest.raises(InputError, match="no ktconvert manifest"):
        om.load_manifest(tmp_path)
    (tmp_path / om.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(InputError, match="unreadable"):
        om.load_manifest(tmp_path)
    (tmp_path / om.MANIFEST_NAME).write_text('{"format": "other"}')
    with pytest.raises(InputError, match="not a ktconvert manifest"):
        om.load_manifest(tmp_path)
    (tmp_path / om.MANIFEST_NAME).write_text('{"format": "ktconvert-manifest", "format_version": 99}')
    with pytest.raises(InputError, match="format_version"):
        om.load_manifest(tmp_path)


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_verify_hashes_detects_flip_in_every_file(tmp_path, layout):
    out = tmp_path / "out"
    manifest = make_output(out, layout=layout, experts=1, layers=(1,))
    (out / om.JOURNAL_NAME).write_text("{}")  # ignored
    assert verify_hashes(out)["ok"]
    for rel in manifest["files"]:
        path = out / rel
        original = path.read_bytes()
        _flip_byte(path, len(original) - 3)
        report = verify_hashes(out)
        assert not report["ok"] and report["mismatched"] == [rel], rel
        path.write_bytes(original)
    assert verify_hashes(out)["ok"]


def test_verify_hashes_tensor_missing_and_extra(tmp_path):
    out = tmp_path / "out"
    make_output(out)
    shard = out / "model-00002-of-00002.safetensors"
    _flip_byte(shard, -1)  # last byte: inside the last tensor's data
    report = verify_hashes(out)
    assert report["mismatched"] == [shard.name] and len(report["tensor_mismatched"]) == 1
    assert report["tensor_mismatched"][0].startswith("blk.2.")
    shard.unlink()
    (out / "stray.bin").write_bytes(b"x")
    (out / "_layer_9.partial").mkdir()
    (out / "_layer_9.partial" / "f").write_bytes(b"y")
    report = verify_hashes(out)
    assert report["missing"] == [shard.name]
    assert report["extra"] == ["_layer_9.partial/f", "stray.bin"]
    assert any("missing" in p for p in report["problems"]) and any("stray.bin" in p for p in report["problems"])


@pytest.mark.parametrize("layout", ["safetensors", "kt"])
def test_verify_ok_and_render(tmp_path, layout):
    out = tmp_path / "out"
    make_output(out, layout=layout)
    result = verify(out, hashes=True)
    assert result["ok"], result["problems"]
    statuses = {c["name"]: c["status"] for c in result["checks"]}
    assert statuses == {"manifest": "ok", "integrity": "ok", "structure": "ok", "flags": "ok", "hashes": "ok",
                        "source": "skipped", "numerics": "ok", "remote": "skipped"}
    text = render(result)
    assert "result: OK" in text and "structure" in text


def test_verify_missing_manifest(tmp_path):
    result = verify(tmp_path)
    assert not result["ok"] and "no ktconvert manifest" in result["problems"][0]
    assert "FAILED" in render(result)


def test_structure_catches_wrong_size_tensor(tmp_path):
    out = tmp_path / "out"
    make_output(out)
    shard = out / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    key = "blk.1.ffn_down_exps.1.numa.0.weight"
    tensors[key] = tensors[key][:-32]
    save_file(tensors, str(shard))
    result = verify(out)
    assert not result["ok"]
    assert any(key in p and "bytes, expected 16384" in p for p in result["problems"]), result["problems"]


def test_structure_catches_wrong_numa_count_merged(tmp_path):
    out = tmp_path / "out"
    make_output(out, numa=2, manifest_numa=1)
    result = verify(out)
    assert not result["ok"]
    assert any("finds 2 NUMA parts, expected numa 1" in p for p in result["problems"]), result["problems"]
    assert any("bytes, expected" in p for p in result["problems"])
    assert any("unexpected tensor" in p for p in result["problems"])


def test_structure_catches_wrong_numa_count_kt(tmp_path):
    out = tmp_path / "out"
    make_output(out, layout="kt", numa=1, manifest_numa=2)
    result = verify(out)
    assert not result["ok"]
    assert any("_layer_1: NUMA folders _numa_0, expected _numa_0.._numa_1" in p for p in result["problems"])
    assert any("missing" in p for p in result["problems"]) and any("unexpected file" in p for p in result["problems"])
    shutil.rmtree(out / "_layer_2")
    assert "_layer_2: missing layer folder" in verify(out)["problems"]


def test_structure_kt_wrong_size_and_stray_safetensors(tmp_path):
    out = tmp_path / "out"
    make_output(out, layout="kt", numa=1)
    path = out / "_layer_2/_numa_0/INT4_gate_1_32768Byte_quant_.kt"
    with open(path, "ab") as fh:
        fh.write(b"\0")
    (out / "model.safetensors").write_bytes(b"")
    problems = verify(out)["problems"]
    assert any("INT4_gate_1_32768Byte_quant_.kt: 32769 bytes, expected 32768" in p for p in problems), problems
    assert any("merged mode" in p for p in problems)


def test_structure_catches_missing_expert_and_bad_index(tmp_path):
    out = tmp_path / "out"
    make_output(out, experts=3)
    shard = out / "model-00002-of-00002.safetensors"
    tensors = {k: v for k, v in load_file(str(shard)).items() if ".2.numa." not in k}
    save_file(tensors, str(shard))
    problems = verify(out)["problems"]
    assert any("blk.2.ffn_gate_exps.2.numa.0.weight: missing" in p for p in problems)
    assert any("index" in p and "weight_map" in p for p in problems)
    assert any("total_size" in p for p in problems)


def test_numerics_and_remote_results_are_reported(tmp_path, monkeypatch):
    import ktconvert.ops.hub
    import ktconvert.verification.numeric_amx
    import ktconvert.verification.run

    out = tmp_path / "out"
    make_output(out, layers=(1,), experts=1)
    calls = []
    monkeypatch.setattr(ktconvert.verification.numeric_amx, "check_numerics",
                        lambda *args, **kw: calls.append(args) or {"ok": False, "problems": ["blk.1: error 0.5"]})
    monkeypatch.setattr(ktconvert.ops.hub, "verify_remote",
                        lambda *args: calls.append(args) or {"ok": True, "problems": [], "summary": "remote fine"})
    monkeypatch.setattr(ktconvert.verification.run, "check_source", lambda *args: ([], "not opened here"))
    result = verify(out, source="SRC", tokens=3, layers="1", experts="all", threshold=0.1, remote="me/repo")
    assert not result["ok"] and result["problems"] == ["blk.1: error 0.5"]
    assert calls[0][2:] == ("SRC", 3, [1], "all", 0.1) and calls[0][1]["format"] == om.FORMAT   # --layers read once
    assert calls[1][1:] == ("me/repo", "hf", None, None)
    statuses = {c["name"]: c["status"] for c in result["checks"]}
    assert statuses["numerics"] == "failed" and statuses["remote"] == "ok"
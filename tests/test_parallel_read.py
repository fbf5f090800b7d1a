"""Reading several source files at once and hashing outputs while they are written (issue 16 item 2): the bytes,
manifest included, never depend on the thread count; every recorded hash equals hashlib / git over the finished
files; an LFS shard of a Hugging Face cache snapshot is hashed by its blob name (checked on request)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import blake3
import pytest
from click.testing import CliRunner
from huggingface_hub.utils.sha import git_hash
from safetensors.numpy import load_file

import ktconvert
from ktconvert.cli.main import cli
from ktconvert.formats import stream

MODEL_KW = dict(layers=4, experts=8)   # one shard per layer: four source files in flight


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _lfs_git_blob(data: bytes) -> str:
    """The git blob id a hub lists: of the git-lfs pointer (spec v1) from 10 MiB on, else of the content."""
    if len(data) < 10 << 20:
        return git_hash(data)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n" \
              f"size {len(data)}\n"
    return git_hash(pointer.encode())


@pytest.mark.parametrize("kind, options", [
    ("cpu", dict(method="amxint4", numa=2)),
    ("cpu", dict(method="amxint8", layout="kt")),
    ("gpu", dict(experts="w4a16", group_size=32)),
])
def test_bytes_and_manifest_same_at_1_and_n_threads(tiny_model, tmp_path, kind, options):
    src = tiny_model("qwen3_moe", **MODEL_KW)
    assert len(list(src.glob("*.safetensors"))) > 2
    convert = ktconvert.convert_cpu if kind == "cpu" else ktconvert.convert_gpu
    trees = []
    for threads in (1, 4):
        convert(src, tmp_path / f"t{threads}", threads=threads, **options)
        trees.append(_tree(tmp_path / f"t{threads}"))
    assert trees[0] == trees[1] and "ktconvert.json" in trees[0]


def test_recorded_hashes_equal_hashlib_over_finished_files(tiny_model, tmp_path):
    src = tiny_model("qwen3_moe", **MODEL_KW)
    out = tmp_path / "out"
    ktconvert.convert_cpu(src, out, method="amxint4", numa=2, threads=3)
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert len(manifest["files"]) > 4
    for rel, entry in manifest["files"].items():
        data = (out / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "git_sha1": _lfs_git_blob(data)}, rel
        if rel.endswith(".safetensors") and rel.startswith("model-"):
            for name, array in load_file(str(out / rel)).items():
                assert manifest["tensors"][name] == "blake3:" + blake3.blake3(array.tobytes()).hexdigest(), name
    for rel, entry in manifest["source"]["files"].items():
        data = (src / rel).read_bytes()
        assert entry == {"bytes": len(data), "blake3": blake3.blake3(data).hexdigest()}


def _hf_cache(src: Path, cache: Path, wrong: str | None = None) -> Path:
    """A Hugging Face hub cache snapshot of folder `src`: blobs/<sha256> for .safetensors (LFS) files,
    blobs/<git blob SHA-1> for the others, snapshots/<rev>/<name> -> ../../blobs/<blob>. wrong: a shard whose
    blob is stored under the sha256 of other bytes."""
    repo = cache / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / ("0" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(p for p in src.iterdir() if p.is_file()):
        data = path.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if path.suffix == ".safetensors" else git_hash(data)
        if path.name == wrong:
            blob = hashlib.sha256(b"not these bytes").hexdigest()
        shutil.copyfile(path, blobs / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / path.name)
    return snapshot


def test_hf_cache_snapshot_shard_hash_from_blob_name(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("qwen3_moe", **MODEL_KW)
    snapshot = _hf_cache(src, tmp_path / "cache")
    hashed = []
    real_update = stream._BackgroundHash.update
    monkeypatch.setattr(stream._BackgroundHash, "update", lambda self, data: (hashed.append(len(data)),
                                                                             real_update(self, data))[1])
    ktconvert.convert_cpu(snapshot, tmp_path / "cached", method="amxint4", numa=2, threads=2)
    assert hashed == []                          # no source byte hashed: every shard's sha256 is its blob name
    ktconvert.convert_cpu(src, tmp_path / "plain", method="amxint4", numa=2, threads=2)
    assert sum(hashed) == sum(p.stat().st_size for p in src.glob("*.safetensors"))
    cached, plain = _tree(tmp_path / "cached"), _tree(tmp_path / "plain")
    manifests = [json.loads(tree.pop("ktconvert.json")) for tree in (cached, plain)]
    assert cached == plain                       # every output byte; the manifests differ in the source record only:
    sources = [m.pop("source")["files"] for m in manifests]     # the cache's sha256s, the plain files' BLAKE3
    for m in manifests:
        m.pop("self_sha256")
    assert manifests[0] == manifests[1]
    for name, data in ((p.name, p.read_bytes()) for p in src.glob("*.safetensors")):
        assert sources[0][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert sources[1][name] == {"bytes": len(data), "blake3": blake3.blake3(data).hexdigest()}


def test_hf_cache_wrong_blob_name_caught_with_verify_source_hash(tiny_model, tmp_path):
    src = tiny_model("qwen3_moe", **MODEL_KW)
    shard = sorted(p.name for p in src.glob("*.safetensors"))[1]
    snapshot = _hf_cache(src, tmp_path / "cache", wrong=shard)
    base = ["cpu", str(snapshot), "--method", "amxint4", "--quiet"]
    result = CliRunner().invoke(cli, base[:2] + [str(tmp_path / "trusting")] + base[2:])
    assert result.exit_code == 0, result.output
    recorded = json.loads((tmp_path / "trusting" / "ktconvert.json").read_text())["source"]["files"][shard]
    assert recorded["sha256"] == hashlib.sha256(b"not these bytes").hexdigest()   # taken from the name, unread
    result = CliRunner().invoke(cli, base[:2] + [str(tmp_path / "checked")] + base[2:] + ["--verify-source-hash"])
    assert result.exit_code == 3
    line = result.output.strip().splitlines()[-1]
    assert shard in line and "blob name" in line and hashlib.sha256((src / shard).read_bytes()).hexdigest() in line
    assert not (tmp_path / "checked" / "ktconvert.json").exists()


def test_gpu_expert_tensors_hashed_as_written_not_read_back(tiny_model, tmp_path, monkeypatch):
    """Each GPU shard's weight_shape tensors (first in the file) are written on open, so the file hash follows the
    experts as they go out: with a small parking budget only non-expert tensors (written on open, out of file
    order) are ever read back to hash them, never an expert's."""
    from ktconvert.util import profile
    from ktconvert.formats import ordered_hash

    monkeypatch.setattr(ordered_hash, "PARK_BYTES", 64 << 10)
    src = tiny_model("qwen3_moe", **MODEL_KW)
    out = tmp_path / "gpu"
    profile.enable()
    try:
        ktconvert.convert_gpu(src, out, threads=1, experts="w4a16", group_size=32)
    finally:
        report = profile.disable()
    read_back = report["kinds"].get("read.output", {}).get("bytes", 0)
    non_expert = expert = 0
    for shard in out.glob("*.safetensors"):
        data = shard.read_bytes()
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        for name, entry in header.items():
            if name != "__metadata__":
                nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
                expert += nbytes if ".experts." in name else 0
                non_expert += 0 if ".experts." in name else nbytes
    assert expert > 64 << 10 and read_back <= non_expert

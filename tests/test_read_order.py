"""The order the source is read in (ktconvert.run.read_order, issue 16 item 2: outputs hashed as written, never read
back): files holding the same layers are read together, their matrices merged in name order, which is the order of
a GPU shard's tensors. Golden values: hashlib over the finished files; the bytes of the same conversion read file
after file (the order changes no byte)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import ktconvert
from ktconvert.util import profile
from ktconvert.run import read_order
from ktconvert.formats import ordered_hash
from ktconvert.formats.stream import MatrixJob
from ktconvert.examples import tiny_layout
from ktconvert.examples.tiny import make_tiny_model


def test_groups_join_files_sharing_a_layer_in_source_order():
    files = ["a", "b", "c", "d", "e", "f", "g"]
    layers = {"b": {1}, "c": {1}, "d": {2}, "e": {2, 3}, "f": {3}, "g": {1}}     # g shares layer 1 with b and c
    assert read_order.read_groups(files, layers) == [["a"], ["b", "c", "g"], ["d", "e", "f"]]
    assert read_order.read_groups(files, layers, max_files=2) == [["a"], ["b", "c"], ["g"], ["d", "e"], ["f"]]


def _job(file: str, offset: int, name: str) -> MatrixJob:
    return MatrixJob(Path(file), offset, 1, 0, 0, ("gate",), tensor=name)


def test_merge_keeps_each_file_front_to_back_and_takes_the_smallest_name():
    one = [_job("1", 0, "e.0"), _job("1", 1, "e.1"), _job("1", 2, "e.10"), _job("1", 3, "e.2")]
    two = [_job("2", 0, "e.100"), _job("2", 1, "e.11"), _job("2", 2, "e.3")]
    names = [j.tensor for j in read_order.merged_jobs([one, two])]
    assert names == ["e.0", "e.1", "e.10", "e.100", "e.11", "e.2", "e.3"] == sorted(names)
    backwards = [_job("3", 0, "z"), _job("3", 1, "a")]                     # a file not sorted by name: its order wins
    assert [j.tensor for j in read_order.merged_jobs([backwards, one[:1]])] == ["e.0", "z", "a"]


@pytest.fixture(scope="module")
def split_layers(tmp_path_factory):
    """A qwen3_moe model whose layers each span several files, experts stored by number (0-4 in one file, 5-9 in
    the next, ...) and sorted by name inside each file, as transformers' save_pretrained shards them."""
    patch = pytest.MonkeyPatch()
    patch.setattr(tiny_layout, "SHARD_BYTES", 1 << 20)
    try:
        src = make_tiny_model(tmp_path_factory.mktemp("split") / "m", "qwen3_moe", layers=2, experts=16)
    finally:
        patch.undo()
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    files_of_layer = {f for name, f in index.items() if ".layers.1.mlp.experts." in name}
    assert len(files_of_layer) >= 3
    return src


def _gpu_read_back(src: Path, out: Path, threads: int) -> int:
    profile.enable()
    try:
        ktconvert.convert_gpu(src, out, threads=threads, experts="w4a16", group_size=32)
    finally:
        report = profile.disable()
    return report["kinds"].get("read.output", {}).get("bytes", 0)


def _non_expert_bytes(out: Path) -> int:
    """Bytes of the layer shards' tensors other than routed experts' (written when a shard opens, ahead of the
    experts in time but not in the file: they may be read back when they do not fit the parking budget)."""
    total = 0
    for shard in out.glob("model-*.safetensors"):
        data = shard.read_bytes()
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                     if k != "__metadata__" and ".layers." in k and ".experts." not in k)
    return total


def test_layer_split_over_files_gpu_experts_hashed_as_written(split_layers, tmp_path, monkeypatch):
    monkeypatch.setattr(ordered_hash, "PARK_BYTES", 512 << 10)    # a third of a layer's expert tensors
    trees = {}
    for threads in (1, 3):
        read_back = _gpu_read_back(split_layers, tmp_path / f"t{threads}", threads)
        assert read_back <= _non_expert_bytes(tmp_path / f"t{threads}")
        trees[threads] = {p.name: p.read_bytes() for p in (tmp_path / f"t{threads}").iterdir()}
    manifest = json.loads(trees[1]["ktconvert.json"])
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == hashlib.sha256(trees[1][name]).hexdigest(), name
    monkeypatch.setattr(read_order, "MAX_GROUP_FILES", 1)          # file after file, as before: experts read back
    assert _gpu_read_back(split_layers, tmp_path / "file_by_file", 1) > 2 * _non_expert_bytes(tmp_path / "t1")
    assert {p.name: p.read_bytes() for p in (tmp_path / "file_by_file").iterdir()} == trees[1] == trees[3]

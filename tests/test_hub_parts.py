"""A hub source opened in part (ops.hub_shards) against the local hub stand-in with the real huggingface_hub client:
planning downloads no shard; each `--layers` part downloads exactly the shards holding what it reads; the parts
merged give OUT byte-identical to a single run from the same hf:// source (which downloads the whole repo); a
shard whose bytes differ from the header the plan read is refused. The expected shard sets are derived here from
the index's weight_map by tensor name, independently of the code under test."""
from __future__ import annotations

import json
import re

import pytest

from ktconvert import api
from ktconvert.errors import RemoteError
from ktconvert.inputs import open_input
from ktconvert.merge import merge
from test_hub import hub_env, server  # noqa: F401  (fixtures: the stand-in hub on 127.0.0.1)
from test_parts import CPU, MODEL, tree  # noqa: F401  (MODEL: the tiny deepseek_v3)

RANGES = [(1, 1), (2, 2), (3, 3)]          # the tiny deepseek_v3: layer 0 dense, MoE layers 1..3, MTP layer 4


@pytest.fixture
def hub_model(server, hub_env, monkeypatch):
    """(spec hf://org/ds@commit, local folder of the same model) with HF_ENDPOINT set to the stand-in."""
    from ktconvert.testing.tiny import make_tiny_model

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    local = make_tiny_model(hub_env / "ds", "deepseek_v3", **MODEL)
    commit = server.store.seed("hf", "org/ds", local)
    return f"hf://org/ds@{commit}", local


def expected_shards(local, layers: tuple[int, int], writes_rest: bool) -> set[str]:
    """Shards holding routed experts of `layers`, plus for the part writing the rest the shards holding no routed
    expert of MoE layers 1..3 (those it fingerprints): read off the index by tensor name."""
    weight_map = json.loads((local / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard: dict[str, set[int]] = {}
    for name, shard in weight_map.items():
        match = re.search(r"\.layers\.(\d+)\.mlp\.experts\.", name)
        layer = int(match[1]) if match else None
        by_shard.setdefault(shard, set()).add(layer if layer in (1, 2, 3) else None)
    wanted = {s for s, held in by_shard.items() if held & set(range(layers[0], layers[1] + 1))}
    if writes_rest:
        wanted |= {s for s, held in by_shard.items() if held == {None}}
    return wanted


def cached_shards(cache) -> set[str]:
    return {p.name for p in cache.rglob("*.safetensors")}


def test_plan_downloads_no_shard(hub_model, hub_env, monkeypatch):
    spec, local = hub_model
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "plan-cache"))
    outputs = api.plan_outputs(open_input(spec, in_part=True), [(hub_env / "out", CPU)])
    assert outputs[0].layers == [1, 2, 3]
    assert cached_shards(hub_env / "plan-cache") == set()
    assert (next((hub_env / "plan-cache").rglob("config.json"))).read_bytes() == (local / "config.json").read_bytes()


def test_parts_download_only_their_shards_and_merge_to_single_run(hub_model, hub_env, monkeypatch):
    spec, local = hub_model
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "whole-cache"))
    api.convert(spec, [(hub_env / "single", CPU)])                       # the whole repo, one process
    assert cached_shards(hub_env / "whole-cache") == {p.name for p in local.glob("*.safetensors")}
    parts = []
    for first, last in reversed(RANGES):
        cache = hub_env / f"cache-{first}"
        monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(cache))
        folder = hub_env / "parts" / f"layers-{first}-{last}"
        api.convert(spec, [(folder, CPU)], layers=(first, last))     # as `ktconvert cpu hf://... --layers A-B`
        assert cached_shards(cache) == expected_shards(local, (first, last), first == 1), (first, last)
        parts.append(folder)
    merge(hub_env / "merged", parts)
    assert tree(hub_env / "merged") == tree(hub_env / "single")


def test_gpu_part_fetches_the_shards_it_reads(hub_model, hub_env, monkeypatch):
    pytest.importorskip("compressed_tensors", reason="the GPU checkpoint needs the [gpu] extra")
    spec, local = hub_model
    gpu = dict(experts="w4a16", group_size=32)
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "whole-cache"))
    api.convert(spec, [(hub_env / "single", gpu)])
    parts = []
    for first, last in RANGES:
        monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / f"cache-{first}"))
        parts.append(hub_env / "parts" / f"layers-{first}-{last}")
        api.convert(spec, [(parts[-1], gpu)], layers=(first, last))
    # a middle part reads only its layer's shard; the part writing the rest reads more (embeddings, lm_head)
    assert cached_shards(hub_env / "cache-2") == expected_shards(local, (2, 2), False)
    assert cached_shards(hub_env / "cache-1") >= expected_shards(local, (1, 1), True)
    merge(hub_env / "merged", parts)
    assert tree(hub_env / "merged") == tree(hub_env / "single")


def test_shard_changed_since_its_header_was_read_is_refused(hub_model, hub_env, monkeypatch):
    spec, local = hub_model
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "cache"))
    source = open_input(spec, in_part=True).source
    remote = source.checkpoint.remote
    shard = sorted(remote.headers)[1]
    head, size = remote.headers[shard]
    remote.headers[shard] = (head[:-1] + b"!", size)     # as if the plan had read another header
    with pytest.raises(RemoteError, match="header differs"):
        remote.fetch(shard)


def test_hub_without_range_reads_is_downloaded_whole(server, hub_env, monkeypatch):
    from ktconvert.ops.hub_shards import resolve_in_part
    from ktconvert.testing.tiny import make_tiny_model

    monkeypatch.setenv("MODELSCOPE_ENDPOINT", server.url)
    local = make_tiny_model(hub_env / "ds", "deepseek_v3", **MODEL)
    server.store.seed("ms", "org/ds", local)
    root, extra, remote = resolve_in_part("ms://org/ds", cache_dir=str(hub_env / "ms-dl"))
    assert remote is None and extra["repo"] == "org/ds"
    assert {p.name for p in root.glob("*.safetensors")} == {p.name for p in local.glob("*.safetensors")}

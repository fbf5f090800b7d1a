"""A hub source opened in part (ops.hub_shards) against the local hub stand-in with the real huggingface_hub client:
planning downloads no shard; each `--layers` part downloads exactly the shards holding what it reads; the parts
merged give OUT byte-identical to a single run from the same hf:// source (which downloads the whole repo); a
shard whose bytes differ from the header the plan read is refused. The expected shard sets are derived here from
the index's weight_map by tensor name, independently of the code under test."""
from __future__ import annotations

import hashlib
import json
import re

import pytest

from ktconvert import api
from ktconvert.errors import RemoteError
from ktconvert.run.inputs import open_input
from ktconvert.distributed.merge import merge
from test_hub import hub_env, server  # noqa: F401  (fixtures: the stand-in hub on 127.0.0.1)
from test_parts import CPU, MODEL, tree  # noqa: F401  (MODEL: the tiny deepseek_v3)

RANGES = [(1, 1), (2, 2), (3, 3)]          # the tiny deepseek_v3: layer 0 dense, MoE layers 1..3, MTP layer 4


@pytest.fixture
def hub_model(server, hub_env, monkeypatch):
    """(spec hf://org/ds@commit, local folder of the same model) with HF_ENDPOINT set to the stand-in."""
    from ktconvert.examples.tiny import make_tiny_model

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


def ms_model(server, hub_env, monkeypatch, name: str = "ds") -> tuple[str, object]:
    """(spec ms://org/NAME, local folder of the same tiny deepseek_v3) with MODELSCOPE_ENDPOINT set to the stand-in."""
    from ktconvert.examples.tiny import make_tiny_model

    monkeypatch.setenv("MODELSCOPE_ENDPOINT", server.url)
    local = make_tiny_model(hub_env / name, "deepseek_v3", **MODEL)
    server.store.seed("ms", f"org/{name}", local)
    return f"ms://org/{name}", local


@pytest.mark.parametrize("ranges_honoured", [True, False])
def test_ms_parts_download_only_their_shards(server, hub_env, monkeypatch, ranges_honoured):
    """Planning reads the shard headers with Range requests (or, from a server that ignores Range, from the start
    of each file's stream); each part downloads exactly the shards holding what it reads."""
    from ktconvert.ops import hub_clients
    from ktconvert.ops.hub_standin import server as hubserver
    statuses, real_prefix = [], hub_clients._stream_prefix
    monkeypatch.setattr(hub_clients, "_stream_prefix", lambda response, limit: (
        statuses.append(response.status_code), real_prefix(response, limit))[1])
    if not ranges_honoured:                 # a server that answers every Range request with the whole file
        real = hubserver._Handler.ms_download

        def whole_file(self, repo_id):
            del self.headers["Range"]
            return real(self, repo_id)

        monkeypatch.setattr(hubserver._Handler, "ms_download", whole_file)
    spec, local = ms_model(server, hub_env, monkeypatch)
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "whole-cache"))
    api.convert(spec, [(hub_env / "single", CPU)])
    assert cached_shards(hub_env / "whole-cache") == {p.name for p in local.glob("*.safetensors")}
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "plan-cache"))
    api.plan_outputs(open_input(spec, in_part=True), [(hub_env / "planned", CPU)])
    assert cached_shards(hub_env / "plan-cache") == set()          # planned from config, index and headers
    assert statuses and set(statuses) == ({206} if ranges_honoured else {200})
    parts = []
    for first, last in RANGES:
        cache = hub_env / f"cache-{first}"
        monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(cache))
        parts.append(hub_env / "parts" / f"layers-{first}-{last}")
        api.convert(spec, [(parts[-1], CPU)], layers=(first, last))
        assert cached_shards(cache) == expected_shards(local, (first, last), first == 1), (first, last)
    merge(hub_env / "merged", parts)
    assert tree(hub_env / "merged") == tree(hub_env / "single")


def test_ms_task_refuses_a_repo_changed_since_the_plan(server, hub_env, monkeypatch):
    from ktconvert.ops.hub_shards import resolve_in_part

    spec, local = ms_model(server, hub_env, monkeypatch)
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "cache"))
    planned = open_input(spec, in_part=True).listing
    shard = sorted(p.name for p in local.glob("*.safetensors"))[1]
    assert planned[shard] == hashlib.sha256((local / shard).read_bytes()).hexdigest()
    assert open_input(spec, in_part=True, listing=planned).listing == planned
    changed = dict(planned, **{shard: "0" * 64})
    with pytest.raises(RemoteError, match="changed since the conversion was planned") as info:
        resolve_in_part(spec, expect=changed)
    assert shard in str(info.value) and info.value.exit_code == 5


def test_repo_without_index_is_downloaded_whole(server, hub_env, monkeypatch):
    import shutil

    from ktconvert.ops.hub_shards import resolve_in_part
    from ktconvert.examples.tiny import make_tiny_model

    monkeypatch.setenv("MODELSCOPE_ENDPOINT", server.url)
    local = make_tiny_model(hub_env / "ds", "deepseek_v3", **MODEL)
    bare = hub_env / "bare"
    shutil.copytree(local, bare, ignore=shutil.ignore_patterns("*.index.json"))
    server.store.seed("ms", "org/bare", bare)
    root, extra, remote, listing = resolve_in_part("ms://org/bare", cache_dir=str(hub_env / "ms-dl"))
    assert remote is None and extra["repo"] == "org/bare" and set(listing) == {p.name for p in bare.iterdir()}
    assert {p.name for p in root.glob("*.safetensors")} == {p.name for p in local.glob("*.safetensors")}

"""Hub tokens never reach disk under --executor ray: they are not sent through Ray's runtime_env (which Ray writes
into runtime_env_agent.log, world-readable), reach the tasks only when a source or target is a hub, and then as an
in-memory task argument. Checked on a real two-node local cluster (conftest `cluster`) by grepping every file of
its session folders and of the test's own folders for a unique token; a hub-source run against the local hub
stand-in still sends the token with every shard download its tasks make. Skipped without the [ray] extra."""
from __future__ import annotations

import uuid
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install 'ktconvert[ray]')")

from ktconvert.distributed.ray_convert import (TOKEN_VARS, convert_on_ray, hub_tokens, remote_task,  # noqa: E402
                                    task_runtime_env)
from test_hub import hub_env, server  # noqa: E402,F401  (fixtures: the stand-in hub on 127.0.0.1)
from test_parts import CPU, MODEL, source, single, tree  # noqa: E402,F401


def session_dirs(cluster) -> list[Path]:
    """The session folders (logs, sockets, runtime resources) of every node of the test cluster."""
    return sorted({Path(node.get_session_dir_path()) for node in cluster.list_all_nodes()})


def files_holding(marker: str, roots) -> list[str]:
    """Every file under `roots` whose bytes contain `marker` (symlinks not followed)."""
    needle, found = marker.encode(), []
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file() and not path.is_symlink():
                try:
                    if needle in path.read_bytes():
                        found.append(str(path))
                except OSError:         # a socket, or a file Ray removed meanwhile
                    pass
    return found


@pytest.fixture
def marker(monkeypatch) -> str:
    """A unique token in every hub token variable of this process."""
    token = f"hf_{uuid.uuid4().hex}"
    for var in TOKEN_VARS:
        monkeypatch.setenv(var, token)
    return token


def test_tokens_travel_only_when_asked_and_never_in_runtime_env(cluster, marker):
    def environment_seen(names):         # defined here: sent to the workers by value (tests/ is not importable there)
        import os

        return {name: os.environ.get(name) for name in names}

    assert hub_tokens(False) == {} and hub_tokens(True) == dict.fromkeys(TOKEN_VARS, marker)
    assert marker not in str(task_runtime_env({"env_vars": {"X": "1"}}))
    plain = remote_task(ray, environment_seen, hub_tokens(False), num_cpus=1)
    tokened = remote_task(ray, environment_seen, hub_tokens(True), num_cpus=1)
    assert ray.get(plain.remote(TOKEN_VARS)) == dict.fromkeys(TOKEN_VARS)
    assert ray.get(tokened.remote(TOKEN_VARS)) == dict.fromkeys(TOKEN_VARS, marker)
    assert ray.get(plain.remote(TOKEN_VARS)) == dict.fromkeys(TOKEN_VARS)       # the worker's environment restored
    pair = remote_task(ray, lambda names: (1, environment_seen(names)), hub_tokens(True), num_returns=2)
    assert ray.get(list(pair.remote(["HF_TOKEN"]))) == [1, {"HF_TOKEN": marker}]  # as GPTQ's steps are called
    assert files_holding(marker, session_dirs(cluster)) == []


def test_local_source_ray_run_leaves_no_token_on_disk(cluster, source, single, tmp_path, marker):
    convert_on_ray(source, [(tmp_path / "out", CPU)], parts=2, runtime_env={"env_vars": {"KTCONVERT_X": "1"}})
    assert tree(tmp_path / "out") == tree(single)
    assert files_holding(marker, session_dirs(cluster) + [tmp_path]) == []


@pytest.mark.parametrize("hub, endpoint_var", [("hf", "HF_ENDPOINT"), ("ms", "MODELSCOPE_ENDPOINT")])
def test_hub_source_ray_run_authenticates_and_leaves_no_token_on_disk(cluster, server, hub_env, monkeypatch, hub,
                                                                      endpoint_var):
    from ktconvert.ops.hub_standin import server as hubserver
    from ktconvert.examples.tiny import make_tiny_model

    token = f"hf_{uuid.uuid4().hex}"
    for var in TOKEN_VARS:
        monkeypatch.setenv(var, token)
    downloads = []                                   # (path, the request's headers) of every whole-shard GET
    for name in ("hf_resolve", "ms_download"):
        real = getattr(hubserver._Handler, name)

        def recording(self, *args, _real=real):
            wanted = parse_qs(urlsplit(self.path).query).get("FilePath", [urlsplit(self.path).path])[0]
            if "Range" not in self.headers and wanted.endswith(".safetensors"):     # a task's shard download
                downloads.append((wanted, str(self.headers)))
            return _real(self, *args)

        monkeypatch.setattr(hubserver._Handler, name, recording)
    local = make_tiny_model(hub_env / "ds", "deepseek_v3", **MODEL)
    server.store.seed(hub, "org/ds", local)
    monkeypatch.setenv(endpoint_var, server.url)
    env = {"HF_HOME": str(hub_env / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "MODELSCOPE_CACHE": str(hub_env / "ms-home"), "KTCONVERT_HUB_CACHE": str(hub_env / "task-cache")}
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "driver-cache"))
    convert_on_ray(f"{hub}://org/ds", [(hub_env / "out", CPU)], parts=3, runtime_env={"env_vars": env})
    assert (hub_env / "out" / "ktconvert.json").is_file()
    shards = {p.name for p in local.glob("*.safetensors")}
    assert {name for name in shards if any(name in path for path, _ in downloads)} == shards
    assert all(token in headers for _, headers in downloads), "a task downloaded a shard without the token"
    assert files_holding(token, session_dirs(cluster) + [hub_env]) == []

"""Shared fixtures. `tiny_model(arch, **kw) -> Path` builds a seeded tiny checkpoint once per session and argument
set (ktconvert.examples.tiny.make_tiny_model keywords: layers, experts, hidden, intermediate, dtype, seed). Treat the
returned directory as read-only: other tests get the same one. `cluster`: a two-node local Ray cluster per test module."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    cache: dict[tuple, Path] = {}

    def build(arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kw.items())])
            cache[key] = make_tiny_model(tmp_path_factory.mktemp("tiny") / name, arch, **kw)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def calibration(tmp_path_factory):
    """A --calibration file of three token-id samples (36, 38 and 40 tokens; ids below 46)."""
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(4 + i, 40 + 3 * i))}) + "\n" for i in range(3)))
    return path


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for one test module: a head and a worker node of 1 CPU and 80 MiB of object store each
    (ray.cluster_utils.Cluster), this process joined to it. Skips without the [ray] extra."""
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install 'ktconvert[ray]')")
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20,
                                                          "include_dashboard": False})
    nodes.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=nodes.address, log_to_driver=False, logging_level="ERROR")
    nodes.wait_for_nodes()
    yield nodes
    ray.shutdown()
    nodes.shutdown()

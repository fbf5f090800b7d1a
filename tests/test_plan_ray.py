"""`ktconvert plan --executor ray`: what a Ray run asks of the cluster, before anything runs. References, worked by
hand from the model's dims (H 256, I 256, 8 experts per MoE layer, BF16) and the documented rules, never from the
code under test: a part task's memory is the peak RAM estimate documented in cpu.sizes.peak_ram (per worker two
jobs of one expert matrix: BF16 source, BF16 copy, float32 work on a NUMA part, output; plus the process base, the
hash budget, a read chunk per reader and two parked shards) at T=1; Ray runs min(CPUs / task CPUs, memory / task
memory) tasks on a node; a part reads the source shards holding its layers' experts (the index's weight_map) and
writes its layers' AMXINT4 experts (3 H I / 2 bytes of int4 and an fp32 scale per row of each NUMA part: 2 I + T H
rows) plus, for the first part, the files of no layer; GPTQ's steps hold what docs/scale.md's table lists and ship
every capture to every owner and every written expert to every slice. No Ray cluster for the described-node mode;
one test joins the two-node local cluster (conftest's `cluster`)."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.cpu import sizes

pytest.importorskip("ray", reason="--executor ray needs the [ray] extra (pip install 'ktconvert[ray]')")

H = I = 256
E = 8
LAYERS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("planray") / "qwen", "qwen3_moe", layers=LAYERS, experts=E,
                           hidden=H, intermediate=I)


@pytest.fixture(autouse=True)
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def run(*args, code: int = 0):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result


def ray_json(*args) -> dict:
    return json.loads(run("plan", *args, "--executor", "ray", "--json").stdout)["ray"]


def part_memory(threads: int, files: int) -> int:
    """cpu.sizes.peak_ram's documented estimate for a whole BF16 expert matrix (T=1: the largest, which a part
    declares) and `threads` workers: per job 2 bytes per element read, 2 as BF16, 13 of float32 work on a NUMA part,
    2 of output; two jobs per worker."""
    elems = H * I                                             # qwen3: one projection per job
    per_job = elems * 2 + 2 * elems + 13 * elems + 2 * elems
    readers = min(sizes.MAX_READERS, threads, files)
    return (sizes.PROCESS_BASE_BYTES + sizes.HASH_BUDGET + readers * sizes.READ_CHUNK_BYTES + 2 * sizes.PARK_BYTES
            + 2 * threads * per_job)


def shard_reads(model, first: int, last: int, writes_rest: bool) -> int:
    """Bytes of the source shards holding layers first..last's experts (and, for the first part, those holding no
    expert), from the index and os.stat."""
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    holds: dict[str, set] = {}
    for name, shard in weight_map.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", name)
        holds.setdefault(shard, set()).update({int(m.group(1))} if m else set())
    read = {s for s, layers in holds.items() if any(first <= x <= last for x in layers)}
    read |= {s for s, layers in holds.items() if not layers} if writes_rest else set()
    return sum(os.path.getsize(model / s) for s in read)


def amxint4_layer_bytes(numa: int) -> int:
    per_expert = 3 * H * I // 2 + 4 * (2 * I + numa * H)
    return E * per_expert


def test_parts_on_described_nodes_match_hand_figures(model):
    files = len(list(model.glob("*.safetensors")))
    memory = part_memory(1, files)
    report = ray_json(model, "--method", "amxint4", "--numa", "2", "--layout", "kt", "--nodes", 2, "--node-cpus", 3,
                      "--node-memory", "8G", "--node-rate", 2)
    assert report["mode"] == "parts" and report["cluster"]["from"] == "given"
    assert set(report) == {"mode", "cluster", "task", "nodes", "parts", "storage"}
    assert set(report["storage"]) == {"node_rate_bytes_per_s", "node_rate_from", "source_read_bytes", "output_bytes",
                                      "per_node", "busy_nodes", "read_bytes_per_s", "write_bytes_per_s", "seconds"}
    assert report["task"] == {"cpus": 1, "memory_bytes": memory}
    node = {"node": "node 0", "cpus": 3, "memory_bytes": 8 * 10 ** 9, "gpus": 0, "tasks_at_once": 3, "bound": "CPUs",
            "declared_bytes": 3 * memory}
    assert report["nodes"] == [node, {**node, "node": "node 1"}]
    parts = report["parts"]
    assert parts["count"] == min(LAYERS, 2 * 3) == 4 and parts["from"] == "default"   # one per MoE layer at most
    assert [r["layers"] for r in parts["ranges"]] == [[k, k] for k in range(LAYERS)]
    plan = json.loads(run("plan", model, "--method", "amxint4", "--numa", "2", "--layout", "kt", "--json").stdout)
    assert plan["ray"] is None                                                   # the local executor: no Ray figures
    rest = plan["cpu"]["total_bytes"] - LAYERS * amxint4_layer_bytes(2)
    assert rest == sum(f["bytes"] for f in plan["cpu"]["files"])                   # the kt layout lists no layer file
    for k, r in enumerate(parts["ranges"]):
        assert r["cpus"] == 1 and r["memory_bytes"] == memory
        assert r["source_read_bytes"] == shard_reads(model, k, k, k == 0)
        assert r["output_bytes"] == amxint4_layer_bytes(2) + (rest if k == 0 else 0)
    storage = report["storage"]
    reads, writes = sum(r["source_read_bytes"] for r in parts["ranges"]), plan["cpu"]["total_bytes"]
    assert storage["node_rate_from"] == "--node-rate" and storage["busy_nodes"] == 2
    assert storage["read_bytes_per_s"] == pytest.approx(2 * 2e9)
    assert storage["write_bytes_per_s"] == pytest.approx(2 * 2e9 * writes / reads)
    assert storage["seconds"] == pytest.approx(reads / (2 * 2e9))


def test_default_parts_bound_by_memory_or_by_cpus(model):
    files = len(list(model.glob("*.safetensors")))
    memory = part_memory(1, files)
    report = ray_json(model, "--method", "amxint4", "--nodes", 2, "--node-cpus", 3, "--node-memory", memory * 3 // 2)
    assert [(n["tasks_at_once"], n["bound"]) for n in report["nodes"]] == [(1, "memory")] * 2
    assert report["parts"]["count"] == 2 and [r["layers"] for r in report["parts"]["ranges"]] == [[0, 1], [2, 3]]
    assert "measured" in report["storage"]["node_rate_from"]                   # the documented default rate
    assert report["storage"]["node_rate_bytes_per_s"] == 0.87e9
    two = part_memory(2, files)
    report = ray_json(model, "--method", "amxint4", "--threads", 2, "--nodes", 3, "--node-cpus", 3,
                      "--node-memory", "64GiB")
    assert report["task"] == {"cpus": 2, "memory_bytes": two}
    assert [(n["tasks_at_once"], n["bound"]) for n in report["nodes"]] == [(1, "CPUs")] * 3     # 3 // 2 CPUs
    assert report["nodes"][0]["memory_bytes"] == 64 << 30 and report["parts"]["count"] == 3
    given = ray_json(model, "--method", "amxint4", "--parts", 3, "--nodes", 2, "--node-cpus", 3,
                     "--node-memory", "8G")
    assert given["parts"]["count"] == 3 and given["parts"]["from"] == "--parts"


def test_parts_of_several_targets_and_without_a_cluster(model, tmp_path):
    report = ray_json(model, "--cpu", tmp_path / "a", "--method", "amxint4", "--numa", "2", "--cpu", tmp_path / "b",
                      "--method", "amxint8", "--parts", 2)
    assert report["cluster"]["from"] == "none" and report["nodes"] == []
    assert report["storage"]["busy_nodes"] is None and report["storage"]["read_bytes_per_s"] is None
    ranges = report["parts"]["ranges"]
    assert [r["layers"] for r in ranges] == [[0, 1], [2, 3]]
    totals = [json.loads(run("plan", model, "--method", m, "--numa", n, "--json").stdout)["cpu"]["total_bytes"]
              for m, n in (("amxint4", 2), ("amxint8", 1))]
    assert sum(r["output_bytes"] for r in ranges) == sum(totals)               # one pass writes both outputs
    assert report["task"]["memory_bytes"] == part_memory(1, 4)
    none = ray_json(model, "--method", "amxint4")
    assert none["parts"]["count"] is None and none["parts"]["ranges"] == []


def test_text_output_shape(model):
    text = run("plan", model, "--method", "amxint4", "--numa", "2", "--executor", "ray", "--nodes", 2,
               "--node-cpus", 3, "--node-memory", "8G").stdout
    ray = text[text.index("on Ray:"):].splitlines()
    assert ray[0] == "on Ray: layer-range parts (computed)"
    assert ray[1] == "  cluster: 2 nodes given (--nodes), 3 CPUs and 7.451 GiB each"
    assert ray[2].startswith("  each part task declares 1 CPU (--threads) and ")
    assert ray[3].startswith("  each of 2 nodes: 3 CPUs, 7.451 GiB: 3 parts at once (bound by CPUs), declaring ")
    assert ray[4].startswith("  parts: 4 (default: what the 2 able nodes run at once, 6 (2 bound by CPUs), at most "
                             "one per MoE layer, 4)")
    assert ray[5].split() == ["MoE", "layers", "reads", "writes", "about"]
    assert [line.split()[0] for line in ray[6:10]] == ["0-0", "1-1", "2-2", "3-3"]
    assert ray[10].startswith("  storage, at 0.87 GB/s of source per node (measured")
    assert re.fullmatch(r"    2 nodes: 1\.74 GB/s read from SRC, \S+ GB/s written to the parts folder; .* in about "
                        r"\S+ s", ray[12])
    assert all(len(line) <= 120 for line in ray)


@pytest.mark.parametrize("args, says", [
    (["--parts", 2], "--parts needs --executor ray"),
    (["--nodes", 2, "--node-cpus", 2, "--node-memory", "1G"], "--nodes needs --executor ray"),
    (["--node-rate", 1], "--node-rate needs --executor ray"),
    (["--executor", "ray", "--nodes", 2, "--node-cpus", 2], "--nodes needs --node-memory too"),
    (["--executor", "ray", "--node-memory", "1G"], "--node-memory needs --nodes and --node-cpus too"),
    (["--executor", "ray", "--nodes", 2, "--node-cpus", 2, "--node-memory", "lots"], "--node-memory is not a size"),
    (["--executor", "ray", "--nodes", 2, "--node-cpus", 2, "--node-memory", "-1G"], "--node-memory is not a size"),
    (["--executor", "ray", "--nodes", 0, "--node-cpus", 2, "--node-memory", "1G"], "--nodes must be"),
    (["--executor", "ray", "--nodes", 1, "--node-cpus", 0, "--node-memory", "1G"], "--node-cpus must be"),
    (["--executor", "ray", "--node-rate", 0], "--node-rate must be a positive number"),
    (["--executor", "ray", "--node-rate", "nan"], "--node-rate must be a positive number"),
    (["--executor", "ray", "--ray-address", "h:1", "--nodes", 1, "--node-cpus", 2, "--node-memory", "1G"],
     "give one or the other"),
    (["--executor", "ray", "--workers", 2], "--workers is for --quant gptq"),
    (["--executor", "ray", "--parts", LAYERS + 1], "--parts must be between 1 and the number of MoE layers"),
    (["--executor", "ray", "--nodes", 2, "--node-cpus", 2, "--node-memory", "10M"], "no Ray node can run a part"),
])
def test_refusals_are_one_line_exit_2(model, args, says):
    result = run("plan", model, "--method", "amxint4", *args, code=2)
    assert says in result.stderr and result.stderr.count("\n") == 1 and result.stdout == ""


def test_refused_before_a_cluster_is_joined(model):
    """A bad size is refused before --ray-address is tried (nothing listens there)."""
    result = run("plan", model, "--method", "amxint4", "--executor", "ray", "--ray-address", "127.0.0.1:1",
                 "--workers", 2, code=2)
    assert "--workers is for --quant gptq" in result.stderr
    result = run("plan", model, "--method", "amxint4", "--executor", "ray", "--ray-address", "127.0.0.1:1", code=1)
    assert result.stderr.startswith("error: cannot join the Ray cluster at 127.0.0.1:1") and result.stdout == ""


# ---------------------------------------------------------------------------------------------- GPTQ

def gptq_memory(tokens: int, squares: int, n: int) -> dict:
    """docs/scale.md's table for a model of these dims: a slice task holds the layer without routed experts
    (attention 4 H^2 + shared expert 3 H I parameters, BF16) and its 1/N of the activations (hidden in and out,
    2 H per token, BF16, and the masks, 2 bytes per mask element); propagation adds every written expert twice
    (the task's and the object store's copy); the gate/up Hessian task every capture and the H^2 + I^2 fp32
    Hessians; an owner 2.5 captures, the Hessians and its experts' source and written weights. Each plus a
    process's base."""
    base = sizes.PROCESS_BASE_BYTES
    layer = (4 * H * H + 3 * H * I) * 2
    captures = tokens * H * 2
    slice_task = base + layer + math.ceil((2 * captures + 2 * squares) / n)
    one_expert = 3 * H * I * 2
    return {"record_slice": slice_task, "capture_slice": slice_task, "propagate_slice": slice_task + 2 * E * one_expert,
            "gate_up_hessian": base + captures + (H * H + I * I) * 4,
            "solve_experts": base + int(2.5 * captures) + (H * H + I * I) * 4 + math.ceil(E / n) * one_expert * 2}


def test_gptq_steps_on_described_nodes_match_hand_figures(model, calibration):
    pytest.importorskip("torch", reason="--quant gptq needs the [gpu] extra")
    tokens, squares = 36 + 38 + 40, 36 ** 2 + 38 ** 2 + 40 ** 2           # conftest's calibration: 3 samples
    at_two = gptq_memory(tokens, squares, 2)
    largest = max(at_two.values())
    args = [model, "--method", "amxint4", "--quant", "gptq", "--calibration", calibration]
    # 2 nodes of 4 CPUs whose memory holds two of the largest task at one worker per node: 2 per node
    report = ray_json(*args, "--nodes", 2, "--node-cpus", 4, "--node-memory", 2 * largest + 1)
    assert report["mode"] == "gptq" and report["workers"]["count"] == 4 and report["workers"]["from"] == "default"
    assert set(report) == {"mode", "cluster", "calibration", "workers", "steps", "largest_task_bytes", "nodes",
                           "moe_layers", "shipped_bytes_per_layer", "shipped_bytes"}
    memory = gptq_memory(tokens, squares, 4)
    steps = {s["step"]: s for s in report["steps"]}
    assert {step: s["memory_bytes"] for step, s in steps.items()} == memory
    assert {step: s["tasks"] for step, s in steps.items()} == {"record_slice": 3, "capture_slice": 3,
                                                                "gate_up_hessian": 1, "solve_experts": 4,
                                                                "propagate_slice": 3}  # 3 samples, 8 experts
    assert all(s["cpus"] == 1 and s["gpus"] == 0 for s in report["steps"])
    assert report["calibration"] == {"samples": 3, "tokens": tokens, "mask_elements": squares}
    # every capture to each of 4 owners, every written expert to each of 3 slices
    assert report["shipped_bytes_per_layer"] == 4 * tokens * H * 2 + 3 * E * 3 * H * I * 2
    assert report["shipped_bytes"] == LAYERS * report["shipped_bytes_per_layer"]
    big = max(memory.values())
    assert [(n["tasks_at_once"], n["bound"]) for n in report["nodes"]] == [((2 * largest + 1) // big, "memory")] * 2
    # plenty of memory: bound by CPUs, one worker per CPU
    report = ray_json(*args, "--nodes", 2, "--node-cpus", 4, "--node-memory", "64G")
    assert report["workers"]["count"] == 8 and {n["bound"] for n in report["nodes"]} == {"CPUs"}
    given = ray_json(*args, "--workers", 2)
    assert given["workers"] == {"count": 2, "from": "--workers", "why": "given"} and given["nodes"] == []
    assert {s["step"]: s["memory_bytes"] for s in given["steps"]} == at_two
    text = run("plan", *args, "--executor", "ray", "--workers", 2).stdout
    ray = text[text.index("on Ray:"):].splitlines()
    assert ray[0] == "on Ray: GPTQ, layers in order, each layer's work split (computed)"
    assert ray[1:3] == ["  cluster: none, figures per task", "    (--ray-address ADDR or RAY_ADDRESS reads a live "
                        "one; --nodes N --node-cpus C --node-memory SIZE describes one)"]
    assert ray[3] == f"  calibration: 3 samples, {tokens} tokens" and ray[4] == "  workers: 2 (--workers: given)"
    assert ray[5] == "  tasks, each declaring:"
    assert [line.split()[:4] for line in ray[6:11]] == [["record_slice", "2", "per", "run"],
                                                        ["capture_slice", "2", "per", "MoE"],
                                                        ["gate_up_hessian", "1", "per", "MoE"],
                                                        ["solve_experts", "2", "per", "MoE"],
                                                        ["propagate_slice", "2", "per", "layer"]]
    shipped = 2 * tokens * H * 2 + 2 * E * 3 * H * I * 2                       # 2 owners, 2 slices
    assert ray[11] == (f"  shipped between tasks: {shipped / 1e6:.2f} MB per MoE layer (captures to every owner, "
                       f"written experts to every slice),")
    assert ray[12] == f"    {LAYERS * shipped / 1e6:.2f} MB for {LAYERS} MoE layers" and len(ray) == 13


def test_gptq_refusals(model, calibration):
    pytest.importorskip("torch", reason="--quant gptq needs the [gpu] extra")
    args = ["plan", model, "--method", "amxint4", "--quant", "gptq", "--calibration", calibration, "--executor", "ray"]
    for extra, says in ((["--parts", 2], "--parts is not available with --quant gptq"),
                        (["--node-rate", 2], "--node-rate is for layer-range parts"),
                        (["--nodes", 1, "--node-cpus", 1, "--node-memory", "10M"], "no Ray node can run a GPTQ step")):
        result = run(*args, *extra, code=2)
        assert says in result.stderr and result.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------------------- a live cluster

def test_live_cluster_nodes_are_read_without_starting_work(model, cluster):
    """conftest's cluster: two nodes of 1 CPU; the plan reads their resources (ray.nodes()) and starts no task."""
    import ray

    from ktconvert import api

    before = ray.available_resources().get("CPU")
    report = api.plan(model, method="amxint4", numa=2, executor="ray").to_dict()["ray"]
    assert report["cluster"]["from"] == "live" and len(report["nodes"]) == 2
    memory = part_memory(1, 4)
    alive = {n["NodeID"][:12]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for node in report["nodes"]:
        live = alive[re.search(r"\(id (\w+)\)", node["node"]).group(1)]
        assert node["cpus"] == 1 and node["memory_bytes"] == int(live["memory"])
        assert node["tasks_at_once"] == min(1, int(live["memory"]) // memory) == 1
    assert report["parts"]["count"] == 2 and [r["layers"] for r in report["parts"]["ranges"]] == [[0, 1], [2, 3]]
    assert ray.is_initialized() and ray.available_resources().get("CPU") == before


@pytest.mark.parametrize("text, size", [("512", 512), ("512G", 512 * 10 ** 9), ("1.5T", 1_500_000_000_000),
                                        ("256GiB", 256 << 30), ("64 MiB", 64 << 20), ("2gb", 2 * 10 ** 9)])
def test_node_memory_sizes(text, size):
    from ktconvert.distributed.ray_plan import parse_size

    assert parse_size(text) == size

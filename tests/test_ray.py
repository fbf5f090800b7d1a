"""--executor ray on a real local Ray cluster (a head and a worker node of 1 CPU each, ray.cluster_utils.Cluster):
the merged OUT is byte-identical to a single-process run (CPU AMXINT4, and convert's CPU + GPU outputs), a worker
SIGKILLed mid-task is retried by Ray and resumes from its part's journal (same bytes), a parts folder of another
conversion is refused naming the part. Skipped when ray is not installed (the [ray] extra)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install 'ktconvert[ray]')")

from ktconvert import api  # noqa: E402
from ktconvert.cli import cli  # noqa: E402
from ktconvert.progress import Progress  # noqa: E402
from ktconvert.ray_executor import convert_on_ray  # noqa: E402

MODEL = dict(layers=4, experts=4, hidden=128, intermediate=256)   # deepseek_v3: MoE layers 1..3
CPU = dict(method="amxint4", numa=2)


def tree(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20,
                                                          "include_dashboard": False})
    nodes.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=nodes.address, log_to_driver=False, logging_level="ERROR")
    nodes.wait_for_nodes()
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from ktconvert.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ray") / "ds", "deepseek_v3", **MODEL)


@pytest.fixture(scope="module")
def single(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "out"
    api.convert_cpu(source, out, **CPU)
    return out


def test_cli_executor_ray_three_parts_equals_single_run(cluster, source, single, tmp_path):
    result = CliRunner().invoke(cli, ["cpu", str(source), str(tmp_path / "out"), "--method", "amxint4", "--numa", "2",
                                      "--executor", "ray", "--parts", "3", "--quiet"])
    assert result.exit_code == 0, result.output
    assert tree(tmp_path / "out") == tree(single)
    parts = sorted(p.name for p in (tmp_path / "out.parts" / "out").iterdir())
    assert parts == ["layers-1-1", "layers-2-2", "layers-3-3"]
    # a parts folder of another conversion is refused, naming the part (no OUT written)
    result = CliRunner().invoke(cli, ["cpu", str(source), str(tmp_path / "other" / "out"), "--method", "amxint8",
                                      "--numa", "2", "--executor", "ray", "--parts", "3", "--parts-dir",
                                      str(tmp_path / "out.parts"), "--quiet"])
    assert result.exit_code == 2 and "layers-" in result.output and "--method" in result.output
    assert not (tmp_path / "other" / "out" / "ktconvert.json").exists()


def test_worker_killed_mid_task_is_retried_with_same_bytes(cluster, source, single, tmp_path):
    died = tmp_path / "died"
    progress = Progress()
    fault = {"env_vars": {"KTCONVERT_FAULT_AFTER_JOBS": "18", "KTCONVERT_FAULT_ONCE": str(died)}}
    results = convert_on_ray(source, [(tmp_path / "out", CPU)], parts=2, runtime_env=fault, progress=progress)
    assert died.exists(), "no worker was killed: the fault was not injected"
    assert tree(tmp_path / "out") == tree(single)
    assert results[0].files == len(tree(single)) - 1
    assert progress.total_items == 3 and progress.bytes_done == progress.total_bytes > 0


def test_convert_cpu_and_gpu_on_ray_equal_single_run(cluster, source, tmp_path):
    pytest.importorskip("compressed_tensors", reason="the GPU checkpoint needs the [gpu] extra")
    targets = lambda root: [(root / "cpu", dict(CPU)), (root / "gpu", dict(experts="w4a16", group_size=32))]
    api.convert(source, targets(tmp_path / "single"))
    convert_on_ray(source, targets(tmp_path / "ray"), parts=2)
    for kind in ("cpu", "gpu"):
        assert tree(tmp_path / "ray" / kind) == tree(tmp_path / "single" / kind)


def test_cli_does_not_import_ray():
    code = "import sys, ktconvert.cli; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


JOBS = """
[defaults]
method = "amxint4"
numa = 2

[[jobs]]
name = "bad"
source = "missing-model"
out = "out/bad"

[[jobs]]
name = "good"
source = "SOURCE"
  [[jobs.outputs]]
  out = "out/good"
  bundle = "dist/good.tar.zst"
"""


def test_batch_on_ray_gives_the_local_summary(cluster, source, tmp_path):
    from ktconvert.ops.batch import load_jobs, run_jobs
    from ktconvert.ops.batch_ray import run_jobs_on_ray

    summaries = {}
    for name, runner in (("local", run_jobs), ("ray", run_jobs_on_ray)):
        (tmp_path / name).mkdir()
        job_file = tmp_path / name / "jobs.toml"
        job_file.write_text(JOBS.replace("SOURCE", str(source)))
        summary = runner(load_jobs(job_file), keep_going=True)
        for job in summary["jobs"]:
            job.pop("wall_s", None)
        summaries[name] = json.loads(json.dumps(summary).replace(str(tmp_path / name), "ROOT"))
    assert summaries["ray"] == summaries["local"]
    assert [j["status"] for j in summaries["ray"]["jobs"]] == ["failed", "ok"] and summaries["ray"]["exit_code"] == 3
    assert (tmp_path / "ray" / "dist" / "good.tar.zst").read_bytes() == \
        (tmp_path / "local" / "dist" / "good.tar.zst").read_bytes()

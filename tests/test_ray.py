"""--executor ray on a real local Ray cluster (a head and a worker node of 1 CPU each, ray.cluster_utils.Cluster):
the merged OUT is byte-identical to a single-process run (CPU AMXINT4, and convert's CPU + GPU outputs), a worker
SIGKILLed mid-task is retried by Ray and resumes from its part's journal (same bytes), a parts folder of another
conversion (other options) is converted again. Skipped when ray is not installed (the [ray] extra)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install 'ktconvert[ray]')")

from ktconvert import api  # noqa: E402
from ktconvert.cli.main import cli  # noqa: E402
from ktconvert.errors import KtConvertError  # noqa: E402
from ktconvert.util.progress import Progress  # noqa: E402
from ktconvert.distributed.ray_convert import convert_on_ray  # noqa: E402
from test_parts import CPU, MODEL, source, single, tree  # noqa: E402,F401  (fixtures: a tiny deepseek_v3, its single run)
from test_hub import hub_env, server  # noqa: E402,F401  (fixtures: the stand-in hub on 127.0.0.1)


def test_cli_executor_ray_three_parts_equals_single_run(cluster, source, single, tmp_path):
    result = CliRunner().invoke(cli, ["cpu", str(source), str(tmp_path / "out"), "--method", "amxint4", "--numa", "2",
                                      "--executor", "ray", "--parts", "3", "--quiet"])
    assert result.exit_code == 0, result.output
    assert tree(tmp_path / "out") == tree(single)
    parts = sorted(p.name for p in (tmp_path / "out.parts" / "out").iterdir())
    assert parts == ["layers-1-1", "layers-2-2", "layers-3-3"]
    # a parts folder of another conversion (other options): its parts are converted again, not taken
    result = CliRunner().invoke(cli, ["cpu", str(source), str(tmp_path / "other" / "out"), "--method", "amxint8",
                                      "--numa", "2", "--executor", "ray", "--parts", "3", "--parts-dir",
                                      str(tmp_path / "out.parts"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "other" / "out" / "ktconvert.json").read_text())["method"].lower() == "amxint8"
    for part in (tmp_path / "out.parts" / "out").iterdir():
        assert json.loads((part / "ktconvert-part.json").read_text())["options"]["method"].lower() == "amxint8"


def test_worker_killed_mid_task_is_retried_with_same_bytes(cluster, source, single, tmp_path, capfd):
    import time

    died = tmp_path / "died"
    progress = Progress()
    fault = {"env_vars": {"KTCONVERT_FAULT_AFTER_JOBS": "18", "KTCONVERT_FAULT_ONCE": str(died)}}
    results = convert_on_ray(source, [(tmp_path / "out", CPU)], parts=2, runtime_env=fault, progress=progress)
    assert died.exists(), "no worker was killed: the fault was not injected"
    assert tree(tmp_path / "out") == tree(single)
    assert results[0].file_count == len(tree(single)) - 1
    assert progress.total_items == 3 and progress.bytes_done == progress.total_bytes > 0
    # Ray's report of the dead worker lands in the parts folder's ray.log (it may come after the run), never on stdout
    log = tmp_path / "out.parts" / "ray.log"
    for _ in range(150):                  # the raylet's report comes asynchronously (up to 30 s on a busy host)
        if log.exists() and "worker died" in log.read_text():
            break
        time.sleep(0.2)
    assert "worker died" in log.read_text()
    assert "raylet" not in capfd.readouterr().out


def test_convert_cpu_and_gpu_on_ray_equal_single_run(cluster, source, tmp_path):
    pytest.importorskip("compressed_tensors", reason="the GPU checkpoint needs the [gpu] extra")
    targets = lambda root: [(root / "cpu", dict(CPU)), (root / "gpu", dict(experts="w4a16", group_size=32))]
    api.convert(source, targets(tmp_path / "single"))
    convert_on_ray(source, targets(tmp_path / "ray"), parts=2)
    for kind in ("cpu", "gpu"):
        assert tree(tmp_path / "ray" / kind) == tree(tmp_path / "single" / kind)


def test_cli_does_not_import_ray():
    code = "import sys, ktconvert.cli.main; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def job_file(folder, source) -> str:
    """A failing job (missing source) and one converting and bundling `source`."""
    bad = '[[jobs]]\nname = "bad"\nsource = "missing-model"\nout = "out/bad"\nmethod = "amxint4"\n'
    good = (f'[[jobs]]\nname = "good"\nsource = "{source}"\nout = "out/good"\nmethod = "amxint4"\nnuma = 2\n'
            'bundle = "dist/good.tar.zst"\n')
    path = folder / "jobs.toml"
    path.write_text(bad + good)
    return path


def test_batch_on_ray_gives_the_local_summary(cluster, source, tmp_path):
    from ktconvert.ops.batch import load_jobs, run_jobs
    from ktconvert.distributed.batch_ray import run_jobs_on_ray

    summaries = {}
    for name, runner in (("local", run_jobs), ("ray", run_jobs_on_ray)):
        (tmp_path / name).mkdir()
        summary = runner(load_jobs(job_file(tmp_path / name, source)), keep_going=True)
        for job in summary["jobs"]:
            job.pop("wall_s", None)
        summaries[name] = json.loads(json.dumps(summary).replace(str(tmp_path / name), "ROOT"))
    assert summaries["ray"] == summaries["local"]
    assert [j["status"] for j in summaries["ray"]["jobs"]] == ["failed", "ok"] and summaries["ray"]["exit_code"] == 3
    assert (tmp_path / "ray" / "dist" / "good.tar.zst").read_bytes() == \
        (tmp_path / "local" / "dist" / "good.tar.zst").read_bytes()


def test_part_no_node_can_run_is_refused_before_any_task(cluster, source, tmp_path):
    result = CliRunner().invoke(cli, ["cpu", str(source), str(tmp_path / "out"), "--method", "amxint4", "--numa", "2",
                                      "--executor", "ray", "--threads", "2", "--quiet"])
    assert result.exit_code == 2 and "no Ray node can run a part" in result.output and "2 CPUs" in result.output
    assert not (tmp_path / "out.parts").exists()


@pytest.mark.parametrize("hub, endpoint_var", [("hf", "HF_ENDPOINT"), ("ms", "MODELSCOPE_ENDPOINT")])
def test_hub_source_on_ray_equals_single_run_and_driver_downloads_no_shard(cluster, server, hub_env, monkeypatch,
                                                                           hub, endpoint_var):
    from ktconvert.examples.tiny import make_tiny_model
    from test_hub_parts import cached_shards

    local = make_tiny_model(hub_env / "ds", "deepseek_v3", **MODEL)
    spec = f"{hub}://org/ds"
    server.store.seed(hub, "org/ds", local)
    monkeypatch.setenv(endpoint_var, server.url)
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "single-cache"))
    api.convert(spec, [(hub_env / "single", CPU)])
    # the endpoint reaches the tasks from the driver's environment (ray_executor.TASK_ENV), not from runtime_env
    env = {"HF_HOME": str(hub_env / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "MODELSCOPE_CACHE": str(hub_env / "ms-home"), "KTCONVERT_HUB_CACHE": str(hub_env / "task-cache")}
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "driver-cache"))
    convert_on_ray(spec, [(hub_env / "out", CPU)], parts=3, runtime_env={"env_vars": env})
    assert tree(hub_env / "out") == tree(hub_env / "single")
    assert cached_shards(hub_env / "driver-cache") == set()       # the driver planned from config, index, headers
    assert cached_shards(hub_env / "task-cache") == {p.name for p in local.glob("*.safetensors")}


def test_api_executor_ray_equals_local(cluster, source, single, tmp_path):
    result = api.convert_cpu(source, tmp_path / "cpu", executor="ray", parts=2, **CPU)
    assert tree(tmp_path / "cpu") == tree(single) and result.file_count == len(tree(single)) - 1
    api.convert(source, [(tmp_path / "multi", CPU)], executor="ray", parts=3, parts_dir=tmp_path / "parts")
    assert tree(tmp_path / "multi") == tree(single)
    assert sorted(p.name for p in (tmp_path / "parts" / "multi").iterdir()) == ["layers-1-1", "layers-2-2",
                                                                              "layers-3-3"]


def test_verify_source_hash_reaches_the_part_tasks(cluster, source, tmp_path):
    """A Hugging Face cache snapshot whose layer-2 shard is stored under the sha256 of other bytes: trusted (the
    name taken) without --verify-source-hash, refused by the part reading it with it, as a local run does."""
    import hashlib

    from test_parallel_read import _hf_cache

    weight_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    shard = next(f for name, f in weight_map.items() if ".layers.2.mlp.experts." in name)
    snapshot = _hf_cache(source, tmp_path / "cache", wrong=shard)
    base = ["cpu", str(snapshot), "--method", "amxint4", "--numa", "2", "--executor", "ray", "--parts", "3", "--quiet"]
    result = CliRunner().invoke(cli, base[:2] + [str(tmp_path / "trusting")] + base[2:])
    assert result.exit_code == 0, result.output
    recorded = json.loads((tmp_path / "trusting" / "ktconvert.json").read_text())["source"]["files"][shard]
    assert recorded["sha256"] == hashlib.sha256(b"not these bytes").hexdigest()
    result = CliRunner().invoke(cli, base[:2] + [str(tmp_path / "checked")] + base[2:] + ["--verify-source-hash"])
    line = result.output.strip().splitlines()[-1]
    assert result.exit_code == 3, result.output
    assert "layers-2-2" in line and shard in line and "blob name" in line
    assert not (tmp_path / "checked" / "ktconvert.json").exists()


def test_ray_run_interrupted_in_its_merge_resumes(cluster, source, single, tmp_path, monkeypatch):
    from ktconvert.distributed import merge as merge_module
    from test_merge import interrupt_merge_after

    real_place = merge_module._place
    interrupt_merge_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        api.convert_cpu(source, tmp_path / "out", executor="ray", parts=2, **CPU)
    monkeypatch.setattr(merge_module, "_place", real_place)
    assert not (tmp_path / "out" / "ktconvert.json").exists()
    with pytest.raises(KtConvertError, match="not empty"):
        api.convert_cpu(source, tmp_path / "out", executor="ray", parts=2, **CPU)
    api.convert_cpu(source, tmp_path / "out", executor="ray", parts=2, resume=True, **CPU)
    assert tree(tmp_path / "out") == tree(single)
    # a finished OUT is left as is on --resume, and like a local --resume only when it records these options
    assert api.convert_cpu(source, tmp_path / "out", executor="ray", resume=True, **CPU).complete_before
    with pytest.raises(KtConvertError, match="cannot resume") as info:
        api.convert_cpu(source, tmp_path / "out", executor="ray", resume=True, method="amxint8", numa=2)
    assert info.value.exit_code == 2

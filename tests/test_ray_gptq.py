"""``--quant gptq --executor ray`` (issue 17 item 5): the calibration samples split across Ray tasks, each layer's
experts solved by owner tasks, layers in order, OUT written by the driver. The golden side is always the
single-process GPTQ run of the same options (itself byte-identical to llmcompressor's oneshot: test_gptq.py's slow
group): every file of OUT, ktconvert.json included, must be the same bytes, whatever the number of workers, after a
worker is SIGKILLed mid-layer, and when a run of one executor resumes the stream state the other saved.

On a local Ray cluster of two 1-CPU nodes (ray.cluster_utils.Cluster); skipped without the [ray] extra, or
without the [gpu] extra GPTQ needs. One small byte-identity check runs by default, the rest in the slow group."""
from __future__ import annotations

import functools
import json

import pytest
from click.testing import CliRunner

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install 'ktconvert[ray]')")
pytest.importorskip("llmcompressor", reason="--quant gptq needs the [gpu] extra")
torch = pytest.importorskip("torch")

from ktconvert import api  # noqa: E402
from ktconvert.cli.main import cli  # noqa: E402
from ktconvert.errors import UsageError  # noqa: E402
from test_hub import hub_env, server  # noqa: E402,F401  (fixtures: the stand-in hub on 127.0.0.1)
from test_parts import tree  # noqa: E402

# AMXINT8 on H = I = 256: fine enough a grid that adding up the slices' partial gate/up Hessians instead of
# accumulating them in the single process's order changes codes (test_partial_hessian_sums_change_the_bytes)
GPTQ = dict(method="amxint8", numa=2, quant="gptq")
LENGTHS = (30, 48, 24, 40, 36, 48, 20, 33, 41)     # 9 samples: every 4th held out whole (the default selection)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3_moe", layers=2, experts=4, hidden=256, intermediate=256)


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    g = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": torch.randint(4, 500, (n,), generator=g).tolist()}) + "\n"
                            for n in LENGTHS))
    return path


@pytest.fixture(scope="module")
def single(model, calib, tmp_path_factory):
    """The single-process CPU GPTQ output (the golden side)."""
    out = tmp_path_factory.mktemp("single") / "out"
    api.convert_cpu(model, out, **GPTQ, calibration=calib)
    return out


def test_cpu_gptq_on_ray_equals_single_process(cluster, model, calib, single, tmp_path):
    result = CliRunner().invoke(cli, ["cpu", str(model), str(tmp_path / "out"), "--method", "amxint8", "--numa", "2",
                                      "--quant", "gptq", "--calibration", str(calib), "--executor", "ray",
                                      "--workers", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert tree(tmp_path / "out") == tree(single)
    record = json.loads((single / "ktconvert.json").read_text())["gptq"]
    judged = [counts for counts in record["layers"].values()]
    assert record["holdout_every"] == 4 and sum(c["gptq"] for c in judged) > 0     # the selection ran
    assert not (tmp_path / "out.parts").exists()


@pytest.mark.parametrize("call, message", [
    (dict(layers="0-0"), "--layers (parts) is not available with --quant gptq"),
    (dict(executor="ray", parts=2), "--parts is not available with --quant gptq"),
    (dict(executor="ray", parts_dir="elsewhere"), "--parts-dir is not available with --quant gptq"),
    (dict(executor="ray", layers="0-0"), "--layers writes one part by itself"),
    (dict(workers=2), "--workers needs --executor ray"),
    (dict(executor="ray", workers=0), "--workers must be a whole number of at least 1"),
])
def test_gptq_combinations_that_cannot_work_are_refused(model, calib, tmp_path, call, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        api.convert_cpu(model, tmp_path / "out", **GPTQ, calibration=calib, **call)
    assert info.value.exit_code == 2 and len(str(info.value).splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_workers_without_gptq_and_gptq_in_convert_are_refused(model, calib, tmp_path):
    base = ["--method", "amxint4", "--numa", "2", "--executor", "ray", "--workers", "2", "--quiet"]
    for command in (["cpu", str(model), str(tmp_path / "rtn")], ["convert", str(model), "--cpu", str(tmp_path / "c")]):
        result = CliRunner().invoke(cli, command + base)
        assert result.exit_code == 2 and "--workers is for --quant gptq of cpu / gpu" in result.output
    with pytest.raises(UsageError, match="layer-range parts are not available with --quant gptq") as info:
        api.convert(model, [(tmp_path / "c", dict(GPTQ, calibration=calib))], executor="ray")
    assert "--executor ray --workers N" in str(info.value)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- slow group

@pytest.mark.slow
@pytest.mark.parametrize("workers", [3, 1])
def test_cpu_gptq_on_ray_any_worker_count_equals_single_process(cluster, model, calib, single, tmp_path, workers):
    result = api.convert_cpu(model, tmp_path / "out", **GPTQ, calibration=calib, executor="ray", workers=workers)
    assert tree(tmp_path / "out") == tree(single) and result.file_count == len(tree(single)) - 1


@pytest.mark.slow
def test_amxint4_gptq_on_ray_equals_single_process(cluster, model, calib, tmp_path):
    options = dict(GPTQ, method="amxint4", calibration=calib)
    api.convert_cpu(model, tmp_path / "single", **options)
    api.convert_cpu(model, tmp_path / "ray", **options, executor="ray", workers=3)
    assert tree(tmp_path / "ray") == tree(tmp_path / "single")


@pytest.mark.slow
def test_partial_hessian_sums_change_the_bytes(model, calib, monkeypatch):
    """The steps run inline (LocalTasks, no cluster) give LayerStream's codes; with the gate/up Hessian added up
    from the two slices' partial sums instead (what an all-reduce would do), codes change: the byte-identity
    checks here can see a reduction in another order."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gptq import distributed
    from ktconvert.gptq.calibration import load_samples
    from ktconvert.gptq.cpu import amx_stream

    samples, source = load_samples(calib, model), HFSource.open(model)
    local = functools.partial(distributed.DistributedStream, tasks=distributed.LocalTasks(), spec=str(model),
                              workers=2)

    def codes(make_stream):
        stream = amx_stream(source, samples, 8, 2, make_stream=make_stream)
        return [_payload_bytes(result.payloads) for result in stream.layers_results()]

    single = codes(None)
    assert codes(local) == single
    whole = distributed.gate_up_hessian

    def partial_sums(where, options, layer, held_masks, *captures):
        sums = [whole(where, options, layer, held_masks[:len(captures[0])], captures[0]),
                whole(where, options, layer, held_masks[len(captures[0]):], *captures[1:])]
        return sums[0][0] + sums[1][0], sums[0][1] + sums[1][1]

    monkeypatch.setattr(distributed, "gate_up_hessian", partial_sums)
    assert codes(local) != single


@pytest.mark.slow
def test_dense_and_mtp_layers_on_ray_equal_single_process(cluster, tiny_model, tmp_path):
    """DeepSeek-V3 (MLA attention): dense layer 0 (only propagated), MoE layers 1 and 2, next-n layer 3
    (--include-mtp: calibrated after the decoder layers on their output)."""
    from test_gptq_resume_mtp import _calibration

    model = tiny_model("deepseek_v3", mtp=1)
    options = dict(method="amxint8", numa=1, quant="gptq", calibration=_calibration(tmp_path, n=9), min_tokens=1,
                   include_mtp=True)
    api.convert_cpu(model, tmp_path / "single", **options)
    api.convert_cpu(model, tmp_path / "ray", **options, executor="ray", workers=2)
    assert "3" in json.loads((tmp_path / "single" / "ktconvert.json").read_text())["gptq"]["layers"]
    assert tree(tmp_path / "ray") == tree(tmp_path / "single")


@pytest.mark.slow
def test_gpu_gptq_on_ray_equals_single_process(cluster, model, calib, tmp_path):
    options = dict(experts="w4a16", quant="gptq", calibration=calib)
    api.convert_gpu(model, tmp_path / "single", **options)
    api.convert_gpu(model, tmp_path / "ray", **options, executor="ray", workers=2)
    assert tree(tmp_path / "ray") == tree(tmp_path / "single")


@pytest.mark.slow
@pytest.mark.parametrize("quantizer", ["amx", "gpu"])
def test_routed_only_stream_on_ray_equals_single_process(cluster, model, calib, quantizer):
    """calibrate_all False (not on the command line; the stream's option): each expert's Hessians from its routed
    tokens only. The LayerResults (codes, choices, tokens, held-out errors) of the Ray stream with 3 workers equal
    LayerStream's, on the AMX quantizer (held-out selection on) and on the GPU checkpoint's (W8A16)."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gpu.config import GPTQ_OBSERVER
    from ktconvert.gptq.calibration import load_samples
    from ktconvert.gptq.cpu import AmxQuantizer
    from ktconvert.gptq.loop import GpuQuantizer, GptqOptions, LayerStream
    from ktconvert.run.inputs import open_input
    from ktconvert.distributed.ray_gptq import ray_streams

    samples = load_samples(calib, model)
    options = GptqOptions(calibrate_all=False)
    make = {"amx": lambda: AmxQuantizer(4, 2), "gpu": lambda: GpuQuantizer(8, 128, "static", GPTQ_OBSERVER)}
    runs = []
    for stream_class in (LayerStream, ray_streams(open_input(model), workers=3)):
        stream = stream_class(HFSource.open(model), samples, make[quantizer](), options)
        runs.append([(r.layer, r.tokens, r.reasons, r.errors, _payload_bytes(r.payloads))
                     for r in stream.layers_results()])
    assert runs[0] == runs[1] and len(runs[0]) == 2


def _payload_bytes(payloads: dict) -> dict:
    """{(expert, proj): bytes} of AMX payloads (lists of (codes, scales)) or GPU ones (dicts of arrays)."""
    def flat(value):
        if isinstance(value, dict):
            return b"".join(value[k].tobytes() for k in sorted(value))
        return b"".join(a.tobytes() for part in value for a in part)
    return {key: flat(value) for key, value in payloads.items()}


@pytest.mark.slow
@pytest.mark.parametrize("step", ["solve:1", "propagate:0", "capture:1"])
def test_worker_killed_mid_layer_gives_the_same_bytes(cluster, model, calib, single, tmp_path, step):
    """A task's worker process SIGKILLs itself (KTCONVERT_FAULT_GPTQ_STEP) in the middle of a layer: Ray re-runs
    the task from the handles the driver holds, and OUT is the single process's, byte for byte."""
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.distributed.ray_gptq import ray_streams

    died = tmp_path / "died"
    fault = {"env_vars": {"KTCONVERT_FAULT_GPTQ_STEP": step, "KTCONVERT_FAULT_ONCE": str(died)}}
    convert_cpu(model, tmp_path / "out", **GPTQ, calibration=calib,
                gptq_stream=functools.partial(ray_streams, workers=2, runtime_env=fault))
    assert died.exists(), "no worker was killed: the fault was not injected"
    assert tree(tmp_path / "out") == tree(single)


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [("local", "ray"), ("ray", "local")])
def test_resume_across_executors_gives_the_same_bytes(cluster, tiny_model, tmp_path, monkeypatch, first, then):
    """A run of one executor stopped after layer 1 of 3 (its stream state saved then), resumed with the other:
    the files of an uninterrupted single-process run; the resumed run computes layer 2 only."""
    from ktconvert.gptq.distributed import DistributedStream
    from ktconvert.gptq.stream import DecoderStream
    from test_gptq_resume_mtp import _calibration, _Interrupted, _interrupt_after_layer_1

    model, calibration = tiny_model("qwen3_moe", layers=3), _calibration(tmp_path, n=9)
    options = dict(method="amxint4", numa=1, quant="gptq", calibration=calibration, min_tokens=1)
    workers = {"local": {}, "ray": dict(executor="ray", workers=2)}
    api.convert_cpu(model, tmp_path / "whole", **options)
    with monkeypatch.context() as patch:
        _interrupt_after_layer_1(patch, "layer 1")
        with pytest.raises(_Interrupted):
            api.convert_cpu(model, tmp_path / "out", **options, **workers[first])
    run = []
    for stream_class in (DecoderStream, DistributedStream):
        monkeypatch.setattr(stream_class, "run_layer", _recording(stream_class.run_layer, run))
    api.convert_cpu(model, tmp_path / "out", **options, **workers[then], resume=True)
    assert tree(tmp_path / "out") == tree(tmp_path / "whole")
    assert run == [2]


def _recording(run_layer, run: list):
    def recorded(self, L):
        run.append(L)
        return run_layer(self, L)
    return recorded


@pytest.mark.slow
def test_hub_source_gptq_on_ray_equals_single_process(cluster, model, calib, single, server, hub_env, monkeypatch):
    """SRC = hf://org/q (the stand-in hub): every task opens the commit the driver pinned and downloads the shards it
    reads into its own cache. OUT equals a local run from the same hub source (the manifest records the source),
    and its expert files those of the local run from the folder."""
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.distributed.ray_gptq import ray_streams
    from test_hub_parts import cached_shards

    server.store.seed("hf", "org/q", model)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("KTCONVERT_HUB_CACHE", str(hub_env / "driver-cache"))
    api.convert_cpu("hf://org/q", hub_env / "local", **GPTQ, calibration=calib)
    env = {"HF_HOME": str(hub_env / "hf-home"), "KTCONVERT_HUB_CACHE": str(hub_env / "task-cache")}
    convert_cpu("hf://org/q", hub_env / "ray", **GPTQ, calibration=calib,
                gptq_stream=functools.partial(ray_streams, workers=2, runtime_env={"env_vars": env}))
    ray_out = tree(hub_env / "ray")
    assert ray_out == tree(hub_env / "local")
    assert cached_shards(hub_env / "task-cache") == {p.name for p in model.glob("*.safetensors")}
    shards = {name: data for name, data in tree(single).items() if name.endswith(".safetensors")}
    assert shards and all(ray_out[name] == data for name, data in shards.items())

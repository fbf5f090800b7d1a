"""``--quant gptq`` bytes do not depend on the CPU's instruction set, the kernels torch picks or the thread count
(gptq/determinism.py): the same conversion run as the ``ktconvert`` command in fresh processes, each with another
``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` / ``MKL_ENABLE_INSTRUCTIONS`` / ``MKL_CBWR`` / thread count,
gives the same sha256 for every file of OUT (shards, ktconvert.json, expert_activation.pt).

Those variables stand in for other hosts (a host's ISA can only be lowered from inside it). On an AVX2-only host
``ATEN_CPU_CAPABILITY=default`` and ``MKL_CBWR`` change GPTQ's bytes when they are not pinned (measured before the
pins: the layer-1 shard and ktconvert.json differed); ``test_the_variations_reach_torchs_numerics`` checks that
they still change torch's own results here, so equal bytes under them mean the pins hold. oneDNN is only used for
BF16 matmuls on AVX-512 hosts: there ``ONEDNN_MAX_CPU_ISA`` (AMX vs AVX512_CORE_BF16) changed the bytes; here it is
checked that it changes nothing. Golden values: none (every run is compared with another run); the default group
runs two conversions (under 60 s), the slow group one more per variable and the GPU-side conversion.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

# what a run's environment may set; every run starts without them
VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OMP_NUM_THREADS",
             "MKL_NUM_THREADS", "DNNL_MAX_CPU_ISA")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
THREE_THREADS = {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}


@pytest.fixture(scope="module")
def model(tiny_model):
    """Two MoE layers: layer 1's inputs come through layer 0's quantized experts, so a difference anywhere in the
    forward, the routing, the Hessians or the solve of layer 0 shows in layer 1's shard."""
    return tiny_model("qwen3_moe", layers=2, experts=8, hidden=128, intermediate=256)


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    """16 samples of 32 token ids (every 4th held out whole: the held-out selection runs)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [rng.randrange(4, 512) for _ in range(32)]}) + "\n"
                            for _ in range(16)))
    return path


def _env(**variables) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    return {**env, **variables}


def _digests(out) -> dict:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _convert(model, calib, runs: list[tuple], command: str = "cpu") -> list[dict]:
    """The conversion as the command, per (OUT, env, threads) in `runs` in a fresh process of its own (side by
    side); per run the sha256 of every file of its OUT."""
    target = ["--method", "amxint4", "--numa", "2"] if command == "cpu" else ["--experts", "w4a16"]
    procs = [subprocess.Popen([sys.executable, "-m", "ktconvert.cli.main", command, str(model), str(out), *target,
                               "--quant", "gptq", "--calibration", str(calib), "--threads", str(threads), "--quiet"],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for out, env, threads in runs]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    return [_digests(out) for out, _, _ in runs]


def _check_reference(out, digests: dict) -> None:
    record = json.loads((out / "ktconvert.json").read_text())["gptq"]["layers"]
    assert {"0", "1"} <= set(record) and all(c["gptq"] > 0 for c in record.values())
    assert {"ktconvert.json", "expert_activation.pt"} <= set(digests)


@pytest.fixture(scope="module")
def reference(model, calib, tmp_path_factory):
    """The conversion with none of the variables set, one thread: {file: sha256}."""
    out = tmp_path_factory.mktemp("isa") / "reference"
    (digests,) = _convert(model, calib, [(out, _env(**ONE_THREAD), 1)])
    _check_reference(out, digests)
    return digests


def test_other_isa_kernels_and_threads_give_the_same_bytes(model, calib, tmp_path):
    """oneDNN capped at SSE4.1, ATen's generic kernels, MKL told to use SSE4.2 and its AUTO path, three threads:
    every file the same bytes as a run with none of them (one thread), the two run side by side."""
    varied = _env(ONEDNN_MAX_CPU_ISA="SSE41", ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="SSE4_2",
                  MKL_CBWR="AUTO", **THREE_THREADS)
    plain, other = _convert(model, calib, [(tmp_path / "plain", _env(**ONE_THREAD), 1),
                                           (tmp_path / "varied", varied, 3)])
    _check_reference(tmp_path / "plain", plain)
    assert other == plain


@pytest.mark.slow
@pytest.mark.parametrize("variables", [
    {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},          # the host's best, whatever it is
    {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"MKL_CBWR": "AVX2"},
    THREE_THREADS,
], ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
def test_each_variable_alone_gives_the_same_bytes(model, calib, reference, tmp_path, variables):
    threads = int(variables.get("OMP_NUM_THREADS", 1))
    assert _convert(model, calib, [(tmp_path / "out", _env(**{**ONE_THREAD, **variables}), threads)]) == [reference]


@pytest.mark.slow
def test_gpu_side_gptq_gives_the_same_bytes(model, calib, tmp_path):
    """``gpu --quant gptq`` computed on CPU (llmcompressor's solve, the same stream): the same bytes under the
    variations as without them."""
    varied = _env(ONEDNN_MAX_CPU_ISA="SSE41", ATEN_CPU_CAPABILITY="default", MKL_CBWR="AUTO", **THREE_THREADS)
    plain, other = _convert(model, calib, [(tmp_path / "plain", _env(**ONE_THREAD), 1),
                                           (tmp_path / "varied", varied, 3)], command="gpu")
    assert other == plain and "config.json" in plain


# ---------------------------------------------------------------------------------------------- the pins

NUMERICS = r"""
import hashlib, torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x, w = torch.randn(256, 512, generator=g), torch.randn(512, 512, generator=g)
torch.backends.mkldnn.set_flags(False, None, None, "ieee")
out = {"bf16_linear": torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float(),
       "softmax": torch.softmax(x, -1), "sgemm": x.t() @ x}
print(torch.backends.mkl.is_available(), torch.cpu._is_avx2_supported(),
      *(k + "=" + hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in out.items()))
"""


def _children(script: str, runs: list[tuple[list, dict]]) -> list[str]:
    """stdout of `script` run as ``python -c script *args`` with _env(**variables), per (args, variables) in
    `runs`, the processes side by side."""
    procs = [subprocess.Popen([sys.executable, "-c", script, *args], env=_env(**variables), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args, variables in runs]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
    return [out for out, _ in outputs]


def test_the_variations_reach_torchs_numerics():
    """Without the pins, ATEN_CPU_CAPABILITY=default changes ATen's BF16 gemm and softmax and MKL_CBWR=COMPATIBLE
    MKL's float32 gemm on this host: the variables the conversions above vary are live ones."""
    runs = _children(NUMERICS, [([], {}), ([], {"ATEN_CPU_CAPABILITY": "default"}), ([], {"MKL_CBWR": "COMPATIBLE"})])
    (mkl, avx2), (plain, generic, compatible) = runs[0].split()[:2], \
        [dict(d.split("=") for d in out.split()[2:]) for out in runs]
    if avx2 == "True":
        assert generic["bf16_linear"] != plain["bf16_linear"] or generic["softmax"] != plain["softmax"]
    if mkl == "True":
        assert compatible["sgemm"] != plain["sgemm"]
    if "True" not in (mkl, avx2):
        pytest.skip("no AVX2 and no MKL: nothing is pinned on this host")


PIN = r"""
import json, os, sys, warnings
import torch
if sys.argv[1] == "late":
    torch.randn(64, 64) @ torch.randn(64, 64)          # torch ran first: ATen's capability and MKL's path are set
from ktconvert.gptq.determinism import _mkl_branch, pin_process
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pins = pin_process()
print(json.dumps({"pins": pins, "capability": torch.backends.cpu.get_cpu_capability(), "branch": _mkl_branch(torch),
                  "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")},
                  "warnings": [str(w.message) for w in caught], "again": pin_process() == pins}))
"""


def test_pins_take_before_torchs_first_operation_and_are_reported_after():
    """In a fresh process (after ``import torch``): ATen runs AVX2 and MKL its COMPATIBLE path, whatever the
    environment said. After torch ran: nothing changes, a RuntimeWarning names both, the environment keeps its
    values (so child processes compute as this one)."""
    if not torch.cpu._is_avx2_supported() or not torch.backends.mkl.is_available():
        pytest.skip("pins need an AVX2 CPU and torch's MKL")
    fresh, late = (json.loads(out) for out in _children(PIN, [
        (["fresh"], {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO"}),
        (["late"], {"ATEN_CPU_CAPABILITY": "default"})]))
    assert fresh["pins"] == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"} == fresh["env"]
    assert (fresh["capability"], fresh["branch"], fresh["warnings"], fresh["again"]) == ("AVX2", 3, [], True)
    assert late["pins"] == {} and late["again"]
    assert (late["capability"], late["branch"]) == ("DEFAULT", 1)
    assert late["env"] == {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": None}
    (warning,) = late["warnings"]
    assert "ATEN_CPU_CAPABILITY=avx2 (torch already runs DEFAULT)" in warning
    assert "MKL_CBWR=COMPATIBLE (MKL already started on branch 1)" in warning


def test_deterministic_cpu_turns_onednn_off_at_one_thread_and_restores():
    from ktconvert.gptq.determinism import deterministic_cpu

    mkldnn, threads = torch.backends.mkldnn, torch.get_num_threads()
    before = (mkldnn.enabled, mkldnn.matmul.fp32_precision)
    with deterministic_cpu("cpu"):
        assert (mkldnn.enabled, mkldnn.matmul.fp32_precision, torch.get_num_threads()) == (False, "ieee", 1)
        with deterministic_cpu("cpu"):
            assert not mkldnn.enabled
        assert not mkldnn.enabled and torch.get_num_threads() == 1
    assert (mkldnn.enabled, mkldnn.matmul.fp32_precision, torch.get_num_threads()) == (*before, threads)
    with deterministic_cpu("meta"):                     # another device: nothing changes
        assert mkldnn.enabled == before[0] and torch.get_num_threads() == threads


def test_ray_tasks_get_the_drivers_pins(model, monkeypatch):
    """ray_streams gives every task the pins in effect in this process as environment variables (over the
    runtime_env's own), so a task computes what this process would."""
    pytest.importorskip("ray")
    from ktconvert.distributed import ray_gptq
    from ktconvert.gptq.determinism import worker_env
    from ktconvert.run.inputs import open_input

    class Cluster:
        def cluster_resources(self):
            return {"CPU": 2}

    monkeypatch.setattr(ray_gptq, "connect", lambda address: Cluster())
    make = ray_gptq.ray_streams(open_input(str(model)), runtime_env={"env_vars": {"MKL_CBWR": "AVX2", "X": "1"}})
    env_vars = make.keywords["tasks"].options["runtime_env"]["env_vars"]
    assert env_vars == {"X": "1", "MKL_CBWR": "AVX2", **worker_env()}

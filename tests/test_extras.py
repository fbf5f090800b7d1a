"""Without the [gpu] extra: the base install runs the main job (tiny model -> cpu -> verify), and every command that
needs [gpu] stops with one line naming the extra and the missing modules, exit 2, before it writes anything.

The modules are made unimportable for real in a subprocess (tests/hidden_modules.py), not mocked in ktconvert."""
from __future__ import annotations

import sys

import pytest

from hidden_modules import NOT_IN_BASE, run_cli_without
from ktconvert.errors import EXIT_USAGE, MissingExtraError
from ktconvert.util.extras import EXTRAS, missing_modules, require

GPU = EXTRAS["gpu"]
GPU_LINE = ("needs the [gpu] extra: pip install 'ktconvert[gpu]' "
            "(missing modules: torch, compressed_tensors, llmcompressor, transformers)")


def entries(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3_moe", layers=2, experts=4, hidden=128, intermediate=128)


@pytest.mark.parametrize("feature, args", [
    ("ktconvert gpu", ["gpu", "{model}", "{out}", "--experts", "w4a16"]),
    ("ktconvert gpu", ["gpu", "{model}", "{out}", "--quant", "gptq", "--calibration", "{calib}"]),
    ("ktconvert convert", ["convert", "{model}", "--cpu", "{out}", "--method", "amxint4", "--gpu", "{out}-gpu"]),
    ("--quant gptq", ["cpu", "{model}", "{out}", "--method", "amxint4", "--quant", "gptq",
                      "--calibration", "{calib}"]),
    ("ktconvert expert-stats", ["expert-stats", "{model}", "{out}.pt", "--calibration", "{calib}",
                                "--report", "{out}.html"]),
])
def test_gpu_features_refuse_without_the_extra(tmp_path, model, calibration, feature, args):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    argv = [a.format(model=model, out=out, calib=calibration) for a in args]
    result = run_cli_without(GPU, argv, cwd=work)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.splitlines() == [f"error: {feature} {GPU_LINE}"]
    assert result.stdout == ""
    assert entries(work) == set()          # no OUT, no journal, no temp folder, not even in the working directory


def test_message_names_only_the_missing_module(tmp_path, model):
    result = run_cli_without(["compressed_tensors"], ["gpu", model, tmp_path / "out"])
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip() == ("error: ktconvert gpu needs the [gpu] extra: pip install 'ktconvert[gpu]' "
                                     "(missing module: compressed_tensors)")
    assert not (tmp_path / "out").exists()


def test_verify_of_a_gpu_checkpoint_is_a_missing_extra_not_a_failed_verification(tmp_path, model):
    from ktconvert.gpu.convert import convert_gpu
    from ktconvert.verification.run import verify

    out = tmp_path / "gpu"
    convert_gpu(model, out, experts="w4a16")
    before = {p: p.read_bytes() for p in out.iterdir()}
    result = run_cli_without(GPU, ["verify", out, "--source", model])
    assert result.returncode == EXIT_USAGE, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"error: verify of a GPU checkpoint {GPU_LINE}"]
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    assert verify(out, source=str(model))["ok"]      # with [gpu] the same output verifies


def test_no_extra_needed_for_cpu_work_and_plans(tmp_path, model):
    """The base install's own commands never ask for [gpu]: demo (tiny model -> cpu -> verify), plan --experts and
    gpu --dry-run (headers and arithmetic only)."""
    demo = run_cli_without(NOT_IN_BASE, ["demo", tmp_path / "demo"])
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "result: OK" in demo.stdout
    for args in (["plan", model, "--experts", "w4a16"], ["gpu", model, tmp_path / "never", "--dry-run"]):
        result = run_cli_without(GPU, args)
        assert result.returncode == 0, result.stderr
        assert "total:" in result.stdout
    assert not (tmp_path / "never").exists()


def test_tiny_model_without_torch_safetensors_or_tokenizers_has_the_same_weights(tmp_path):
    """tiny-model in the base install: the same weight bytes as with every optional package present (there:
    written by the same code; the bytes themselves are checked against safetensors in test_tiny.py), and no
    tokenizer files, since there is no tokenizers package to make them."""
    args = ["tiny-model", "--arch", "deepseek_v3", "--dtype", "fp8", "--seed", "3"]
    base = run_cli_without(NOT_IN_BASE, [args[0], tmp_path / "base", *args[1:]])
    full = run_cli_without([], [args[0], tmp_path / "full", *args[1:]])
    assert base.returncode == 0 and full.returncode == 0, base.stderr + full.stderr
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert entries(tmp_path / "full") - entries(tmp_path / "base") == tokenizer_files
    for name in entries(tmp_path / "base"):
        assert (tmp_path / "base" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name


def test_require_in_process(monkeypatch):
    require("gpu", "anything")          # the test environment has [gpu]
    assert missing_modules("gpu") == []
    monkeypatch.setitem(sys.modules, "llmcompressor", None)    # what Python does for a module known to be absent
    with pytest.raises(MissingExtraError) as err:
        require("gpu", "--quant gptq")
    assert err.value.exit_code == EXIT_USAGE
    assert str(err.value) == ("--quant gptq needs the [gpu] extra: pip install 'ktconvert[gpu]' "
                              "(missing module: llmcompressor)")


def test_api_entry_points_check_the_extra_themselves(tmp_path, model, calibration, monkeypatch):
    """The Python API, not only the CLI, raises MissingExtraError before writing: convert_gpu, convert with a GPU
    output, convert_cpu with quant "gptq", verify of a GPU checkpoint or with calibration, expert_stats."""
    import ktconvert

    gpu_out = tmp_path / "gpu"
    ktconvert.convert_gpu(model, gpu_out, experts="w4a16")
    cpu_out = tmp_path / "cpu"
    ktconvert.convert_cpu(model, cpu_out, method="amxint4", numa=1)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setitem(sys.modules, "llmcompressor", None)     # as if not installed (find_spec raises)
    calls = {
        "ktconvert gpu": lambda: ktconvert.convert_gpu(model, work / "g", experts="w4a16"),
        "ktconvert convert": lambda: ktconvert.convert(model, [(work / "c", {"method": "amxint4", "numa": 1}),
                                                               (work / "g", {"experts": "w4a16"})]),
        "--quant gptq": lambda: ktconvert.convert_cpu(model, work / "c", method="amxint4", numa=1, quant="gptq",
                                                      calibration=calibration),
        "verify of a GPU checkpoint": lambda: ktconvert.verify(gpu_out, source=model),
        "verify --calibration": lambda: ktconvert.verify(cpu_out, source=model, calibration=calibration,
                                                         report=work / "r.html"),
        "ktconvert expert-stats": lambda: ktconvert.expert_stats(model, work / "e.pt", calibration,
                                                                 report=work / "e.html"),
    }
    for feature, call in calls.items():
        with pytest.raises(MissingExtraError) as err:
            call()
        assert str(err.value) == (f"{feature} needs the [gpu] extra: pip install 'ktconvert[gpu]' "
                                  f"(missing module: llmcompressor)")
        assert entries(work) == set(), feature

"""One command-line vocabulary (issue 12 item 6): --json result objects, case-insensitive choices everywhere, the
same word meaning the same thing, and the old spellings working for one release with a deprecation line."""
from __future__ import annotations

import json

from click.testing import CliRunner

from ktconvert.cli.main import cli


def run(*args, code: int = 0):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result


def test_cpu_gpu_convert_families_print_one_json_object(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe")
    cpu = json.loads(run("cpu", model, tmp_path / "c", "--method", "amxint4", "--quiet", "--json").stdout)
    assert cpu["kind"] == "cpu" and cpu["method"] == "AMXINT4" and "sglang_args" in cpu
    assert cpu["file_count"] == len(cpu["files"]) > 0 and all(isinstance(f, str) for f in cpu["files"])
    gpu = json.loads(run("gpu", model, tmp_path / "g", "--experts", "W4A16", "--quiet", "--json").stdout)
    assert gpu["kind"] == "gpu" and gpu["method"] == "W4A16" and gpu["flags"] == {"model": "."}
    both = json.loads(run("convert", model, "--cpu", tmp_path / "c2", "--method", "amxint8", "--gpu", tmp_path / "g2",
                          "--quiet", "--json").stdout)
    assert [o["method"] for o in both["outputs"]] == ["AMXINT8", "W4A16"]
    families = json.loads(run("families", "--json").stdout)["families"]
    assert "qwen3_moe" in families["qwen3_moe"]


def test_choices_are_case_insensitive(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe")
    run("cpu", model, tmp_path / "a", "--method", "AMXINT4", "--quant", "MSE", "--layout", "KT", "--quiet")
    manifest = json.loads((tmp_path / "a" / "ktconvert.json").read_text())
    assert (manifest["method"], manifest["quant"], manifest["layout"]) == ("AMXINT4", "mse", "kt")
    plan = json.loads(run("plan", model, "--experts", "W8A16", "--linears", "FP8", "--json").stdout)
    assert plan["gpu"]["experts"] == "w8a16" and plan["gpu"]["linears"] == "fp8"
    run("cpu", model, tmp_path / "c", "--method", "LlamaFile", "--ggml-type", "q8_0", "--quiet")
    manifest = json.loads((tmp_path / "c" / "ktconvert.json").read_text())
    assert (manifest["method"], manifest["layout"], manifest["ggml_type"]) == ("LLAMAFILE", "gguf", "Q8_0")
    bad = run("cpu", model, tmp_path / "b", "--method", "amxint4", "--ggml-type", "Q4_K", code=2)
    assert "--ggml-type does not apply to --method amxint4" in bad.output and not (tmp_path / "b").exists()
    bad = run("cpu", model, tmp_path / "b", "--method", "llamafile", "--ggml-type", "Q3_K", code=2)
    assert "Q3_K" in bad.output and "Q4_K" in bad.output and not (tmp_path / "b").exists()


def test_deprecated_spellings_warn_and_still_work(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe")
    res = run("gpu", model, tmp_path / "g", "--algo", "rtn", "--quiet")
    assert res.stderr.strip().splitlines()[0] == "warning: --algo is deprecated, use --quant"
    assert json.loads((tmp_path / "g" / "ktconvert.json").read_text())["quant"] == "rtn"
    run("cpu", model, tmp_path / "c", "--method", "amxint4", "--quiet")
    res = run("verify", tmp_path / "c", "--experts", "2", "--json")
    assert "warning: --experts is deprecated, use --sample-experts" in res.stderr
    assert all(len(row["experts"]) == 2 for row in json.loads(res.stdout)["numerics"]["layers"])
    res = run("verify", tmp_path / "c", "--sample-experts", "ALL", "--json")
    assert res.stderr == "" and all(len(row["experts"]) == 8 for row in json.loads(res.stdout)["numerics"]["layers"])


def test_quant_means_the_algorithm_on_both_sides(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe")
    assert "gptq" in run("gpu", "--help").stdout and "--quant" in run("gpu", "--help").stdout
    res = run("gpu", model, tmp_path / "g", "--quant", "mse", code=2)      # the GPU side has rtn | gptq
    assert "rtn" in res.output and "gptq" in res.output
    res = run("cpu", model, tmp_path / "c", "--method", "amxint4", "--quant", "gptq", "--quiet", code=2)
    assert "--calibration" in res.output and not (tmp_path / "c").exists()

"""The Python API (issue 12 item 7): ktconvert.convert_cpu / convert_gpu / convert / plan / inspect / verify return
result dataclasses, are listed by dir(ktconvert), and importing the package stays light."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

import ktconvert
from ktconvert.errors import UsageError

API = ["convert", "convert_cpu", "convert_gpu", "inspect", "plan", "verify"]


def test_dir_lists_the_entry_points_and_import_is_light():
    assert set(API) <= set(dir(ktconvert))
    for name in ("ConvertResult", "PlanResult", "VerifyResult", "InspectResult", "CpuOptions", "GpuOptions"):
        assert name in dir(ktconvert)
    code = "import sys, ktconvert; print(sorted({'numpy', 'torch', 'safetensors'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "[]"


def test_docstrings_give_values_progress_protocol_and_exceptions():
    import ktconvert.api as api

    assert "start(total_bytes, total_items, label)" in api.__doc__ and "UsageError" in api.__doc__
    assert "method, numa, layout, quant, group_size" in ktconvert.convert_cpu.__doc__
    assert "Raises" in ktconvert.convert_cpu.__doc__ and "Raises" in ktconvert.convert_gpu.__doc__
    for name in API:
        assert getattr(ktconvert, name).__doc__, name


def test_convert_cpu_returns_a_result(tiny_model, tmp_path):
    model, out = tiny_model("qwen3_moe"), tmp_path / "out"
    result = ktconvert.convert_cpu(model, out, method="AMXINT8", numa=2, threads=1)
    assert dataclasses.is_dataclass(result) and result.kind == "cpu" and result.method == "AMXINT8"
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert result.file_count == len(manifest["files"])
    assert result.bytes == sum(f["bytes"] for f in manifest["files"].values())
    assert result.files == sorted(manifest["files"])     # relative paths (issue 30; before: only a count)
    assert result.flags == manifest["flags"]
    assert result.sglang_args == f"--kt-method AMXINT8 --kt-weight-path {out} --kt-threadpool-count 2"
    assert {"plan", "open", "convert", "finalize", "total"} <= set(result.timings) and not result.complete_before
    assert json.loads(json.dumps(result.to_dict()))["out"] == str(out)
    again = ktconvert.convert_cpu(model, out, method="amxint8", numa=2, resume=True)
    assert again.complete_before and again.files == result.files
    with pytest.raises(UsageError, match="unknown CPU option 'numaa'"):
        ktconvert.convert_cpu(model, tmp_path / "x", method="amxint4", numaa=2)


def test_convert_one_pass_gpu_plan_inspect_verify(tiny_model, tmp_path):
    model = tiny_model("deepseek_v3")
    results = ktconvert.convert(model, [(tmp_path / "cpu", {"method": "amxint4", "numa": 2}),
                                        (tmp_path / "gpu", ktconvert.GpuOptions.make(experts="W8A16"))], threads=1)
    assert [(r.kind, r.method) for r in results] == [("cpu", "AMXINT4"), ("gpu", "W8A16")]
    assert results[1].sglang_args == f"--model {tmp_path / 'gpu'}" and results[1].flags == {"model": "."}
    planned = ktconvert.plan(model, method="amxint4", numa=2, gpu={"experts": "w8a16"})
    assert planned.to_dict()["cpu"]["numa"] == 2 and planned.gpu["bits"] == 8
    assert planned.cpu.input is planned.gpu.input            # one opened source for both plans
    info = ktconvert.inspect(model)
    assert info.supported and info.family == "deepseek" and info.kt_methods["AMXINT8"].startswith("convert")
    checked = ktconvert.verify(tmp_path / "cpu", source=model, hashes=True, sample_experts="all")
    assert checked.ok and checked.numerics["layers"] and checked.hashes["ok"]
    gpu_checked = ktconvert.verify(tmp_path / "gpu", sample_experts=1)
    assert gpu_checked.ok, gpu_checked.problems
    with pytest.raises(UsageError, match="own folder"):
        ktconvert.convert(model, [(tmp_path / "same", {"method": "amxint4"}), (tmp_path / "same", {"experts": "w4a16"})])


def test_cli_reaches_the_library_through_the_api_only():
    """docs/architecture.md: cli/main.py prints and exits and calls api.py; of our modules it imports only errors,
    cli/options.py (which loads api), cli/targets.py (convert's --cpu / --gpu targets), cli/plan.py (the plan
    command, itself built on cli/options.py and cli/targets.py only), cli/check.py (the check command, built on
    cli/options.py only), progress and, for `hub-server`, the hub stand-in (no API function)."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(ktconvert.__file__).with_name("cli") / "main.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("ktconvert")}
    assert imported == {"ktconvert.errors", "ktconvert.cli.options", "ktconvert.cli.targets", "ktconvert.cli.plan",
                        "ktconvert.cli.check", "ktconvert.util.progress", "ktconvert.ops.hub_standin.server"}
    plan_tree = ast.parse((Path(ktconvert.__file__).with_name("cli") / "plan.py").read_text())
    assert {node.module for node in ast.walk(plan_tree) if isinstance(node, ast.ImportFrom)
            and node.module and node.module.startswith("ktconvert")} == {"ktconvert.cli.options",
                                                                         "ktconvert.cli.targets"}
    check_tree = ast.parse((Path(ktconvert.__file__).with_name("cli") / "check.py").read_text())
    assert {node.module for node in ast.walk(check_tree) if isinstance(node, ast.ImportFrom)
            and node.module and node.module.startswith("ktconvert")} == {"ktconvert.cli.options"}


def test_bundle_unbundle_batch_publish_expert_stats_are_api_functions(tiny_model, tmp_path):
    for name in ("bundle", "unbundle", "batch", "load_jobs", "publish", "expert_stats"):
        assert name in dir(ktconvert) and "Returns" in getattr(ktconvert, name).__doc__, name
    model = tiny_model("qwen3_moe")
    ktconvert.convert_cpu(model, tmp_path / "out", method="amxint4", numa=1)
    packed = ktconvert.bundle(tmp_path / "out", tmp_path / "out.tar.zst", level=1)
    assert packed["path"] == str(tmp_path / "out.tar.zst") and packed["files"] >= 2
    restored = ktconvert.unbundle(tmp_path / "out.tar.zst", tmp_path / "back")
    assert restored["dest"] == str(tmp_path / "back")
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == sorted(p.name for p in (tmp_path / "out").iterdir())
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[jobs]]\nname = "a"\nsource = "{model}"\n  [[jobs.outputs]]\n  out = "{tmp_path / "j"}"\n'
                    f'  method = "amxint4"\n  numa = 1\n')
    (plan,) = ktconvert.batch(jobs, dry_run=True)
    assert plan["job"] == "a" and plan["plan"]["numa"] == 1 and not (tmp_path / "j").exists()

"""`ktconvert plan` with the target syntax of `convert` (repeatable --cpu / --gpu OUT with their options, or
--targets FILE.toml): a plan per target and the combined figures of the one pass (source bytes read once, the
outputs' bytes together, a peak RAM estimate, the disk every filesystem needs). References: each target's plan
equals the single-output `plan` of its options; the planned files' sizes equal what `convert` then writes (the
manifest's size is an estimate and left out); the source bytes are os.stat's."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ktconvert import api
from ktconvert.cli.main import cli



def needs_gpu_extra() -> None:
    pytest.importorskip("compressed_tensors", reason="the GPU target needs the [gpu] extra")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("plan") / "qwen", "qwen3_moe", layers=3, experts=4)


def run(*args, code: int = 0):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result


def steady(value):
    """`value` without the free disk space figures (other processes write files between two plans) and the folder
    probed for them (the source's without an OUT)."""
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if "free" not in k and k not in ("ok", "disk_path")}
    if isinstance(value, list):
        return [steady(v) for v in value if not (isinstance(v, dict) and "free disk" in str(v.get("check")))]
    return value


def target_args(root) -> list:
    return ["--cpu", root / "int4", "--method", "amxint4", "--numa", "2", "--cpu", root / "int8", "--method",
            "amxint8", "--gpu", root / "gpu", "--experts", "w4a16", "--group-size", "32"]


def test_plan_of_several_targets_matches_each_single_plan_and_the_written_files(model, tmp_path):
    needs_gpu_extra()
    report = json.loads(run("plan", model, *target_args(tmp_path), "--json").stdout)
    assert [t["kind"] for t in report["targets"]] == ["cpu", "cpu", "gpu"]
    singles = [json.loads(run("plan", model, *args, "--json").stdout)
               for args in (["--method", "amxint4", "--numa", "2"], ["--method", "amxint8"],
                            ["--experts", "w4a16", "--group-size", "32"])]
    for target, single in zip(report["targets"], singles):
        plan, expected = target["plan"], single[target["kind"]]
        assert steady(plan) == steady(expected)
    combined = report["combined"]
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    assert combined["source_bytes"] == weights and combined["outputs"] == 3
    assert combined["outputs_bytes"] == sum(t["plan"]["total_bytes"] for t in report["targets"])
    assert combined["peak_ram_bytes"] >= max(t["plan"].get("peak_ram_bytes", 0) for t in report["targets"])
    [disk] = combined["disk"]                        # the three OUTs on one filesystem
    assert disk["need_bytes"] == combined["outputs_bytes"] and disk["ok"]
    run("convert", model, *target_args(tmp_path), "--quiet")
    for target in report["targets"]:
        for entry in target["plan"]["files"]:
            if not entry.get("approx"):
                assert (tmp_path / target["out"] / entry["path"]).stat().st_size == entry["bytes"], entry


def test_targets_file_plans_the_same_and_text_names_each_target(model, tmp_path):
    needs_gpu_extra()
    (tmp_path / "t.toml").write_text('[[targets]]\ncpu = "a"\nmethod = "amxint4"\nnuma = 2\n\n'
                                     '[[targets]]\ngpu = "g"\nexperts = "w8a16"\n')
    from_file = json.loads(run("plan", model, "--targets", tmp_path / "t.toml", "--json").stdout)
    given = json.loads(run("plan", model, "--cpu", tmp_path / "a", "--method", "amxint4", "--numa", "2", "--gpu",
                           tmp_path / "g", "--experts", "w8a16", "--json").stdout)
    for target in from_file["targets"] + given["targets"]:
        target.pop("name")                          # as written: the file's relative folder, the command line's
    assert steady(from_file) == steady(given) and from_file["cpu"] is None and from_file["gpu"] is None
    text = run("plan", model, "--targets", tmp_path / "t.toml").stdout
    assert "target 1 (cpu a):" in text and "target 2 (gpu g):" in text
    assert "one pass over" in text and "source read once" in text and "peak RAM" in text
    result = api.plan(model, targets=str(tmp_path / "t.toml")).to_dict()
    assert [t.pop("name") for t in result["targets"]] == ["target 1 (cpu a)", "target 2 (gpu g)"]
    assert steady(result) == steady(from_file)


def test_plan_targets_refusals(model, tmp_path, monkeypatch):
    from ktconvert.run import planning as plan_targets
    res = run("plan", model, "--cpu", tmp_path / "a", "--numa", "2", code=2)
    assert "'method' is required" in res.stderr
    res = run("plan", model, "--cpu", tmp_path / "a", "--method", "amxint4", tmp_path / "out", code=2)
    assert "OUT" in res.stderr
    monkeypatch.setattr(plan_targets, "free_at", lambda path: (str(tmp_path), 100_000))   # each fits, not both
    res = run("plan", model, "--cpu", tmp_path / "a", "--method", "bf16", "--cpu", tmp_path / "b", "--method",
              "bf16", code=1)
    assert "not enough free disk space for these outputs together" in res.stderr


def test_single_output_plan_unchanged(model):
    report = json.loads(run("plan", model, "--method", "amxint4", "--json").stdout)
    assert report["cpu"]["kt_method"] == "AMXINT4" and report["targets"] is None and report["combined"] is None
    deprecated = run("plan", model, "--gpu", "w8a16")
    assert "gpu plan" in deprecated.stdout and "warning: --gpu is deprecated, use --experts" in deprecated.stderr

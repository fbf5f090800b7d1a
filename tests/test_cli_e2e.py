"""End to end through the CLI: every family's tiny model converts for T=1 and T=2 in both layouts, the output
passes `verify --hashes`, its bytes match an independent re-quantization of the source, and bad usage fails
with a clear message and a non-zero exit code."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli

FAMILIES = ["deepseek_v3", "kimi_k2", "deepseek_v2", "qwen2_moe", "qwen3_moe", "qwen3_next", "glm4_moe",
            "minimax_m2", "mixtral", "gpt_oss", "qwen3_5_moe"]


def run(*args: str, ok: bool = True):
    result = CliRunner().invoke(cli, list(map(str, args)), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def _expected_expert_bytes(model, layer: int, expert: int, proj: str, t: int, numa: int, method: str):
    """Quantize the source matrix with the spec-derived numpy reference (quant/amx_rows.py + layouts/tiles.py)."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.layouts import tiles
    from ktconvert.layouts.numa import numa_slices
    from ktconvert.quant import amx_rows as amx

    ew = HFSource.open(model).read_expert(layer, expert)
    w = getattr(ew, proj)
    sl = numa_slices(w.shape[0] if proj != "down" else w.shape[1], numa)[t]
    part = np.ascontiguousarray(w[sl] if proj != "down" else w[:, sl])
    if method == "amxint4":
        codes, d = amx.quantize_int4_rows(part)
        return tiles.pack_int4(codes), d
    codes, d = amx.quantize_int8_rows(part)
    return tiles.pack_int8(codes), d


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_converts_both_layouts(tiny_model, tmp_path, family):
    model = tiny_model(family)
    for numa, layout, method in [(1, "safetensors", "amxint4"), (2, "kt", "amxint8"), (2, "safetensors", "amxint8"),
                                 (1, "kt", "amxint4")]:
        out = tmp_path / f"{layout}-{numa}-{method}"
        extra = ["--allow-drop-bias"] if family == "gpt_oss" else []
        run("cpu", model, out, "--method", method, "--numa", numa, "--layout", layout, "--quiet", *extra)
        result = run("verify", out, "--hashes", "--json")
        report = json.loads(result.output)
        assert report["ok"], report
        manifest = json.loads((out / "ktconvert.json").read_text())
        assert manifest["numa"] == numa and manifest["layout"] == layout
        assert manifest["method"] == method.upper()
        layer = manifest["model"]["layers"][-1]
        _check_one_expert(model, out, manifest, layer, numa, layout, method)


def _check_one_expert(model, out, manifest, layer, numa, layout, method):
    """The last expert's down projection, last NUMA part, equals the numpy reference quantization."""
    expert, proj, t = manifest["model"]["experts"] - 1, "down", numa - 1
    blob, scale = _expected_expert_bytes(model, layer, expert, proj, t, numa, method)
    if layout == "safetensors":
        from safetensors.numpy import load_file

        shard = next(p for p in out.glob("model-*.safetensors")
                     if f"blk.{layer}.ffn_down_exps.{expert}.numa.{t}.weight" in load_file(p))
        tensors = load_file(shard)
        got_blob = tensors[f"blk.{layer}.ffn_down_exps.{expert}.numa.{t}.weight"].view(np.uint8)
        got_scale = tensors[f"blk.{layer}.ffn_down_exps.{expert}.numa.{t}.scale"]
    else:
        prefix = "INT4" if method == "amxint4" else "INT8"
        folder = out / f"_layer_{layer}" / f"_numa_{t}"
        got_blob = np.fromfile(folder / f"{prefix}_down_{expert}_{blob.size}Byte_quant_.kt", dtype=np.uint8)
        got_scale = np.fromfile(folder / f"{prefix}_down_{expert}_{scale.size * 4}Byte_scale_.kt", dtype=np.float32)
    assert np.array_equal(got_blob, blob)
    assert np.array_equal(got_scale.view(np.uint32), scale.view(np.uint32))


def test_nonzero_biases_are_not_dropped_silently(tiny_model, tmp_path):
    result = run("cpu", tiny_model("gpt_oss"), tmp_path / "o", "--method", "amxint4", "--quiet", ok=False)
    assert result.exit_code == 3
    assert "bias" in result.output and "--allow-drop-bias" in result.output


def test_thread_count_does_not_change_bytes(tiny_model, tmp_path):
    model = tiny_model("deepseek_v3")
    outs = []
    for threads in (1, 2, 3):
        out = tmp_path / f"t{threads}"
        run("cpu", model, out, "--method", "amxint4", "--numa", "2", "--threads", threads, "--quiet")
        outs.append(out)
    ref = {p.relative_to(outs[0]): p.read_bytes() for p in outs[0].rglob("*") if p.is_file()}
    for other in outs[1:]:
        got = {p.relative_to(other): p.read_bytes() for p in other.rglob("*") if p.is_file()}
        assert got == ref


def test_existing_output_is_refused(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    result = run("cpu", model, out, "--method", "amxint4", "--quiet", ok=False)
    assert result.exit_code != 0
    assert "not empty" in result.output and "--force" in result.output
    assert (out / "keep.txt").read_text() == "user data"


def test_bad_numa_count_fails_before_writing(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe")
    out = tmp_path / "out"
    result = run("cpu", model, out, "--method", "amxint4", "--numa", "3", "--quiet", ok=False)
    assert result.exit_code == 3
    assert "256 % 3" in result.output or "valid" in result.output.lower()
    assert not out.exists() or not any(out.iterdir())


def test_unknown_method_is_a_usage_error(tiny_model, tmp_path):
    result = run("cpu", tiny_model("qwen3_moe"), tmp_path / "o", "--method", "int5", ok=False)
    assert result.exit_code == 2
    assert "int5" in result.output


def test_output_overlapping_source_is_refused(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3_moe"), model)
    result = run("cpu", model, model / "out", "--method", "amxint4", "--quiet", ok=False)
    assert result.exit_code != 0 and "overlaps the source" in result.output


def test_manifest_is_deterministic_and_records_the_run(tiny_model, tmp_path):
    model = tiny_model("glm4_moe")
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run("cpu", model, out, "--method", "amxint8", "--numa", "2", "--quiet")
    assert (a / "ktconvert.json").read_bytes() == (b / "ktconvert.json").read_bytes()
    manifest = json.loads((a / "ktconvert.json").read_text())
    assert manifest["flags"]["kt-method"] == "AMXINT8" and manifest["flags"]["kt-threadpool-count"] == 2
    import blake3

    for name, entry in manifest["source"]["files"].items():
        data = (model / name).read_bytes()
        assert entry == {"bytes": len(data), "blake3": blake3.blake3(data).hexdigest()}
    assert not (a / ".ktconvert-journal.json").exists()


def test_help_lists_every_command():
    result = run("--help")
    for command in ("inspect", "plan", "cpu", "verify", "tiny-model", "demo", "env"):
        assert command in result.output


def test_plan_covers_cpu_and_gpu_outputs(tiny_model):
    model = tiny_model("deepseek_v3")
    report = json.loads(run("plan", model, "--method", "amxint4", "--numa", "2", "--experts", "w4a16", "--json").output)
    assert report["cpu"]["method"].upper() == "AMXINT4" and report["cpu"]["numa"] == 2
    assert report["gpu"]["experts"] == "w4a16" and report["source"] == str(model)
    cpu_only = json.loads(run("plan", model, "--method", "AMXINT4", "--json").output)
    assert cpu_only["gpu"] is None and cpu_only["cpu"]["kt_method"] == "AMXINT4"     # one shape for any targets
    deprecated = run("plan", model, "--gpu", "w8a16")
    assert "gpu plan" in deprecated.stdout and "warning: --gpu is deprecated, use --experts" in deprecated.stderr
    result = run("plan", model, ok=False)
    assert result.exit_code == 2 and "--method" in result.output

"""The method registry: classes register themselves, the registry refuses duplicates and foreign classes, and the
rules plan / inspect / the command line report come from the method classes (issue 12 items 8 and 9)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import EXIT_USAGE, ShapeError, UsageError
from ktconvert.methods import METHODS, CpuMethod, all_methods, writable_names
from ktconvert.methods.inplace import InplaceMethod
from ktconvert.registry import Registry


def test_subclass_with_a_name_registers_and_duplicates_are_refused(monkeypatch):
    monkeypatch.setattr(METHODS, "_items", dict(METHODS._items))
    monkeypatch.setattr(METHODS, "_aliases", dict(METHODS._aliases))

    class Int2(CpuMethod):
        name, aliases, kt_method = "test-int2", ("t-int2",), "TESTINT2"

    assert METHODS.get("TEST_INT2") is Int2 and METHODS.get("t-int2") is Int2
    with pytest.raises(ValueError, match="registered twice"):
        class Again(CpuMethod):
            name, kt_method = "test-int2", "X"
    with pytest.raises(ValueError, match="registered twice"):
        class AliasTaken(CpuMethod):
            name, aliases = "test-int3", ("amxint4",)

    class Abstract(InplaceMethod):     # no name of its own: not registered
        pass

    assert "abstract" not in METHODS


def test_registry_refuses_non_subclasses():
    registry = Registry("thing", base=CpuMethod)
    with pytest.raises(ValueError, match="not a subclass of CpuMethod"):
        registry.register("x")(object)
    with pytest.raises(ValueError, match="not a subclass"):
        registry.register("y")(lambda: None)


def test_every_registered_method_is_complete():
    for method in all_methods():
        assert method.kt_method and method.name == method.kt_method.lower()
        if method.writable:
            assert method.layouts and method.thresholds
            assert method.expert_bytes(256, 256, 1) > 0
    assert writable_names() == ["amxint4", "amxint8", "bf16", "fp8", "fp8_perchannel", "gptq_int4", "llamafile",
                                "mxfp4", "mxfp8", "nvfp4", "rawint4"]


def test_group_sizes_are_validated_and_listed():
    raw = METHODS.get("rawint4")
    assert raw.configured(32) is raw and raw.configured(None) is raw and raw.group_size == 32
    for size in (64, 100, 128):
        with pytest.raises(UsageError) as info:
            raw.configured(size)
        assert f"expected 32, found {size}" in str(info.value) and info.value.exit_code == EXIT_USAGE
        assert "kt-kernel 0.7.2" in str(info.value)
    assert METHODS.get("amxint8").configured(64) is METHODS.get("amxint8")   # no groups: the value is unused
    read_only = type("ReadOnly", (CpuMethod,), {"kt_method": "READONLY", "writable": False})   # no name: unregistered
    with pytest.raises(UsageError, match="does not write READONLY") as info:
        read_only.configured()
    assert "llamafile" in str(info.value) and info.value.exit_code == EXIT_USAGE


def test_method_options_apply_to_the_method_that_declares_them():
    """--ggml-type is llamafile's own option (method_options): taken case-insensitively there, refused with a usage
    error naming its owner everywhere else, ignored when not given (None)."""
    llamafile = METHODS.get("llamafile")
    assert llamafile.configured(ggml_type="q6_k").ggml_type == "Q6_K" and llamafile.configured().ggml_type == "Q4_K"
    assert llamafile.configured(ggml_type=None) is llamafile
    for name in ("amxint4", "bf16", "rawint4"):
        assert METHODS.get(name).configured(ggml_type=None) is METHODS.get(name)
        with pytest.raises(UsageError, match="--ggml-type does not apply to --method " + name) as info:
            METHODS.get(name).configured(ggml_type="Q4_K")
        assert "option of --method llamafile" in str(info.value) and info.value.exit_code == EXIT_USAGE
    with pytest.raises(UsageError, match="Q3_K is not written by LLAMAFILE"):
        llamafile.configured(ggml_type="Q3_K")
    manifest = {"method": "LLAMAFILE", "numa": 1, "extra": {"ggml_type": "Q8_0"}}
    assert CpuMethod.from_manifest(manifest).ggml_type == "Q8_0"
    assert CpuMethod.from_manifest({"method": "RAWINT4", "group_size": 32, "ggml_type": None}) is METHODS.get("rawint4")


def test_cpu_rawint4_bad_group_size_is_a_usage_error_before_writing(tiny_model, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["cpu", str(tiny_model("qwen3_moe")), str(out), "--method", "rawint4",
                                      "--group-size", "100", "--quiet"])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "unsupported group size for RAWINT4" in result.output and "expected 32, found 100" in result.output
    assert "kt-kernel 0.7.2" in result.output and "NUMA" not in result.output and not out.exists()


@pytest.mark.parametrize("size", ["64", "128"])
def test_cpu_rawint4_refuses_group_sizes_kt_kernel_cannot_run(tiny_model, tmp_path, size):
    """kt-kernel 0.7.2's RAWINT4 returns garbage / NaN at group 64 / 128: refused (exit 2) before OUT exists, by
    plan as by cpu, naming the kt-kernel limit."""
    out = tmp_path / "out"
    for cmd in (["cpu", str(tiny_model("qwen3_moe")), str(out)], ["plan", str(tiny_model("qwen3_moe"))]):
        result = CliRunner().invoke(cli, cmd + ["--method", "rawint4", "--group-size", size, "--quiet"]
                                    if cmd[0] == "cpu" else cmd + ["--method", "rawint4", "--group-size", size])
        assert result.exit_code == EXIT_USAGE, result.output
        assert f"expected 32, found {size}" in result.output and "kt-kernel 0.7.2" in result.output
    assert not out.exists()


def test_rawint4_default_group_size_is_32(tiny_model, tmp_path):
    """Without --group-size rawint4 writes group 32 (weight_scale [n, k/32]), the size kt-kernel runs."""
    import json

    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["cpu", str(tiny_model("qwen3_moe")), str(out), "--method", "rawint4",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "ktconvert.json").read_text())
    assert manifest["group_size"] == 32
    config = json.loads((out / "config.json").read_text())
    group = next(iter(config["quantization_config"]["config_groups"].values()))
    assert group["weights"]["group_size"] == 32


@pytest.mark.parametrize("name", ["amxint4", "fp8"])
def test_bad_numa_lists_the_counts_that_work(name):
    # H = 2048, I = 768: AMXINT4 needs I/T % 128 (k of down) and % 32; FP8 whole 128-blocks of I/T
    with pytest.raises(ShapeError, match=r"--numa 4 .*valid NUMA counts: \[1, 2, 3, 6\]"):
        METHODS.get(name).check_numa(2048, 768, 4)


def test_runtime_notes_name_amx_only_where_it_is_missing():
    raw = METHODS.get("rawint4")
    assert any("needs AMX" in n for n in raw.runtime_notes(["avx512f", "avx512bw"]))
    assert raw.runtime_notes(["avx512f", "amx_tile", "amx_int8"]) == []
    assert all(m.runtime_notes(["avx2"]) == [] for m in all_methods() if not (m.needs_amx or m.needs_avx512))


def test_plan_says_rawint4_needs_amx(tiny_model, monkeypatch):
    from ktconvert import api
    from ktconvert.cpu import plan as plan_module

    model = tiny_model("qwen3_moe")
    monkeypatch.setattr(plan_module, "cpu_flags", lambda: ["avx2", "avx512f"])
    notes = api.plan(model, method="rawint4", numa=1).cpu["notes"]
    assert any("RAWINT4 backend needs AMX" in n for n in notes)
    monkeypatch.setattr(plan_module, "cpu_flags", lambda: ["avx512f", "amx_tile", "amx_int8"])
    assert not any("AMX" in n for n in api.plan(model, method="rawint4", numa=1).cpu["notes"])
    monkeypatch.setattr(plan_module, "cpu_flags", lambda: ["avx2"])
    assert not any("needs AMX" in n for n in api.plan(model, method="fp8", numa=1).cpu["notes"])


def test_inspect_offers_every_writable_method_for_a_bf16_model(tiny_model):
    """A BF16 model is not FP8 / RAWINT4 as is, but `cpu` converts it into both (issue 12 item 8)."""
    from ktconvert.run.inspection import inspect

    lines = inspect(tiny_model("qwen3_moe"))["kt_methods"]
    assert lines["BF16"].startswith("as is")
    for kt_method in ("FP8", "RAWINT4", "AMXINT4", "AMXINT8"):
        assert lines[kt_method].startswith("convert: ktconvert cpu MODEL OUT --method " + kt_method.lower())
    assert lines["LLAMAFILE"] == "convert: ktconvert cpu MODEL OUT --method llamafile"     # I = 256: one block
    # I = 128 is no multiple of QK_K = 256, the first of kt-kernel's LLAMAFILE rules
    assert inspect(tiny_model("qwen3_moe", intermediate=128))["kt_methods"]["LLAMAFILE"] == \
        "no: needs I % 256 == 0 (kt-kernel's LLAMAFILE), found I = 128"


def test_cpu_rawint4_says_it_needs_amx_where_the_cpu_lacks_it(tiny_model, tmp_path, monkeypatch):
    from ktconvert.cpu import output as cpu_output

    monkeypatch.setattr(cpu_output, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_vnni"])
    result = CliRunner().invoke(cli, ["cpu", str(tiny_model("qwen3_moe")), str(tmp_path / "raw"), "--method",
                                      "RAWINT4", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "kt-kernel 0.7.2's RAWINT4 backend needs AMX" in result.stdout
    monkeypatch.setattr(cpu_output, "cpu_flags", lambda: ["avx512f", "amx_tile", "amx_int8"])
    result = CliRunner().invoke(cli, ["cpu", str(tiny_model("qwen3_moe")), str(tmp_path / "raw2"), "--method",
                                      "rawint4", "--quiet"])
    assert result.exit_code == 0 and "AMX" not in result.stdout


@pytest.mark.parametrize("method", ["bf16", "rawint4", "fp8"])
@pytest.mark.parametrize("quant", ["mse", "gptq"])
def test_a_quantizer_the_method_does_not_take_is_refused_before_out_exists(tiny_model, tmp_path, method, quant):
    """--quant mse / gptq with an in-place method used to write --quant rtn's bytes and record the option: now
    exit 2 naming what works, before OUT exists, in cpu and plan alike."""
    calib = tmp_path / "c.jsonl"
    calib.write_text('{"input_ids": [1, 2, 3]}\n')
    extra = ["--calibration", str(calib)] if quant == "gptq" else []
    out = tmp_path / "out"
    for cmd in (["cpu", str(tiny_model("qwen3_moe")), str(out), *extra], ["plan", str(tiny_model("qwen3_moe"))]):
        result = CliRunner().invoke(cli, cmd + ["--method", method, "--quant", quant])
        assert result.exit_code == EXIT_USAGE, result.output
        assert f"--quant {quant} does not apply to --method {method}; expected rtn" in result.output
    assert not out.exists()
    assert METHODS.get("amxint4").quants == ("rtn", "mse", "gptq") and METHODS.get(method).quants == ("rtn",)


@pytest.mark.parametrize("method", ["amxint4", "amxint8", "bf16", "fp8"])
def test_group_size_with_a_method_without_groups_is_refused(tiny_model, tmp_path, method):
    """--group-size used to be ignored silently for methods without groups: exit 2 before OUT exists."""
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["cpu", str(tiny_model("qwen3_moe")), str(out), "--method", method,
                                      "--group-size", "64", "--quiet"])
    assert result.exit_code == EXIT_USAGE and f"--group-size does not apply to --method {method}" in result.output
    assert not out.exists()

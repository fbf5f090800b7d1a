"""``--method gptq_int4`` with ``--numa 2``, resume and parts / merge (issue 27): the bytes never depend on how the
run was carried out.

* ``--quant gptq`` interrupted after layer 1 of a 3-layer model and resumed (stream state at layer 1, older, or
  gone) gives the folder of an uninterrupted run, byte for byte, ktconvert.json included, as for AMXINT4
  (test_gptq_resume_mtp: the same interruption helpers);
* ``--quant gptq`` by layer-range parts is refused before OUT exists (each layer needs the quantized layers before
  it), as for AMXINT4;
* ``--quant rtn`` / ``mse`` in two parts (``--layers``) merged equal one single run, byte for byte.

The reference is the uninterrupted single-process run itself (its files are checked against AutoGPTQ's format and
kt-kernel in test_gptq_int4_quant / the interop tests): what is checked here is that resuming or splitting changes
no byte.
"""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from ktconvert import api
from ktconvert.cli.main import cli
from ktconvert.distributed.merge import merge
from ktconvert.formats.out_manifest import load_manifest
from test_gptq_resume_mtp import RESUMED_WORK, _calibration, _resumed_equals_uninterrupted
from test_parts import tree

pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

# I = 256: --numa 2 gives kt-kernel's GPTQ_INT4 whole 128-groups per NUMA part of down (I/T = 128)
GPTQ_MODEL = dict(layers=3, intermediate=256)
MERGE_MODEL = dict(layers=4, experts=4, hidden=128, intermediate=256)   # deepseek_v3: layer 0 dense, MoE 1..3


@pytest.mark.parametrize("saved_at", ["layer 1", pytest.param("layer 0", marks=pytest.mark.slow),
                                      pytest.param("none", marks=pytest.mark.slow)])
def test_gptq_int4_gptq_numa2_resume_is_byte_identical(tiny_model, tmp_path, monkeypatch, saved_at):
    model, calibration = tiny_model("qwen3_moe", **GPTQ_MODEL), _calibration(tmp_path)

    def convert(out, resume):
        api.convert_cpu(model, out, method="gptq_int4", numa=2, quant="gptq", calibration=calibration,
                        min_tokens=1, resume=resume)

    work = _resumed_equals_uninterrupted(tmp_path, monkeypatch, convert, saved_at)
    assert work == {"run": RESUMED_WORK[saved_at], "written": [2]}
    manifest = load_manifest(tmp_path / "whole")
    assert manifest["quant"] == "gptq" and manifest["numa"] == 2, {k: manifest.get(k) for k in ("quant", "numa")}
    assert sorted(manifest["gptq"]["layers"]) == ["0", "1", "2"]
    assert any(name.endswith(".qweight") for name in manifest["tensors"])


def test_gptq_int4_gptq_parts_are_refused_before_out_exists(tiny_model, tmp_path):
    model = tiny_model("qwen3_moe", **GPTQ_MODEL)
    out = tmp_path / "part"
    result = CliRunner().invoke(cli, ["cpu", str(model), str(out), "--method", "gptq_int4", "--numa", "2",
                                      "--quant", "gptq", "--calibration", str(_calibration(tmp_path)),
                                      "--layers", "1-1"])
    assert result.exit_code == 2, result.output
    assert "--quant gptq" in result.output and not out.exists()


@pytest.mark.parametrize("quant", ["rtn", "mse"])
def test_gptq_int4_numa2_parts_merge_equal_single_run(tiny_model, tmp_path, quant):
    model = tiny_model("deepseek_v3", **MERGE_MODEL)
    options = dict(method="gptq_int4", numa=2, quant=quant)
    api.convert_cpu(model, tmp_path / "single", **options)
    parts = []
    for text in ("2-3", "1-1"):
        parts.append(tmp_path / f"part-{text}")
        api.convert_cpu(model, parts[-1], layers=text, **options)
    merge(tmp_path / "merged", parts)
    assert tree(tmp_path / "merged") == tree(tmp_path / "single")
    assert load_manifest(tmp_path / "single")["numa"] == 2

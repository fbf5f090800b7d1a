"""`ktconvert gpu --ignore PATTERN`: llm-compressor's ignore entries in the GPU checkpoint's config.json.

Golden references: llm-compressor's own model_free_ptq config step (``validate_config``: how it adds ``ignore`` to a
config), compressed-tensors' QuantizationConfig parser and its ``match_name`` (which modules a reader leaves dense),
and the written safetensors headers (what is dense)."""
from __future__ import annotations

import json

import pytest

from ktconvert.formats.safetensors_reader import Checkpoint

O_PROJ = r"re:.*self_attn\.o_proj$"


def _cli(*args):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _qc(out) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def ignored_out(tiny_model, tmp_path_factory):
    """A qwen3_moe GPU checkpoint (BF16 linears) with two --ignore entries, and the same without them."""
    src = tiny_model("qwen3_moe")
    root = tmp_path_factory.mktemp("ignore")
    for name, extra in (("plain", []), ("ignored", ["--ignore", "lm_head", "--ignore", O_PROJ])):
        res = _cli("gpu", src, root / name, "--linears", "bf16", "--quiet", *extra)
        assert res.exit_code == 0, res.output
    return src, root / "plain", root / "ignored"


def test_ignore_list_as_llm_compressor_writes_it(ignored_out):
    from compressed_tensors.quantization import QuantizationConfig
    from llmcompressor.entrypoints.model_free.validate import validate_config

    _, plain, ignored = ignored_out
    base = QuantizationConfig.model_validate({k: v for k, v in _qc(plain).items() if k != "linear_fp8_config"})
    want = validate_config(base, None, ["lm_head", O_PROJ]).ignore       # llm-compressor: existing + ignore
    parsed = QuantizationConfig.model_validate(_qc(ignored))
    assert _qc(ignored)["ignore"] == list(want) == list(parsed.ignore)
    assert _qc(ignored)["ignore"][-2:] == ["lm_head", O_PROJ]
    drop = ("ignore",)
    assert {k: v for k, v in _qc(ignored).items() if k not in drop} == {k: v for k, v in _qc(plain).items()
                                                                        if k not in drop}


def test_ignored_modules_are_dense_and_the_rest_packed(ignored_out):
    from compressed_tensors.utils.match import match_name

    _, _, out = ignored_out
    ignore = _qc(out)["ignore"]
    ck = Checkpoint.open(out)
    names = set(ck.tensors)
    modules = {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight", ".weight_packed"))}
    o_proj = sorted(m for m in modules if m.endswith("self_attn.o_proj"))
    assert o_proj and "lm_head" in modules
    for module in modules:
        skipped = any(match_name(module, target) for target in ignore)
        if skipped:
            assert ck.ref(module + ".weight").dtype in ("BF16", "F32", "F16"), module
            assert module + ".weight_packed" not in names, module
        elif module + ".weight_packed" in names:
            assert ".experts." in module
        else:       # not a Linear (norms, embeddings): the config's Linear target does not reach it
            assert "norm" in module or "embed" in module, module
    for module in o_proj + ["lm_head"]:
        assert any(match_name(module, target) for target in ignore[-2:]), module


def test_ignored_checkpoint_verifies_and_journals(ignored_out):
    from ktconvert.gpu.verify import check_gpu_checkpoint

    src, _, out = ignored_out
    report = check_gpu_checkpoint(out, source=src, experts=1)
    assert report["ok"], report["problems"]
    assert json.loads((out / "ktconvert.json").read_text())["gpu"]["ignore"] == ["lm_head", O_PROJ]


def test_dry_run_counts_matches(ignored_out, tmp_path):
    src, _, out = ignored_out
    res = _cli("gpu", src, tmp_path / "o", "--linears", "bf16", "--dry-run", "--json", "--ignore", O_PROJ,
               "--ignore", "lm_head", "--ignore", "re:nothing\\.here$")
    assert res.exit_code == 0, res.output
    o_proj = {n for n in Checkpoint.open(out).tensors if n.endswith("self_attn.o_proj.weight")}
    assert json.loads(res.output)["gpu"]["ignore"] == {O_PROJ: len(o_proj), "lm_head": 1, "re:nothing\\.here$": 0}
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,words", [
    (["--ignore", "re:.*experts.*"], "routed expert"),
    (["--ignore", "gate"], "routed expert"),                  # SGLang matches plain names as a substring
    (["--ignore", O_PROJ], "FP8 linear"),                    # --linears fp8: linear_fp8_config covers every linear
    (["--ignore", "re:("], "not a regular expression"),
    (["--ignore", ""], "module name or re:REGEX"),
])
def test_refused_before_anything_is_written(tiny_model, tmp_path, args, words):
    res = _cli("gpu", tiny_model("qwen3_moe"), tmp_path / "o", "--quiet", *args)
    assert res.exit_code == 2, res.output
    assert words in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "o").exists()


def test_resume_needs_the_same_ignore_list(ignored_out):
    src, _, out = ignored_out
    other = _cli("gpu", src, out, "--linears", "bf16", "--resume", "--ignore", "lm_head")
    assert other.exit_code == 2 and "--ignore" in other.output, other.output
    same = _cli("gpu", src, out, "--linears", "bf16", "--resume", "--quiet", "--ignore", "lm_head", "--ignore", O_PROJ)
    assert same.exit_code == 0 and "already complete" in same.output, same.output

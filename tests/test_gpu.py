"""ktconvert gpu / convert / verify for GPU checkpoints (gpu-format.md §4.3, §6.5, §8).

Golden references: llmcompressor's model_free_ptq (a real third-party writer) for the expert bytes, torch's own
float8_e4m3fn cast for the FP8 linears, compressed-tensors for config parsing and decompression."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ktconvert.formats.safetensors_reader import Checkpoint

FAMILIES = [("deepseek_v3", "fp8"), ("deepseek_v3", "bf16"), ("kimi_k2", "bf16"), ("qwen3_moe", "bf16"),
            ("glm4_moe", "bf16"), ("minimax_m2", "bf16")]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def gpu_out(tiny_model, tmp_path_factory):
    from ktconvert.api import convert_gpu

    cache = {}

    def build(arch, dtype, linears="fp8", experts="w4a16"):
        key = (arch, dtype, linears, experts)
        if key not in cache:
            out = tmp_path_factory.mktemp("gpu") / "-".join(key)
            convert_gpu(tiny_model(arch, dtype=dtype), out, experts=experts, linears=linears, threads=2)
            cache[key] = out
        return cache[key]

    return build


DEFAULT_RUN = {("deepseek_v3", "fp8", "fp8"), ("deepseek_v3", "fp8", "bf16"), ("qwen3_moe", "bf16", "fp8"),
               ("glm4_moe", "bf16", "fp8"), ("kimi_k2", "bf16", "bf16"), ("minimax_m2", "bf16", "bf16")}


@pytest.mark.parametrize("arch,dtype,linears", [
    pytest.param(a, d, m, marks=() if (a, d, m) in DEFAULT_RUN else pytest.mark.slow)
    for a, d in FAMILIES for m in ("fp8", "bf16")])
def test_convert_and_verify(gpu_out, tiny_model, arch, dtype, linears):
    from ktconvert.gpu.verify import check_gpu_checkpoint

    out = gpu_out(arch, dtype, linears)
    report = check_gpu_checkpoint(out, source=tiny_model(arch, dtype=dtype), experts=2)
    assert report["ok"], report["problems"]
    assert 0.05 < report["errors"]["max_rel_l2"] < 0.35        # int4 g128 on heavy-tailed weights
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert list(qc)[-1] == "linear_fp8_config" if linears == "fp8" else "linear_fp8_config" not in qc
    assert json.loads((out / "ktconvert.json").read_text())["kind"] == "gpu"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {p.name for p in out.glob("*.safetensors")}
    ck = Checkpoint.open(out)
    attn = [n for n in ck.tensors if n.endswith("self_attn.o_proj.weight")]
    assert attn and all(ck.tensors[n].dtype == ("F8_E4M3" if linears == "fp8" else "BF16") for n in attn)
    assert not any(n.endswith(("weight_zero_point", "weight_g_idx")) for n in ck.tensors)


def test_fp8_source_linears_copied_byte_for_byte(gpu_out, tiny_model):
    src = Checkpoint.open(tiny_model("deepseek_v3", dtype="fp8"))
    out = Checkpoint.open(gpu_out("deepseek_v3", "fp8"))
    names = [n for n in out.tensors if ".self_attn." in n and n.endswith(("proj.weight", "weight_scale_inv"))]
    names += [n for n in out.tensors if "shared_experts" in n]
    assert len(names) > 20
    for name in names:
        assert out.ref(name).dtype == src.ref(name).dtype
        assert out.read(name).tobytes() == src.read(name).tobytes(), name


def test_fp8_linears_match_torch_cast(gpu_out, tiny_model):
    """BF16 source linear -> e4m3 codes equal torch's saturating RNE cast of w / (block amax / 448)."""
    import torch

    src = Checkpoint.open(tiny_model("deepseek_v3"))
    out = Checkpoint.open(gpu_out("deepseek_v3", "bf16"))
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"):
        w = torch.from_numpy(src.read(name).view(np.int16)).view(torch.bfloat16).float()
        n, k = w.shape
        scale = out.read(name + "_scale_inv")
        assert scale.dtype == np.float32 and scale.shape == (-(-n // 128), -(-k // 128))
        s = torch.from_numpy(scale).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        blocks = torch.nn.functional.pad(w.abs(), (0, -k % 128, 0, -n % 128))
        amax = blocks.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).amax(dim=(1, 3))
        assert torch.equal(torch.from_numpy(scale), torch.where(amax == 0, 1.0, amax / 448.0))
        codes = (w / s).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(out.read(name), codes), name


@pytest.mark.parametrize("arch,dtype,scheme", [
    ("qwen3_moe", "bf16", "W4A16"),
    pytest.param("qwen3_moe", "bf16", "W8A16", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "fp8", "W4A16", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "fp8", "W8A16", marks=pytest.mark.slow)])
def test_experts_bit_identical_to_model_free_ptq(gpu_out, tiny_model, tmp_path, arch, dtype, scheme):
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor import model_free_ptq

    src = tiny_model(arch, dtype=dtype)
    targets = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
    kw = {}
    if dtype == "fp8":
        from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

        kw["converter"] = FP8BlockDequantizer(targets=targets)
    model_free_ptq(str(src), str(tmp_path / "ref"), scheme=preset_name_to_scheme(scheme, targets), device="cpu",
                   **kw)
    ref = Checkpoint.open(tmp_path / "ref")
    ours = Checkpoint.open(gpu_out(arch, dtype, "fp8", scheme.lower()))
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    expert_names = [n for n in ours.tensors if ".experts." in n]
    ref_names = {n for n in ref.tensors if ".experts." in n and n.endswith(("_packed", "_scale", "_shape"))}
    assert len(expert_names) > 100 and set(expert_names) <= ref_names
    assert all(int(n.split(".")[2]) >= n_layers for n in ref_names - set(expert_names))   # MTP: ours leaves it out
    for name in expert_names:
        assert ours.ref(name).dtype == ref.ref(name).dtype and ours.ref(name).shape == ref.ref(name).shape, name
        assert ours.read(name).tobytes() == ref.read(name).tobytes(), name


def test_one_pass_equals_separate_commands(tiny_model, tmp_path):
    from ktconvert.api import CpuOptions, GpuOptions, convert, convert_cpu, convert_gpu

    src = tiny_model("deepseek_v3", dtype="fp8")
    convert(src, [(tmp_path / "cpu1", CpuOptions.make(method="amxint4", numa=2)),
                  (tmp_path / "gpu1", GpuOptions.make(experts="w4a16"))], threads=2)
    convert_cpu(src, tmp_path / "cpu2", method="amxint4", numa=2, threads=2)
    convert_gpu(src, tmp_path / "gpu2", experts="w4a16", threads=1)
    assert _tree(tmp_path / "cpu1") == _tree(tmp_path / "cpu2")
    assert _tree(tmp_path / "gpu1") == _tree(tmp_path / "gpu2")


# ---------------------------------------------------------------------------------------------- broken variants

def _broken(gpu_out, tmp_path) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(gpu_out("deepseek_v3", "fp8"), out)
    return out


def _edit_qc(out: Path, edit) -> None:
    path = out / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config, indent=2))


def _rewrite_shard(out: Path, shard: str, rename=lambda n: n, drop=lambda n: False) -> None:
    from ktconvert.formats.st_writer import StreamingSafetensorsWriter

    ck = Checkpoint.open(out / shard)
    keep = [(rename(n), n, r) for n, r in ck.tensors.items() if not drop(n)]
    data = {new: ck.read(old) for new, old, _ in keep}
    with StreamingSafetensorsWriter(out / shard, [(new, r.dtype, r.shape) for new, _, r in keep]) as w:
        for name, arr in data.items():
            w.write(name, arr)


def _problems(out: Path) -> str:
    from ktconvert.gpu.verify import check_gpu_checkpoint

    report = check_gpu_checkpoint(out, experts=1)
    assert not report["ok"]
    return "\n".join(report["problems"])


def test_verify_rejects_null_linear_fp8_config(gpu_out, tmp_path):
    out = _broken(gpu_out, tmp_path)
    _edit_qc(out, lambda qc: qc.update(linear_fp8_config=None))
    assert "linear_fp8_config is null" in _problems(out)


def test_verify_rejects_weight_scale_instead_of_scale_inv(gpu_out, tmp_path):
    out = _broken(gpu_out, tmp_path)
    shard = "model-00002-of-00003.safetensors"
    _rewrite_shard(out, shard, rename=lambda n: n.replace("o_proj.weight_scale_inv", "o_proj.weight_scale"))
    text = _problems(out)
    assert "o_proj.weight_scale_inv missing" in text and "found weight_scale" in text


def test_verify_rejects_missing_expert(gpu_out, tmp_path):
    out = _broken(gpu_out, tmp_path)
    _rewrite_shard(out, "model-00003-of-00003.safetensors", drop=lambda n: ".experts.5.down_proj." in n)
    assert "model.layers.2.mlp.experts.5.down_proj.weight_packed: missing" in _problems(out)


def test_verify_rejects_ignore_missing_fused_qkv_a(gpu_out, tmp_path):
    """llmcompressor-style expanded HF names satisfy compressed-tensors but not SGLang's fused module name."""
    out = _broken(gpu_out, tmp_path)
    hf_attn = r"re:.*self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj|kv_b_proj|o_proj)$"
    _edit_qc(out, lambda qc: qc.update(ignore=[hf_attn if e == "re:.*self_attn.*" else e for e in qc["ignore"]]))
    text = _problems(out)
    assert "self_attn.fused_qkv_a_proj_with_mqa under SGLang's matcher" in text
    assert "compressed-tensors' matcher" not in text


def test_verify_rejects_unknown_key_in_weights(gpu_out, tmp_path):
    out = _broken(gpu_out, tmp_path)
    _edit_qc(out, lambda qc: qc["config_groups"]["group_0"]["weights"].update(fmt="e4m3"))
    assert "rejected by compressed-tensors" in _problems(out)


# ---------------------------------------------------------------------------------------------- CLI, plan, hook

def test_cli_gpu_verify_and_dry_run(tiny_model, tmp_path):
    from click.testing import CliRunner

    from ktconvert.cli.main import cli

    src = tiny_model("qwen3_moe")
    runner = CliRunner()
    dry = runner.invoke(cli, ["gpu", str(src), str(tmp_path / "o"), "--dry-run", "--json", "--experts", "w8a16"])
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.output)["gpu"]
    res = runner.invoke(cli, ["gpu", str(src), str(tmp_path / "o"), "--experts", "w8a16", "--quiet"])
    assert res.exit_code == 0, res.output
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "o").glob("*.safetensors")}
    assert sizes == {f["path"]: f["bytes"] for f in plan["files"]}
    ver = runner.invoke(cli, ["verify", str(tmp_path / "o"), "--source", str(src), "--hashes"])
    assert ver.exit_code == 0, ver.output
    _edit_qc(tmp_path / "o", lambda qc: qc.update(linear_fp8_config=None))
    assert runner.invoke(cli, ["verify", str(tmp_path / "o")]).exit_code == 4


def test_gptq_hook_missing_is_a_clear_error(tiny_model, tmp_path, monkeypatch):
    import sys

    from ktconvert.errors import KtConvertError
    from ktconvert.api import convert_gpu

    monkeypatch.setitem(sys.modules, "ktconvert.gpu.gptq", None)      # as in an installation without the module
    calibration = tmp_path / "calib.jsonl"
    calibration.write_text('{"input_ids": [1, 2, 3]}\n')
    with pytest.raises(KtConvertError, match="--quant gptq is not available"):
        convert_gpu(tiny_model("qwen3_moe"), tmp_path / "o", quant="gptq", calibration=calibration)
    assert not (tmp_path / "o").exists()

"""`inspect` and `plan` on tiny checkpoints of every family.

Expected numbers are derived in the test: layer kinds and expert counts from the tensor names (read with
safetensors' own safe_open), dims from config.json, byte counts from the kt-format formulas (INT4 n*k/2, INT8 n*k,
scales 4n), shard sizes from files written by safetensors.numpy.save_file, the index size from json.dumps.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ktconvert.errors import EXIT_INPUT, OutputError, ShapeError
from ktconvert import api
from ktconvert.cpu.plan import render as render_plan
from ktconvert.run.inspection import inspect, render as render_inspect

HIDDEN, INTER, EXPERTS = 128, 128, 4
EXPERT_RE = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?:(\d+)\.|gate_up_proj|down_proj)")
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1}


def plan(src, **options):
    """The CPU plan (ktconvert.api.plan(...).cpu: its report through plan[key])."""
    return api.plan(src, **options).cpu


def _families() -> list[str]:
    from ktconvert.architectures.manifests import families

    return sorted(next(iter(m.tiny)) for m in families().values() if m.tiny)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from ktconvert.examples.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {mt: make_tiny_model(root / mt, arch=mt, experts=EXPERTS, hidden=HIDDEN, intermediate=INTER)
            for mt in _families()}


def _scan(path: Path) -> dict:
    """Independent facts from the files: per-tensor bytes, expert layers, expert indices."""
    tensor_bytes, expert_layers, expert_ids = {}, set(), set()
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="np") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                tensor_bytes[name] = int(np.prod(sl.get_shape(), dtype=np.int64)) * ITEMSIZE[sl.get_dtype()]
                m = EXPERT_RE.search(name)
                if m:
                    expert_layers.add(int(m.group(1)))
                    if m.group(2) is not None:
                        expert_ids.add(int(m.group(2)))
                    elif name.endswith("down_proj"):
                        expert_ids.update(range(sl.get_shape()[0]))
    return {"bytes": tensor_bytes, "expert_layers": sorted(expert_layers), "expert_ids": sorted(expert_ids)}


def _text_config(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg


@pytest.mark.parametrize("model_type", _families())
def test_inspect_numbers(tiny_models, model_type):
    path = tiny_models[model_type]
    cfg, facts = _text_config(path), _scan(path)
    n_layers = cfg["num_hidden_layers"]
    moe = [layer for layer in facts["expert_layers"] if layer < n_layers]
    mtp = [layer for layer in facts["expert_layers"] if layer >= n_layers]
    r = inspect(path)
    assert r["supported"] and r["model_type"] == json.loads((path / "config.json").read_text())["model_type"]
    assert r["layers"]["total"] == n_layers
    assert r["layers"]["moe"] == moe and r["layers"]["mtp"] == mtp
    assert r["layers"]["dense"] == [layer for layer in range(n_layers) if layer not in moe]
    assert r["experts"] == EXPERTS == len(facts["expert_ids"])
    assert (r["hidden"], r["intermediate"]) == (HIDDEN, INTER) == (cfg["hidden_size"],
                                                                   cfg.get("moe_intermediate_size", INTER))
    assert r["experts_per_tok"] == cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    assert r["tensors"] == len(facts["bytes"])
    assert sum(r["components"].values()) == sum(facts["bytes"].values()) == sum(r["dtypes"].values())
    routed = sum(b for n, b in facts["bytes"].items()
                 if EXPERT_RE.search(n) and int(EXPERT_RE.search(n).group(1)) < n_layers)
    bias = 0 if model_type != "gpt_oss" else len(moe) * EXPERTS * (2 * INTER + HIDDEN) * 2
    assert routed == len(moe) * EXPERTS * 3 * INTER * HIDDEN * 2 + bias
    assert r["components"]["routed_experts"] == routed
    assert r["input_format"] == "bf16" and r["quantization"] is None
    assert r["kt_methods"]["AMXINT4"].startswith("convert")
    assert render_inspect(r).count("\n") > 10


def _expected_expert_bytes(bits: int, T: int) -> int:
    part = INTER // T
    gate = part * HIDDEN * bits // 8 + 4 * part
    down = HIDDEN * part * bits // 8 + 4 * HIDDEN
    return T * (2 * gate + down)


@pytest.mark.parametrize("model_type", _families())
def test_plan_numbers(tiny_models, model_type):
    path = tiny_models[model_type]
    moe = [layer for layer in _scan(path)["expert_layers"] if layer < _text_config(path)["num_hidden_layers"]]
    p = plan(path, method="amxint8", numa=2)
    assert p["layers"] == moe and p["experts"] == EXPERTS and p["numa"] == 2
    assert p["expert_bytes"] == _expected_expert_bytes(8, 2)
    shards = [f for f in p["files"] if f["path"].startswith("model-")]
    assert [f["path"] for f in shards] == [f"model-{i:05d}-of-{len(moe):05d}.safetensors"
                                           for i in range(1, len(moe) + 1)]
    copies = {n for n in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "generation_config.json") if (path / n).is_file()}
    assert copies <= {f["path"] for f in p["files"]}
    assert p["total_bytes"] == sum(f["bytes"] for f in p["files"])
    assert all(c["ok"] for c in p["checks"])
    assert "T=2" in render_plan(p.report)


def _merged_reference(tmp_path: Path, layer: int, bits: int, T: int) -> int:
    """Size of a merged shard written by safetensors itself (zeros of the kt-format shapes)."""
    part = INTER // T
    tensors = {}
    for proj, (n, k) in (("gate", (part, HIDDEN)), ("up", (part, HIDDEN)), ("down", (HIDDEN, part))):
        for e in range(EXPERTS):
            for t in range(T):
                tensors[f"blk.{layer}.ffn_{proj}_exps.{e}.numa.{t}.weight"] = np.zeros(n * k * bits // 8, np.int8)
                tensors[f"blk.{layer}.ffn_{proj}_exps.{e}.numa.{t}.scale"] = np.zeros(n, np.float32)
    out = tmp_path / f"ref-{layer}-{bits}-{T}.safetensors"
    save_file(tensors, out)
    return out.stat().st_size, sorted(tensors), sum(a.nbytes for a in tensors.values())


@pytest.mark.parametrize("method,bits,T", [("amxint4", 4, 1), ("amxint8", 8, 1), ("amxint8", 8, 2)])
def test_plan_merged_bytes_exact(tiny_models, tmp_path, method, bits, T):
    path = tiny_models["deepseek_v3"]   # MoE layers 1, 2 (+ MTP 3)
    p = plan(path, method=method, numa=T, include_mtp=True)
    assert p["layers"] == [1, 2, 3] and p["mtp_layers"] == [3]
    shards = [f for f in p["files"] if f["path"].startswith("model-")]
    weight_map, data = {}, 0
    for i, (f, layer) in enumerate(zip(shards, [1, 2, 3]), start=1):
        size, keys, nbytes = _merged_reference(tmp_path, layer, bits, T)
        assert f["bytes"] == size
        weight_map.update({k: f"model-{i:05d}-of-00003.safetensors" for k in keys})
        data += nbytes
    index = json.dumps({"metadata": {"total_size": data}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
    assert next(f for f in p["files"] if f["path"] == "model.safetensors.index.json")["bytes"] == len(index)


def test_plan_kt_layout_counts(tiny_models):
    p = plan(tiny_models["qwen3_moe"], method="amxint4", numa=1, layout="kt")
    n_files = 2 * 1 * EXPERTS * 3 * 2
    assert p["summary"]["kt_files"] == n_files
    kt = [f for f in p["files"] if f["path"].endswith(".kt")]
    assert len(kt) == n_files     # small enough to be listed
    gate_q = INTER * HIDDEN // 2
    assert f"_layer_0/_numa_0/INT4_gate_0_{gate_q}Byte_quant_.kt" in {f["path"] for f in kt}
    assert sum(f["bytes"] for f in kt) == 2 * EXPERTS * _expected_expert_bytes(4, 1)


@pytest.mark.parametrize("method,T,valid", [("amxint4", 2, [1]), ("amxint8", 4, [1, 2]), ("amxint8", 3, [1, 2])])
def test_plan_rejects_bad_numa(tiny_models, method, T, valid):
    # INT4: I/T % 128 and INT8: I/T % 64 (k of down) with I = 128; T = 3 does not divide I
    with pytest.raises(ShapeError) as info:
        plan(tiny_models["qwen3_moe"], method=method, numa=T)
    assert f"valid NUMA counts: {valid}" in str(info.value)


def test_plan_cli_bad_numa_exit_code(tiny_models, monkeypatch, capsys):
    from ktconvert.cli import main as cli
    monkeypatch.setattr(sys, "argv", ["ktconvert", "plan", str(tiny_models["mixtral"]), "--method", "amxint4",
                                      "--numa", "2"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == EXIT_INPUT and "valid NUMA counts: [1]" in capsys.readouterr().err


def test_plan_disk_check(tiny_models, tmp_path, monkeypatch):
    import shutil

    out = tmp_path / "not" / "yet"
    p = plan(tiny_models["qwen3_moe"], method="amxint8", numa=1, out=str(out))
    assert p["disk_path"] == str(tmp_path) and p["disk_free_bytes"] == shutil.disk_usage(tmp_path).free
    monkeypatch.setattr("ktconvert.cpu.sizes.shutil.disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))
    with pytest.raises(OutputError, match="not enough free disk"):
        plan(tiny_models["qwen3_moe"], method="amxint8", numa=1, out=str(out))


def test_plan_biases_and_in_place_methods(tiny_models):
    p = plan(tiny_models["gpt_oss"], method="amxint4", numa=1)
    assert any("carry no bias" in n for n in p["notes"])
    b = plan(tiny_models["qwen3_moe"], method="bf16", numa=2)
    assert b["expert_bytes"] == 3 * INTER * HIDDEN * 2 and b["total_bytes"] == sum(f["bytes"] for f in b["files"])
    shards = [f["bytes"] for f in b["files"] if f["path"].endswith(".safetensors")]
    assert len(shards) == 2 and 0 < sum(shards) - 2 * EXPERTS * b["expert_bytes"] <= 2 * EXPERTS * 3 * 200  # headers
    r = plan(tiny_models["qwen3_moe"], method="rawint4", numa=1)
    assert r["expert_bytes"] == 3 * (INTER * HIDDEN // 2 + 2 * INTER * HIDDEN // 32 + 16)
    f = plan(tiny_models["qwen3_moe"], method="fp8", numa=1)
    assert f["expert_bytes"] == 3 * (INTER * HIDDEN + 4)
    with pytest.raises(ShapeError, match="valid NUMA counts: \\[1\\]"):
        plan(tiny_models["qwen3_moe"], method="fp8", numa=2)


def test_inspect_json_cli(tiny_models):
    out = subprocess.run([sys.executable, "-m", "ktconvert.cli.main", "inspect", "--json",
                          str(tiny_models["qwen3_moe"])], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["experts"] == EXPERTS


def test_cli_import_does_not_load_numpy():
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ktconvert.cli.main"],
                         capture_output=True, text=True, check=True)
    modules = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "click" in modules and "numpy" not in modules


def test_index_size_multi_digit_experts():
    from ktconvert.formats.kt_sink import KtSink
    from ktconvert.methods import METHODS

    layers, E, T, H, I = [5, 12, 100], 12, 3, 64, 96
    planned = KtSink(None, "safetensors", METHODS.get("amxint8"), T, layers, E, H, I).planned_files()
    shards = [{"path": f"model-{i:05d}-of-00003.safetensors"} for i in range(1, 4)]
    weight_map = {f"blk.{L}.ffn_{p}_exps.{e}.numa.{t}.{part}": shards[i]["path"]
                  for i, L in enumerate(layers) for p in ("gate", "up", "down") for e in range(E)
                  for t in range(T) for part in ("weight", "scale")}
    # kt-format.md §2.2, AMXINT8 part [n, k]: n * k quant bytes, n fp32 scales; gate/up [I/T, H], down [H, I/T]
    total = len(layers) * E * T * sum(n * k + 4 * n for n, k in ((I // T, H), (I // T, H), (H, I // T)))
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    assert planned["model.safetensors.index.json"].nbytes == len(text + "\n")

"""ktconvert expert-stats (ktconvert/activation): routed-token counts per layer and expert.

Golden values: transformers' own model (``from_pretrained`` in float32, eager attention, unmodified fused experts)
run over the same tokens, with the routed choice read where its MoE block hands it to the experts module; the
file read back the way SGLang-KT reads it (written out here from its documented rules, not through ktconvert);
kt-kernel's own ``generate_gpu_experts_masks`` where kt-kernel is installed.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

FAST = ["qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_k2"]
SLOW = ["deepseek_v2", "glm4_moe", "minimax_m2", "mixtral", "qwen2_moe", "qwen3_next", "qwen3_5_moe"]
LENGTHS = (23, 17, 30)


def _samples(lengths=LENGTHS, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g) for n in lengths]


def _calibration(tmp_path, samples) -> str:
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in samples))
    return str(path)


def _transformers_model(src, dtype, **kwargs):
    """The full transformers model in `dtype`, eager attention; Kimi-K2 through DeepSeek-V3's classes (the
    checkpoint ships no transformers class of its own)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    config = json.loads((src / "config.json").read_text())
    if config["model_type"] == "kimi_k2":
        cfg = DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("model_type", "auto_map",
                                                                              "architectures")})
        return DeepseekV3ForCausalLM.from_pretrained(str(src), config=cfg, dtype=dtype, attn_implementation="eager",
                                                     **kwargs)
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, attn_implementation="eager", **kwargs)


def _transformers_counts(src, samples, dtype=torch.float32) -> np.ndarray:
    """int64 [num_hidden_layers, E]: per layer, the expert ids transformers' MoE blocks pass to their (fused)
    experts module, counted over `samples`."""
    return _count_routes(_transformers_model(src, dtype), samples)


def _count_routes(model, samples) -> np.ndarray:
    text = model.config.get_text_config()
    n_experts = next(getattr(text, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                     if getattr(text, k, None))
    counts = np.zeros((text.num_hidden_layers, n_experts), np.int64)
    for L, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue

        def hook(module, args, L=L):
            counts[L] += np.bincount(args[1].reshape(-1).numpy(), minlength=n_experts)

        experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        for s in samples:
            model(input_ids=s[None], use_cache=False)
    return counts


def _sglang_load(path, config: dict) -> torch.Tensor:
    """SGLang-KT's reading of an --init-expert-location .pt file: weights_only load, dict with logical_count or
    bare tensor, 3-D [buffer, num_hidden_layers, num_experts] checked against the config, summed over dim 0,
    float32."""
    assert str(path).endswith(".pt")
    data = torch.load(path, map_location="cpu", weights_only=True)
    counts = data["logical_count"] if isinstance(data, dict) else data
    cfg = config.get("text_config") or config
    n_experts = next(cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k))
    assert counts.dim() == 3 and tuple(counts.shape[1:]) == (cfg["num_hidden_layers"], n_experts)
    return counts.sum(dim=0).float()


def _check_counts(src, samples):
    from ktconvert.activation.stats import collect_activation

    activation = collect_activation(src, samples)
    want = _transformers_counts(src, samples)
    np.testing.assert_array_equal(activation.counts, want)
    top_k = activation.meta["top_k"]
    moe = activation.meta["moe_layers"]
    assert want[moe].sum(axis=1).tolist() == [sum(LENGTHS) * top_k] * len(moe)
    assert not activation.counts[[L for L in range(len(want)) if L not in moe]].any()


@pytest.mark.parametrize("arch", FAST)
def test_counts_equal_transformers_router(tiny_model, arch):
    """Counts per (layer, expert) equal, exactly, the routing of transformers' own float32 forward of the whole
    model on the same tokens: softmax (Qwen), sigmoid + e_score_correction_bias + group-limited top-k
    (DeepSeek-V3, Kimi-K2), top-k then softmax (gpt-oss); dense layers zero."""
    _check_counts(tiny_model(arch), _samples())


@pytest.mark.slow
@pytest.mark.parametrize("arch", SLOW)
def test_counts_equal_transformers_router_other_families(tiny_model, arch):
    _check_counts(tiny_model(arch), _samples())


def test_cli_file_loads_like_sglang_and_kt_kernel(tiny_model, tmp_path):
    """`ktconvert expert-stats` writes a .pt that SGLang-KT's loading rules accept, whose counts equal
    transformers' routing, with the metadata keys; kt-kernel's generate_gpu_experts_masks takes it; a second run
    gives the same bytes."""
    from ktconvert.cli.main import cli

    src = tiny_model("deepseek_v3")
    samples = _samples()
    calib = _calibration(tmp_path, samples)
    out, report = tmp_path / "stats.pt", tmp_path / "stats.html"
    res = CliRunner().invoke(cli, ["expert-stats", str(src), str(out), "--calibration", calib, "--report",
                                   str(report), "--quiet"])
    assert res.exit_code == 0, res.output
    assert f"--init-expert-location {out} --kt-expert-placement-strategy frequency" in res.output
    config = json.loads((src / "config.json").read_text())
    freq = _sglang_load(out, config)
    np.testing.assert_array_equal(freq.numpy(), _transformers_counts(src, samples).astype(np.float32))
    data = torch.load(out, map_location="cpu", weights_only=True)
    assert data["logical_count"].dtype == torch.int64 and data["logical_count"].shape[0] == 1
    assert data["calibration_sha256"] == hashlib.sha256(open(calib, "rb").read()).hexdigest()
    assert (data["tokens"], data["samples"], data["top_k"]) == (sum(LENGTHS), 3, config["num_experts_per_tok"])
    assert data["source"]["config_sha256"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    assert report.is_file()
    again = tmp_path / "again.pt"
    assert CliRunner().invoke(cli, ["expert-stats", str(src), str(again), "--calibration", calib,
                                    "--quiet"]).exit_code == 0
    assert again.read_bytes() == out.read_bytes()
    if _kt_kernel_skip() is None:
        from ktkernel_util import ktkernel_gpu_experts_masks

        from ktconvert.activation.placement import frequency_mask

        for budget, want in ktkernel_gpu_experts_masks(freq.numpy(), [1, 3, 5, 9]).items():
            np.testing.assert_array_equal(frequency_mask(freq.numpy(), budget), want)


def _kt_kernel_skip() -> str | None:
    """kt-kernel's placement helper is plain Python: it needs kt_kernel importable, not a CPU feature."""
    from ktkernel_util import ktkernel_info

    error = ktkernel_info()["error"]
    return f"kt_kernel not usable ({error})" if error else None


def test_cli_refuses_existing_and_non_pt(tiny_model, tmp_path):
    from ktconvert.cli.main import cli

    src = tiny_model("qwen3_moe")
    calib = _calibration(tmp_path, _samples((5,)))
    res = CliRunner().invoke(cli, ["expert-stats", str(src), str(tmp_path / "x.bin"), "--calibration", calib])
    assert res.exit_code == 1 and ".pt" in res.output and not (tmp_path / "x.bin").exists()
    existing = tmp_path / "x.pt"
    existing.write_bytes(b"keep")
    res = CliRunner().invoke(cli, ["expert-stats", str(src), str(existing), "--calibration", calib])
    assert res.exit_code == 1 and "--force" in res.output and existing.read_bytes() == b"keep"


def test_interrupted_run_leaves_no_file(tiny_model, tmp_path, monkeypatch):
    """Killed in the middle of the stream: no OUT and no temporary file are left."""
    from ktconvert.activation import stats

    def interrupted(self, L, layer):
        raise KeyboardInterrupt

    monkeypatch.setattr(stats.RoutingStream, "process_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stats.expert_stats(tiny_model("qwen3_moe"), tmp_path / "x.pt", _calibration(tmp_path, _samples((5,))))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl"]


def test_no_gptq_work_in_expert_stats(tiny_model, monkeypatch):
    """expert-stats never accumulates a Hessian or quantizes, and its experts compute on routed tokens only
    (llmcompressor's calibrate-all flag stays off in every expert forward)."""
    import llmcompressor.modeling.moe.linear_experts as linear_experts
    import llmcompressor.modifiers.gptq.gptq_quantize as gptq_quantize
    import llmcompressor.modifiers.gptq.helpers as gptq_helpers

    from ktconvert.activation.stats import collect_activation

    def forbidden(*args, **kwargs):
        raise AssertionError("GPTQ work in expert-stats")

    flags = []
    real_flag = linear_experts.get_calibrate_all_experts_flag
    monkeypatch.setattr(linear_experts, "get_calibrate_all_experts_flag", lambda: flags.append(real_flag()) or
                        flags[-1])
    monkeypatch.setattr(gptq_helpers, "accumulate_hessian", forbidden)
    monkeypatch.setattr(gptq_quantize, "quantize_weight", forbidden)
    activation = collect_activation(tiny_model("qwen3_moe"), _samples((6,)))
    assert activation.counts.sum() == 6 * 2 * len(activation.meta["moe_layers"])
    assert flags and not any(flags)


# ---------------------------------------------------------------------------------------------- placement

def test_frequency_mask_equals_kt_kernel():
    """The global top-k with many ties (zero rows of dense layers, equal counts) picks exactly kt-kernel's
    experts at every budget."""
    reason = _kt_kernel_skip()
    if reason:
        pytest.skip(reason)
    from ktkernel_util import ktkernel_gpu_experts_masks

    from ktconvert.activation.placement import frequency_mask

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, size=(5, 16)).astype(np.float32)
    counts[0] = 0                                  # a dense layer
    for budget, want in ktkernel_gpu_experts_masks(counts, list(range(0, counts.size + 2))).items():
        np.testing.assert_array_equal(frequency_mask(counts, budget), want, err_msg=f"budget {budget}")


def test_sglang_rules_by_hand():
    """SGLang-KT's MoE layers, budget and uniform placement on small cases worked out by hand from its rules."""
    from ktconvert.activation.placement import gpu_expert_budget, placement, sglang_moe_layers

    layers = sglang_moe_layers({"num_hidden_layers": 5, "n_routed_experts": 8, "first_k_dense_replace": 1,
                                "moe_layer_freq": 1, "num_experts_per_tok": 2})
    assert layers.moe_layers == (1, 2, 3, 4) and layers.num_experts == 8
    assert sglang_moe_layers({"text_config": {"num_hidden_layers": 4, "num_experts": 6,
                                              "moe_layer_freq": [0, 0, 1, 1]}}).moe_layers == (2, 3)
    assert sglang_moe_layers({"num_hidden_layers": 4, "num_local_experts": 6, "moe_layer_freq": 2}).moe_layers \
        == (0, 2)
    assert gpu_expert_budget(layers, ratio=0.3) == 9          # int(4 * 8 * 0.3) = int(9.6)
    assert gpu_expert_budget(layers, per_layer=3) == 12
    chosen, mask = placement(layers, 10)                      # uniform: 10 = 3 + 3 + 2 + 2, experts 0..n-1
    assert chosen.sum(axis=1).tolist() == [0, 3, 3, 2, 2]
    assert chosen[1].tolist() == [True] * 3 + [False] * 5 and mask[0].all() and not chosen[0].any()


def test_plan_placement_cli(tiny_model, tmp_path):
    """`plan --gpu-experts-ratio R --expert-stats FILE`: the experts per layer kt-kernel's rule picks from the
    file, and their VRAM = count x the GPU plan's bytes per expert; without the file, SGLang's uniform rule."""
    from ktconvert.activation.counts import ExpertActivation, write_activation
    from ktconvert.cli.main import cli
    from ktconvert.gpu.plan import GpuOptions, plan_gpu

    src = tiny_model("deepseek_v3")                           # layers 0 dense, 1-2 MoE, 8 experts
    counts = np.zeros((3, 8), np.int64)
    counts[1] = [0, 9, 1, 1, 7, 0, 0, 2]
    counts[2] = [5, 0, 0, 0, 0, 8, 0, 0]
    stats = write_activation(tmp_path / "s.pt", ExpertActivation(counts, {"moe_layers": [1, 2],
                                                                          "source": {"config_sha256": "0" * 64}}))
    res = CliRunner().invoke(cli, ["plan", str(src), "--gpu-experts-ratio", "0.25", "--expert-stats", str(stats),
                                   "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)["placement"]
    per_expert = plan_gpu(src, GpuOptions.make(experts="w4a16", group_size=128))["vram_per_expert_bytes"]
    assert got["budget"] == 4 and got["strategy"] == "frequency"   # int(2 layers * 8 * 0.25)
    assert [(r["layer"], r["gpu_experts"], r["vram_bytes"]) for r in got["layers"]] == \
        [(1, [1, 4], 2 * per_expert), (2, [0, 5], 2 * per_expert)]
    assert got["routed_share"] == pytest.approx((9 + 7 + 5 + 8) / counts.sum())
    assert any("another config.json" in note for note in got["notes"])
    res = CliRunner().invoke(cli, ["plan", str(src), "--gpu-experts", "3", "--json"])
    got = json.loads(res.output)
    assert got["cpu"] is None and got["gpu"] is None
    got = got["placement"]
    assert got["strategy"] == "uniform" and [r["gpu_experts"] for r in got["layers"]] == [[0, 1, 2]] * 2
    res = CliRunner().invoke(cli, ["plan", str(src), "--expert-stats", str(stats)])
    assert res.exit_code == 2


@pytest.mark.parametrize("scheme_args", [["--experts", "W8A16"], ["--gpu", "w8a16"]])
def test_plan_placement_with_the_gpu_plan(tiny_model, tmp_path, scheme_args):
    """`plan --experts S --gpu-experts N` plans the GPU checkpoint and the placement together: the placed experts'
    VRAM is priced with S and the group size of that plan (also with the deprecated `--gpu S`, which warns)."""
    from ktconvert.cli.main import cli
    from ktconvert.gpu.plan import GpuOptions, plan_gpu

    src = tiny_model("deepseek_v3")
    res = CliRunner().invoke(cli, ["plan", str(src), *scheme_args, "--group-size", "64", "--gpu-experts", "2",
                                   "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    per_expert = plan_gpu(src, GpuOptions.make(experts="w8a16", group_size=64))["vram_per_expert_bytes"]
    assert per_expert != plan_gpu(src, GpuOptions.make(experts="w4a16", group_size=128))["vram_per_expert_bytes"]
    assert got["gpu"]["vram_per_expert_bytes"] == per_expert and got["placement"]["gpu_scheme"] == "w8a16"
    assert [r["vram_bytes"] for r in got["placement"]["layers"]] == [2 * per_expert] * 2
    deprecated = [line for line in res.stderr.splitlines() if "deprecated" in line]
    assert deprecated == (["warning: --gpu is deprecated, use --experts"] if scheme_args[0] == "--gpu" else [])
    text = CliRunner().invoke(cli, ["plan", str(src), *scheme_args, "--gpu-experts", "2"])
    assert text.exit_code == 0 and "gpu experts (uniform): --kt-num-gpu-experts 2" in text.stdout


def test_load_refuses_what_sglang_refuses(tmp_path):
    from ktconvert.activation.counts import load_activation
    from ktconvert.errors import InputError

    bad = {"a.pt": {"other": torch.zeros(1, 3, 8)}, "b.pt": torch.zeros(3, 8), "c.pt": torch.zeros(1, 4, 8)}
    for name, data in bad.items():
        torch.save(data, tmp_path / name)
        with pytest.raises(InputError, match=name):
            load_activation(tmp_path / name, 3, 8)
    torch.save(torch.ones(2, 3, 8, dtype=torch.int64), tmp_path / "bare.pt")   # bare tensor, buffer of 2
    assert load_activation(tmp_path / "bare.pt", 3, 8).counts.tolist() == [[2.0] * 8] * 3


# ---------------------------------------------------------------------------------------------- by-product

def _by_product_checks(out, src, calib, samples):
    """OUT/expert_activation.pt: recorded in ktconvert.json (sha256), named in its SGLang flags, loadable by
    SGLang-KT's rules, holding the GPTQ stream's routed-token counts. `src` has one (MoE) layer, whose input no
    quantized layer has touched: its routing is transformers' own bf16 forward's."""
    from ktconvert.formats.fileio import hash_file

    manifest = json.loads((out / "ktconvert.json").read_text())
    path = out / "expert_activation.pt"
    assert manifest["expert_activation"] == "expert_activation.pt"
    assert manifest["files"]["expert_activation.pt"]["sha256"] == hash_file(path)[1]
    assert "--init-expert-location ./expert_activation.pt --kt-expert-placement-strategy frequency" in \
        manifest["sglang_args"]
    config = json.loads((src / "config.json").read_text())
    freq = _sglang_load(path, config).numpy()
    np.testing.assert_array_equal(freq, _transformers_counts(src, samples, torch.bfloat16))
    data = torch.load(path, map_location="cpu", weights_only=True)
    assert data["calibration_sha256"] == hashlib.sha256(open(calib, "rb").read()).hexdigest()
    assert data["tokens"] == sum(len(s) for s in samples) and "GPTQ" in data["routing"]["hidden_states"]
    return manifest


def test_cpu_gptq_conversion_leaves_activation_file(tiny_model, tmp_path):
    from ktconvert.cpu.output import CpuOutput
    from ktconvert.cpu.plan import CpuOptions, plan_cpu
    from ktconvert.gptq.cpu import convert_cpu_gptq
    from ktconvert.gptq.loop import GptqOptions
    from ktconvert.verification.run import verify

    src = tiny_model("qwen3_moe", layers=1, experts=4, hidden=128, intermediate=256)
    samples = _samples((12, 9))
    calib = _calibration(tmp_path, samples)
    out = tmp_path / "out"
    options = CpuOptions.make(method="amxint4", numa=2, quant="gptq", calibration=calib)
    result = convert_cpu_gptq(CpuOutput(out, plan_cpu(src, options)), options=GptqOptions(calibrate_all=False))
    manifest = _by_product_checks(out, src, calib, samples)
    assert manifest["expert_activation"] == "expert_activation.pt"
    assert result.sglang_args.endswith(f"--kt-weight-path {out} --kt-threadpool-count 2 --init-expert-location "
                                       f"{out}/expert_activation.pt --kt-expert-placement-strategy frequency")
    report = verify(str(out), source=str(src), hashes=True, tokens=4, layers=None, experts="all", threshold=None,
                    remote=None, hub="hf", revision=None, endpoint=None)
    assert report["ok"], report["problems"]


def test_gpu_gptq_conversion_leaves_activation_file(tiny_model, tmp_path):
    from ktconvert.gpu.convert import convert_gpu

    src = tiny_model("qwen3_moe", layers=1, experts=4, hidden=128, intermediate=128)
    samples = _samples((12, 9))
    calib = _calibration(tmp_path, samples)
    out = tmp_path / "gpu"
    line = convert_gpu(src, out, experts="w4a16", quant="gptq", linears="bf16", calibration=calib).summary()
    assert f"--init-expert-location {out}/expert_activation.pt --kt-expert-placement-strategy frequency" in line
    manifest = _by_product_checks(out, src, calib, samples)
    assert manifest["sglang_args"].startswith("--model . ")


@pytest.mark.slow
def test_fp8_source_counts_equal_transformers(tiny_model):
    """An FP8-block DeepSeek-V3 source: the counts equal transformers' float32 forward of the dequantized model,
    with every FP8 weight set to DeepSeek's rule (w * scale_inv of its 128 x 128 block, partial edge blocks
    included) rounded to BF16 as ktconvert decodes every source. (transformers' own dequantization splits a
    partial edge into equal blocks instead: 192 rows as 96 + 96, not 128 + 64.)"""
    from safetensors import safe_open
    from transformers import FineGrainedFP8Config

    from ktconvert.activation.stats import collect_activation

    src = tiny_model("deepseek_v3", dtype="fp8")
    samples = _samples()
    model = _transformers_model(src, torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True))
    params = dict(model.named_parameters())
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    with torch.no_grad():
        for name, file in index.items():
            if not name.endswith("_scale_inv") or name[: -len("_scale_inv")] not in params:
                continue
            with safe_open(str(src / file), "pt") as f:
                w, s = f.get_tensor(name[: -len("_scale_inv")]).float(), f.get_tensor(name)
            blocks = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            params[name[: -len("_scale_inv")]].copy_((w * blocks).to(torch.bfloat16).float())
    np.testing.assert_array_equal(collect_activation(src, samples).counts, _count_routes(model, samples))

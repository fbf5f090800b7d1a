"""GPTQ through llmcompressor, one layer at a time (ktconvert/gptq, ktconvert/gpu/gptq.py).

Golden values: plain transformers forwards (router choices, per-layer inputs), compressed-tensors RTN
(``quantize_expert_rtn``, itself byte-equal to model_free_ptq), kt-kernel's per-row formula (quant/amx_rows.py),
llmcompressor's own ``LengthAwareSampler`` (sample order), and in the slow tests llmcompressor ``oneshot`` itself,
run with ``shuffle_calibration_samples=False`` (its default shuffles with torch's global generator, an order
nothing else reproduces; the order sets the float32 summation order of every Hessian) at one torch thread without
oneDNN (``gptq.determinism.deterministic_cpu``, what ours runs under; the process's ATen capability and MKL path
are the same for both).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")


def _samples(n: int, length: int, seed: int = 0, vocab: int = 512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def small_qwen(tiny_model):
    return tiny_model("qwen3_moe", layers=1, experts=4, hidden=128, intermediate=128)


# ---------------------------------------------------------------------------------------------- calibration

def test_calibration_jsonl(tmp_path, small_qwen):
    from ktconvert.gptq.calibration import load_samples

    f = tmp_path / "calib.jsonl"
    f.write_text(json.dumps({"input_ids": [5, 6, 7, 8]}) + "\n\n" + json.dumps({"text": "a b c"}) + "\n")
    samples = load_samples(f, small_qwen, max_length=3)
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(small_qwen))("a b c")["input_ids"][:3]
    assert [s.tolist() for s in samples] == [[5, 6, 7], want]


@pytest.mark.parametrize("text, message", [("{nope", "not valid JSON"), ('{"x": 1}', "neither 'text'"),
                                           ('{"input_ids": []}', "non-empty list"),
                                           ('{"input_ids": [1, 99999]}', "outside the vocabulary")])
def test_calibration_errors(tmp_path, small_qwen, text, message):
    from ktconvert.errors import InputError
    from ktconvert.gptq.calibration import load_samples

    f = tmp_path / "bad.jsonl"
    f.write_text(text + "\n")
    with pytest.raises(InputError, match=message) as info:
        load_samples(f, small_qwen, vocab_size=512)
    assert "bad.jsonl" in str(info.value)


# ---------------------------------------------------------------------------------------------- GPU (fast)

def _hf_router_counts(src, samples, n_experts):
    """Routed token counts per expert from transformers' own model (independent of LayerStream; with the kernels
    LayerStream computes with, gptq.determinism.deterministic_cpu)."""
    from transformers import AutoModelForCausalLM

    from ktconvert.gptq.determinism import deterministic_cpu

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16, attn_implementation="eager")
    counts = np.zeros(n_experts, int)

    def hook(module, args, output):
        idx = output[2] if isinstance(output, tuple) else output
        counts[:] += np.bincount(idx.reshape(-1).numpy(), minlength=n_experts)

    model.model.layers[0].mlp.gate.register_forward_hook(hook)
    with torch.no_grad(), deterministic_cpu("cpu"):
        for s in samples:
            model(input_ids=s[None], use_cache=False)
    return counts


def test_gpu_routed_counts_and_unrouted_rtn(small_qwen):
    """Routed-only calibration: token counts match transformers' router; experts no token reaches are RTN
    (byte-equal to compressed-tensors RTN of the source), the others are GPTQ (differ from RTN)."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gpu.experts import quantize_expert_rtn
    from ktconvert.gptq.loop import GpuQuantizer, GptqOptions, LayerStream

    samples = _samples(1, 2)             # 2 tokens x top-2: at most 4 routed (token, expert) pairs
    src = HFSource.open(small_qwen)
    stream = LayerStream(src, samples, GpuQuantizer(4, 128), GptqOptions(calibrate_all=False))
    (result,) = list(stream.layers_results())
    assert result.tokens == _hf_router_counts(small_qwen, samples, 4).tolist()
    assert result.fallback == [e for e in range(4) if result.tokens[e] == 0] and result.fallback
    for e in range(4):
        ew = src.read_expert(0, e)
        for proj in ("gate", "up", "down"):
            rtn = quantize_expert_rtn(getattr(ew, proj), 4, 128)
            got = result.payloads[(e, proj)]
            same = all(np.array_equal(got[k], rtn[k]) for k in rtn)
            assert same == (e in result.fallback), (e, proj)


def test_gpu_hook_emits_every_matrix(small_qwen):
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gpu.gptq import quantize_layer_gptq

    got = {}
    state = quantize_layer_gptq(HFSource.open(small_qwen), 0, None, bits=8, group_size=128,
                                emit=lambda e, p, t: got.setdefault((e, p), t), calibration=_samples(2, 8))
    assert sorted(got) == [(e, p) for e in range(4) for p in ("down", "gate", "up")]
    assert got[(0, "gate")]["weight_packed"].shape == (128, 32) and state.tokens[0] and state.fallback[0] == []


def test_gpu_hook_needs_calibration(small_qwen):
    from ktconvert.errors import InputError
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gpu.gptq import quantize_layer_gptq

    with pytest.raises(InputError, match="calibration"):
        quantize_layer_gptq(HFSource.open(small_qwen), 0, None, bits=4, group_size=128, emit=print)


# ---------------------------------------------------------------------------------------------- AMX (fast)

def test_amx_output_verifies(tmp_path, tiny_model):
    """convert_cpu_gptq writes a kt output that `ktconvert verify OUT --source SRC` accepts."""
    small_qwen = tiny_model("qwen3_moe", layers=1, experts=4, hidden=128, intermediate=256)
    from ktconvert.cpu.output import CpuOutput
    from ktconvert.cpu.plan import CpuOptions, plan_cpu
    from ktconvert.formats.out_manifest import load_manifest
    from ktconvert.gptq.cpu import convert_cpu_gptq
    from ktconvert.gptq.loop import GptqOptions
    from ktconvert.verification.run import verify

    calib = tmp_path / "c.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in _samples(2, 16)))
    out = tmp_path / "out"
    options = CpuOptions.make(method="amxint4", numa=2, quant="gptq", calibration=calib)
    result = convert_cpu_gptq(CpuOutput(out, plan_cpu(small_qwen, options)), options=GptqOptions(calibrate_all=False))
    assert load_manifest(out)["quant"] == "gptq" and result.details["fallback_quant"] in ("mse", "rtn")
    report = verify(str(out), source=str(small_qwen), hashes=True, tokens=4, layers=None, experts="all",
                    threshold=None, remote=None, hub="hf", revision=None, endpoint=None)
    assert report["ok"], report["problems"]


# ---------------------------------------------------------------------------------------------- sample order

def test_samples_in_oneshot_order():
    """oneshot(shuffle_calibration_samples=False) visits samples in LengthAwareSampler order (longest first)."""
    from datasets import Dataset
    from llmcompressor.datasets.utils import LengthAwareSampler

    from ktconvert.gptq.calibration import oneshot_order

    samples = [torch.full((n,), i) for i, n in enumerate([5, 9, 7, 9, 3, 9, 7, 1, 9])]
    sampler = LengthAwareSampler(Dataset.from_dict({"input_ids": [s.tolist() for s in samples]}))
    assert [int(s[0]) for s in oneshot_order(samples)] == list(sampler)


def test_codes_independent_of_thread_count(tiny_model):
    """Same samples, 1 and 3 torch threads: identical GPTQ bytes (the CPU solve runs at one thread; with hidden
    256 MKL's Cholesky gives different bytes at 1 and 3 threads)."""
    from ktconvert.gptq.loop import GpuQuantizer, GptqOptions, LayerStream

    src = tiny_model("qwen3_moe", layers=1)
    samples, threads, runs = _samples(3, 24), torch.get_num_threads(), []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            (res,) = LayerStream(src, samples, GpuQuantizer(4, 128), GptqOptions()).layers_results()
            runs.append({k: b"".join(v[t].tobytes() for t in sorted(v)) for k, v in res.payloads.items()})
    finally:
        torch.set_num_threads(threads)
    assert runs[0] == runs[1]


def test_stream_forward_independent_of_thread_count(tiny_model):
    """The float layer stream's hidden states after two layers, at 1 and 3 torch threads: identical. The stream
    runs its forwards at one torch thread on CPU; without that, oneDNN's BF16 matmul makes 198 of these
    2 x 200 x 512 values differ between 1 and 3 threads (measured on AVX-512, torch 2.13), and routing, Hessians
    and GPTQ codes would follow the host's core count."""
    from ktconvert.gptq.stream import DecoderStream

    src = tiny_model("qwen3_moe", layers=2, experts=4, hidden=512, intermediate=256)
    samples = [torch.tensor([(7 * j + i) % 40 + 3 for j in range(200)]) for i in range(2)]
    threads, runs = torch.get_num_threads(), []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            stream = DecoderStream(src, samples)
            list(stream.run_all())
            runs.append(torch.cat([h.reshape(-1) for h in stream.hidden]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1])


# ---------------------------------------------------------------------------------------------- oneshot (slow)

IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*mlp\.gate$", r"re:.*shared_expert.*",
          r"re:.*mlp\.(gate|up|down)_proj$"]
LENGTHS = [48, 32, 40, 48, 24]     # unequal lengths: oneshot sorts them, longest first


def _varied_samples(lengths=LENGTHS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g) for n in lengths]


def _causal_mask_hooks(model):
    """Give every attention call of oneshot's Qwen3-MoE the eager causal mask it drops (gptq-streaming.md §1.4):
    0 on and below the diagonal, bf16 min above — oneshot with the fix ktconvert applies."""
    def hook(module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            n = kwargs["hidden_states"].shape[1]
            mask = torch.full((n, n), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1)
            kwargs["attention_mask"] = mask[None, None]
        return args, kwargs

    return [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]


def _recipe(bits: int, observer: str | None):
    """GPTQModifier W{bits}A16 (group 128); observer: the weight observer (None: the preset's min-max)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier

    if observer is None:
        return GPTQModifier(targets="Linear", scheme=f"W{bits}A16", ignore=IGNORE, dampening_frac=0.1)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=128,
                            observer=observer)
    return GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                        ignore=IGNORE, dampening_frac=0.1)


def _oneshot(src, samples, bits, calibrate_all, out, causal_fix=False, observer=None):
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from ktconvert.formats.safetensors_reader import Checkpoint
    from ktconvert.gptq.determinism import deterministic_cpu, pin_process

    pin_process()       # as ours does: the process's CPU kernels pinned where it still can (gptq.determinism)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    hooks = _causal_mask_hooks(model) if causal_fix else []
    ds = Dataset.from_dict({"input_ids": [s.tolist() for s in samples],
                            "attention_mask": [[1] * len(s) for s in samples]})
    try:                # ours runs at one thread without oneDNN (MKL's Cholesky, oneDNN's BF16 matmul: host-dependent)
        with deterministic_cpu("cpu"):
            oneshot(model=model, dataset=ds, num_calibration_samples=len(samples),
                    max_seq_length=max(map(len, samples)), recipe=_recipe(bits, observer),
                    moe_calibrate_all_experts=calibrate_all, shuffle_calibration_samples=False)
    finally:
        for h in hooks:
            h.remove()
    model.save_pretrained(out, save_compressed=True)
    ck = Checkpoint.open(out)
    return {k: ck.read(k) for k in ck.tensors if ".experts." in k}


def _ours(src, samples, bits, observer=None, **opts):
    from ktconvert.gptq.loop import GpuQuantizer, GptqOptions, LayerStream

    got, results = {}, []
    quantizer = GpuQuantizer(bits, 128, observer=observer)
    for res in LayerStream(src, samples, quantizer, GptqOptions(**opts)).layers_results():
        results.append(res)
        for (e, p), tensors in res.payloads.items():
            for k, v in tensors.items():
                got[f"model.layers.{res.layer}.mlp.experts.{e}.{p}_proj.{k}"] = v
    return got, results


def _differing(ref, ours):
    """Names of the tensors whose bytes differ (both sides must hold the same names)."""
    assert sorted(ref) == sorted(ours)
    return sorted(k for k in ref if not np.array_equal(ref[k].view(ours[k].dtype), ours[k]))


def _expert_of(key: str):
    parts = key.split(".")
    return int(parts[2]), int(parts[5])


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("arch, causal_mask", [("qwen3_moe", False), ("deepseek_v3", True)])
def test_bit_identical_to_oneshot(tmp_path, tiny_model, arch, causal_mask, bits):
    """Every expert tensor byte-identical to oneshot: Qwen3-MoE with oneshot's mask=None reproduced, DeepSeek-V3
    with the causal mask (its attention gets the mask in oneshot too)."""
    src = tiny_model(arch)
    samples = _varied_samples()
    ref = _oneshot(src, samples, bits, True, tmp_path / "os")
    ours, _ = _ours(src, samples, bits, causal_mask=causal_mask)
    assert _differing(ref, ours) == []


@pytest.mark.slow
@pytest.mark.parametrize("arch, causal_mask", [("qwen3_moe", False), ("deepseek_v3", True)])
def test_mse_observer_bit_identical_to_oneshot(tmp_path, tiny_model, arch, causal_mask):
    """`gpu --quant gptq`'s scales (llmcompressor's MSE weight observer, gpu.config.GPTQ_OBSERVER): every expert
    tensor byte-identical to oneshot run with a GPTQModifier whose weights use observer "mse"; and the searched
    scales do change bytes against the min-max observer."""
    from ktconvert.gpu.config import GPTQ_OBSERVER

    src = tiny_model(arch)
    samples = _varied_samples()
    ref = _oneshot(src, samples, 4, True, tmp_path / "os", observer=GPTQ_OBSERVER)
    ours, _ = _ours(src, samples, 4, observer=GPTQ_OBSERVER, causal_mask=causal_mask)
    assert _differing(ref, ours) == []
    assert _differing(_ours(src, samples, 4, causal_mask=causal_mask)[0], ours)


@pytest.mark.slow
def test_causal_mask_is_the_only_difference_qwen3(tmp_path, tiny_model):
    """Our default (the real causal mask) differs from plain oneshot, and equals, byte for byte, oneshot given the
    causal mask it drops."""
    src = tiny_model("qwen3_moe")
    samples = _varied_samples()
    ours, _ = _ours(src, samples, 4)
    assert _differing(_oneshot(src, samples, 4, True, tmp_path / "os"), ours)
    assert _differing(_oneshot(src, samples, 4, True, tmp_path / "fixed", causal_fix=True), ours) == []


@pytest.mark.slow
def test_unrouted_experts_are_the_only_difference(tmp_path, tiny_model):
    """Routed-only calibration: every routed expert byte-identical to oneshot; experts no token reaches are
    all-zero weights in oneshot (every int4 code 0, packed 0x88888888) and compressed-tensors RTN of the source
    in ours."""
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.gpu.experts import quantize_expert_rtn

    src = tiny_model("qwen3_moe", experts=16)
    samples = _varied_samples([6, 4])
    ref = _oneshot(src, samples, 4, False, tmp_path / "os")
    ours, results = _ours(src, samples, 4, causal_mask=False, calibrate_all=False)
    fallback = {(r.layer, e) for r in results for e in r.fallback}
    assert fallback == {(r.layer, e) for r in results for e, n in enumerate(r.tokens) if n == 0} and fallback
    differing = _differing(ref, ours)
    assert {_expert_of(k) for k in differing} == fallback
    source = HFSource.open(src)
    for key in ref:
        layer, e = _expert_of(key)
        if (layer, e) not in fallback:
            continue
        proj, kind = key.split(".")[6][: -len("_proj")], key.split(".")[7]
        if kind == "weight_packed":
            assert np.all(ref[key] == np.int32(-0x77777778))
        rtn = quantize_expert_rtn(getattr(source.read_expert(layer, e), proj), 4, 128)
        np.testing.assert_array_equal(ours[key], rtn[kind])



@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,linears", [("glm4_moe", "bf16", "fp8"), ("minimax_m2", "bf16", "bf16"),
                                                ("kimi_k2", "bf16", "fp8"), ("mixtral", "bf16", "bf16"),
                                                ("deepseek_v3", "fp8", "fp8")])
def test_gptq_gpu_checkpoint_of_every_family_verifies(tiny_model, tmp_path, arch, dtype, linears):
    """`ktconvert gpu --quant gptq` on families whose on-disk names differ from transformers' in-memory ones
    (MiniMax / Mixtral `block_sparse_moe.`), whose model_type transformers only knows under another name
    (Kimi-K2 = DeepSeek-V3), and on an FP8 source; the checkpoint passes `verify --source`."""
    import json

    from ktconvert.api import convert_gpu
    from ktconvert.verification.run import verify

    model = tiny_model(arch, dtype=dtype)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": list(range(3 + i, 40 + 3 * i))}) + "\n" for i in range(4)))
    out = tmp_path / "gpu"
    convert_gpu(model, out, experts="w4a16", quant="gptq", linears=linears, calibration=calib)
    result = verify(out, source=str(model), experts="all")
    assert result["ok"], result["problems"]
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (weights["weights"]["observer"], weights["weights"]["actorder"]) == ("mse", "static")

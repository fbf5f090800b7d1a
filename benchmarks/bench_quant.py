"""Quantization throughput: native implementations vs the numpy reference, in one run.

``amx_quantize``: AMXINT4/AMXINT8 quantize + tile packing (CPU side). ``ct_rtn``: compressed-tensors W4A16 / W8A16
group-128 RTN of the GPU side's experts (ktconvert.gpu.experts.quantize_expert_rtn), with compressed-tensors' own
torch code (calculate_qparams + PackedQuantizationCompressor.compress) as impl "compressed-tensors" when --with-ct.
Prints one JSON line per (bench, bits, impl, shape, threads) with the GB/s of BF16 input consumed (2 bytes per
weight), best of --repeat runs, and whether the bytes equal the reference's. impl "numpy" is single-threaded.

    python benchmarks/bench_quant.py                # DeepSeek-V3 NUMA-part shapes, threads 1 and 2
    python benchmarks/bench_quant.py --quick        # small shapes, three repeats (while developing)
    python benchmarks/bench_quant.py --with-ct      # also time compressed-tensors' RTN (imports torch)
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from ktconvert import native

FULL_SHAPES = [(1024, 7168), (7168, 1024)]   # DeepSeek-V3 gate/up and down parts with 2 NUMA nodes
QUICK_SHAPES = [(256, 2048)]


def bf16_weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint16 [n, k] BF16 bits of a heavy-tailed matrix (truncated to BF16: fine for timing)."""
    w = np.random.default_rng(seed).standard_t(4, size=(n, k)).astype(np.float32) * np.float32(0.02)
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def numpy_reference(bits: int):
    """The numpy path as a callable w -> (blob, scale), or None when the modules are missing."""
    try:
        from ktconvert.layouts import tiles
        from ktconvert.quant import amx_rows as amx
    except ImportError:
        return None
    quant, pack = (amx.quantize_int4_rows, tiles.pack_int4) if bits == 4 else (amx.quantize_int8_rows,
                                                                              tiles.pack_int8)

    def run(w):
        codes, d = quant(w)
        return pack(codes), d
    return run


def supported_impls() -> list[str]:
    handle = native.lib()
    if handle is None:
        return []
    return [name for name in ("scalar", "avx2", "avx512") if handle.kt_impl_missing(native.IMPL_IDS[name]) == 0]


def emit(bits: int, impl: str, shape, threads: int, seconds: float, bench: str = "amx_quantize", **extra) -> None:
    n, k = shape
    record = {"bench": bench, "bits": bits, "impl": impl, "n": n, "k": k, "threads": threads,
              "seconds": round(seconds, 6), "gb_per_s_bf16": round(2 * n * k / seconds / 1e9, 3), **extra}
    print(json.dumps(record), flush=True)


def ct_reference(w: np.ndarray, bits: int, group: int) -> dict:
    """compressed-tensors' own RTN (torch), as llmcompressor's model_free_ptq runs it."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    weight = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    grouped = weight.unflatten(-1, (-1, group))
    scale, zp = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
    with torch.no_grad():
        out = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.to(torch.bfloat16),
                                                     "weight_zero_point": zp.to(torch.int8)}, scheme)
    return {"weight_packed": out["weight_packed"].numpy(), "weight_scale": out["weight_scale"].view(torch.int16)
            .numpy().view(np.uint16)}


def bench_ct_rtn(shapes, repeat: int, thread_counts, with_ct: bool) -> None:
    """The GPU side's expert RTN, group 128: numpy, every native impl, optionally compressed-tensors itself."""
    from ktconvert.gpu.experts import quantize_expert_rtn

    for bits in (4, 8):
        for shape in shapes:
            w = bf16_weights(*shape)
            want = quantize_expert_rtn(w, bits, 128, impl="numpy")
            runs = {("numpy", 1): lambda: quantize_expert_rtn(w, bits, 128, impl="numpy")}
            if with_ct:
                runs["compressed-tensors", 1] = lambda: ct_reference(w, bits, 128)
            for impl in supported_impls():
                for threads in thread_counts:
                    runs[impl, threads] = (lambda impl=impl, threads=threads:
                                           quantize_expert_rtn(w, bits, 128, impl=impl, threads=threads))
            for (impl, threads), fn in runs.items():
                got = fn()
                same = all(np.array_equal(got[key], want[key]) for key in ("weight_packed", "weight_scale"))
                emit(bits, impl, shape, threads, best_seconds(fn, repeat if impl not in ("numpy",
                     "compressed-tensors") else max(1, repeat // 2)), bench="ct_rtn", group_size=128,
                     equal_to_numpy=same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, three repeats")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--with-ct", action="store_true", help="also time compressed-tensors' RTN (imports torch)")
    args = parser.parse_args()
    shapes, repeat = (QUICK_SHAPES, 3) if args.quick else (FULL_SHAPES, args.repeat)
    print(json.dumps({"bench": "env", "machine": platform.machine(), "native": native.available(),
                      "default_impl": native.implementation(), "cpu_features": native.cpu_features()}), flush=True)
    for bits in (4, 8):
        reference = numpy_reference(bits)
        for shape in shapes:
            w = bf16_weights(*shape)
            want = reference(w) if reference else None
            if reference:
                emit(bits, "numpy", shape, 1, best_seconds(lambda: reference(w), max(1, repeat // 2)))
            for impl in supported_impls():
                for threads in args.threads:
                    blob, scale = native.amx_quantize(w, bits, threads=threads, impl=impl)
                    same = None if want is None else bool(np.array_equal(blob, want[0])
                                                          and np.array_equal(scale, want[1]))
                    seconds = best_seconds(lambda: native.amx_quantize(w, bits, threads=threads, impl=impl), repeat)
                    emit(bits, impl, shape, threads, seconds, equal_to_numpy=same)
    bench_ct_rtn(shapes, repeat, args.threads, args.with_ct)


if __name__ == "__main__":
    main()

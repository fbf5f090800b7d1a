"""Dequantization throughput per quantized input format, one JSON line each.

    python benchmarks/bench_dequant.py [--shape 2048x7168] [--repeat 3]

MB/s counts the packed input bytes of one expert matrix (codes + scales); the decode goes to BF16 bits on one
thread. Each case is timed through ktconvert's numpy path (quant/fp8.py, quant/ct_int4.py, quant/mxfp4.py with
impl="numpy") and through each native implementation this machine runs (scalar / avx2 / avx512, native/quant_decode.c),
after checking that every native result equals the numpy bits. One JSON line per case: numpy and native side by side.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ktconvert.native import decode
from ktconvert.quant import ct_int4, fp8, mxfp4
from ktconvert.quant.bf16 import f32_to_bf16_bits


def _cases(n: int, k: int, rng: np.random.Generator):
    """(name, input bytes, fn(impl) -> BF16 bits) per format."""
    codes = rng.integers(0, 0x7E, (n, k), dtype=np.uint8)
    nb, kb = fp8.block_scale_shape(n, k, (128, 128))
    s32 = rng.random((nb, kb), dtype=np.float32) * 1e-3
    yield "fp8-block (weight_scale_inv F32)", codes.nbytes + s32.nbytes, \
        lambda impl: fp8.dequant_block(codes, s32, (128, 128), impl=impl)
    s16 = f32_to_bf16_bits(s32)
    yield "ct-fp8 block (weight_scale BF16)", codes.nbytes + s16.nbytes, \
        lambda impl: fp8.dequant_block(codes, (s16.astype(np.uint32) << 16).view(np.float32), (128, 128), impl=impl)
    h16 = s32.astype(np.float16)
    yield "ct-fp8 block (weight_scale F16, f16 product)", codes.nbytes + h16.nbytes, \
        lambda impl: fp8.dequant_block(codes, h16.astype(np.float32), (128, 128), product_dtype=np.float16, impl=impl)
    packed = rng.integers(-2**31, 2**31 - 1, (n, k // 8), dtype=np.int64).astype(np.int32)
    sc = f32_to_bf16_bits(rng.random((n, k // 32), dtype=np.float32) * 1e-3)
    yield "ct-int4 group 32 (BF16 scales)", packed.nbytes + sc.nbytes, \
        lambda impl: ct_int4.dequant_packed(packed, k, 4, (sc.astype(np.uint32) << 16).view(np.float32), 32,
                                            impl=impl)
    sc128 = rng.random((n, k // 128), dtype=np.float32) * 1e-3
    zp = rng.integers(-8, 8, (n, k // 128), dtype=np.int8)
    yield "ct-int4 group 128 + zero point (F32 scales)", packed.nbytes + sc128.nbytes + zp.nbytes, \
        lambda impl: ct_int4.dequant_packed(packed, k, 4, sc128, 128, zp, impl=impl)
    blocks = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    e8 = rng.integers(110, 130, (n, k // 32), dtype=np.uint8)
    yield "mxfp4 (gpt-oss blocks)", blocks.nbytes + e8.nbytes, lambda impl: mxfp4.dequant(blocks, e8, impl=impl)


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x7168")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, k = map(int, args.shape.split("x"))
    rng = np.random.default_rng(0)
    impls = decode.usable_impls()
    for name, nbytes, fn in _cases(n, k, rng):
        want = fn("numpy")
        row = {"format": name, "shape": [n, k], "input_bytes": nbytes, "threads": 1}
        timings = {"numpy": _best(lambda: fn("numpy"), args.repeat)}
        for impl in impls:
            if not np.array_equal(fn(impl), want):
                raise SystemExit(f"{name}: native {impl} differs from numpy")
            timings[impl] = _best(lambda: fn(impl), args.repeat)
        for impl, seconds in timings.items():
            row[f"{impl}_s"] = round(seconds, 4)
            row[f"{impl}_input_MB_s"] = round(nbytes / seconds / 1e6, 1)
        if impls:
            row["bit_identical"] = True
            row["speedup_best_native"] = round(timings["numpy"] / min(timings[i] for i in impls), 1)
        print(json.dumps(row))

if __name__ == "__main__":
    main()

"""Dequantization throughput per quantized input format, one JSON line each.

    python benchmarks/bench_dequant.py [--shape 2048x7168] [--repeat 3]

MB/s counts the packed input bytes of one expert matrix (codes + scales); the decode is ktconvert's numpy path
(quant/fp8.py, quant/ct_int4.py, quant/mxfp4.py) to BF16 bits, single thread.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ktconvert.quant import ct_int4, fp8, mxfp4
from ktconvert.quant.bf16 import f32_to_bf16_bits


def _cases(n: int, k: int, rng: np.random.Generator):
    codes = rng.integers(0, 0x7E, (n, k), dtype=np.uint8)
    nb, kb = fp8.block_scale_shape(n, k, (128, 128))
    s32 = rng.random((nb, kb), dtype=np.float32) * 1e-3
    yield "fp8-block (weight_scale_inv F32)", codes.nbytes + s32.nbytes, \
        lambda: fp8.dequant_block(codes, s32, (128, 128))
    s16 = f32_to_bf16_bits(s32)
    yield "ct-fp8 block (weight_scale BF16)", codes.nbytes + s16.nbytes, \
        lambda: fp8.dequant_block(codes, (s16.astype(np.uint32) << 16).view(np.float32), (128, 128))
    packed = rng.integers(-2**31, 2**31 - 1, (n, k // 8), dtype=np.int64).astype(np.int32)
    sc = f32_to_bf16_bits(rng.random((n, k // 32), dtype=np.float32) * 1e-3)
    yield "ct-int4 group 32 (BF16 scales)", packed.nbytes + sc.nbytes, \
        lambda: ct_int4.dequant(ct_int4.unpack_int32(packed, k), (sc.astype(np.uint32) << 16).view(np.float32), 32)
    blocks = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    e8 = rng.integers(110, 130, (n, k // 32), dtype=np.uint8)
    yield "mxfp4 (gpt-oss blocks)", blocks.nbytes + e8.nbytes, lambda: mxfp4.dequant(blocks, e8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x7168")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, k = map(int, args.shape.split("x"))
    rng = np.random.default_rng(0)
    for name, nbytes, fn in _cases(n, k, rng):
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        print(json.dumps({"format": name, "shape": [n, k], "input_bytes": nbytes, "seconds": round(best, 4),
                          "input_MB_s": round(nbytes / best / 1e6, 1), "output_MB_s": round(n * k * 2 / best / 1e6, 1)}))


if __name__ == "__main__":
    main()

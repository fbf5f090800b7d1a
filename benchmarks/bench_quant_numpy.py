"""Stage timings of the numpy AMX path: quantize rows, build the tile permutation (first call per shape, cached),
pack, unpack, and the whole AmxMethod.quantize. One JSON line per (method, shape, stage): best of --repeat, with
the rate in millions of weights per second and the process's peak RSS.

    python benchmarks/bench_quant_numpy.py            # DeepSeek-V3 NUMA-part shapes (T=2)
    python benchmarks/bench_quant_numpy.py --quick    # a small shape
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import numpy as np

os.environ["KTCONVERT_FORCE_IMPL"] = "numpy"

from ktconvert.layouts import tiles  # noqa: E402
from ktconvert.quant import amx_rows as amx  # noqa: E402
from ktconvert.methods.amx import AmxInt4, AmxInt8  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def stages(method, w: np.ndarray):
    n, k = w.shape
    quant_rows = amx.quantize_int4_rows if method is AmxInt4 else amx.quantize_int8_rows
    permutation = tiles.int4_permutation if method is AmxInt4 else tiles.int8_permutation
    pack = tiles.pack_int4 if method is AmxInt4 else tiles.pack_int8
    unpack = tiles.unpack_int4 if method is AmxInt4 else tiles.unpack_int8
    codes, _ = quant_rows(w)
    blob = pack(codes)
    yield "permutation_build", lambda: (tiles._permutation.cache_clear(), permutation(n, k))
    yield "quantize_rows", lambda: quant_rows(w)
    yield "pack", lambda: pack(codes)
    yield "unpack", lambda: unpack(blob, n, k)
    yield "method_quantize", lambda: method.quantize(w)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    shapes = [(256, 3712)] if args.quick else [(1024, 7168), (7168, 1024)]
    rng = np.random.default_rng(0)
    for n, k in shapes:
        w = (rng.standard_t(4, (n, k)).astype(np.float32) * np.float32(0.02)).view(np.uint32) >> 16
        w = w.astype(np.uint16)
        for method in (AmxInt4, AmxInt8):
            for stage, fn in stages(method, w):
                seconds = best(fn, args.repeat)
                print(json.dumps({"method": method.name, "shape": [n, k], "stage": stage, "seconds": round(seconds, 4),
                                  "mweights_per_s": round(n * k / seconds / 1e6, 1),
                                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))


if __name__ == "__main__":
    main()

"""GEMV throughput of the verification runtime's AMXINT4 / AMXINT8 kernels on large experts, next to the machine's
plain memory read bandwidth, in one run. Prints one JSON line per (method, shape, kernel, threads) plus the
bandwidth lines.

    python benchmarks/bench_gemv.py [--threads 1,2] [--impl all|scalar,avx2,avx512] [--mb 512]

GB/s counts weight bytes (n*k/2 INT4, n*k INT8) per second, one token. Several copies of the blob (--mb in total)
are cycled so the weights come from memory, not cache. Bandwidth: numpy add.reduce over a uint64 array of the
same total size, split over the same thread counts (numpy releases the GIL). Blob contents are random bytes (the
kernels' speed does not depend on the values).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ktconvert.native import forward as rt  # noqa: E402

SHAPES = ((7168, 2048), (2048, 7168))  # [n, k]: a DeepSeek-V3 down / gate projection


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(total_bytes: int, threads: int, repeats: int) -> float:
    """GB/s of a plain parallel read (sum) of total_bytes."""
    data = np.ones(total_bytes // 8, np.uint64)
    chunks = np.array_split(data, threads)

    def run():
        workers = [threading.Thread(target=np.add.reduce, args=(c,)) for c in chunks[1:]]
        for w in workers:
            w.start()
        np.add.reduce(chunks[0])
        for w in workers:
            w.join()

    return total_bytes / best_time(run, repeats) / 1e9


def gemv_bandwidth(method: str, n: int, k: int, impl: str, threads: int, total_mb: int, repeats: int) -> float:
    nbytes = rt.weight_nbytes(method, n, k)
    copies = max(1, total_mb * 2**20 // nbytes)
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(copies)]
    scale = np.full(n, 0.01, np.float32)
    x = rng.standard_normal(k).astype(np.float32)

    def run():
        for blob in blobs:
            rt.gemm(method, blob, scale, n, k, x, impl=impl, threads=threads)

    rt.gemm(method, blobs[0], scale, n, k, x, impl=impl, threads=threads)  # warm up (threads, page faults)
    return nbytes * copies / best_time(run, repeats) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--impl", default="all")
    ap.add_argument("--mb", type=int, default=512, help="total weight bytes cycled per measurement (MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    impls = ["scalar", "avx2", "avx512"] if args.impl == "all" else args.impl.split(",")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown")
    for t in threads:
        print(json.dumps({"bench": "read", "threads": t, "gb_s": round(read_bandwidth(args.mb * 2**20, t,
                                                                                       args.repeats), 2),
                          "cpu": cpu, "cores": os.cpu_count()}), flush=True)
    for method in ("AMXINT4", "AMXINT8"):
        for n, k in SHAPES:
            for impl in impls:
                try:
                    kernel = rt.variant(impl)
                except Exception as exc:  # impl unsupported here
                    print(json.dumps({"bench": "gemv", "method": method, "impl": impl, "skipped": str(exc)}))
                    continue
                for t in threads:
                    mb = args.mb if impl != "scalar" else min(args.mb, 64)
                    gbs = gemv_bandwidth(method, n, k, impl, t, mb, args.repeats if impl != "scalar" else 1)
                    print(json.dumps({"bench": "gemv", "method": method, "shape": [n, k], "impl": impl,
                                      "kernel": kernel, "threads": t, "gb_s": round(gbs, 2)}), flush=True)


if __name__ == "__main__":
    main()

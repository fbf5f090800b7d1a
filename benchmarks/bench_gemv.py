"""GEMV throughput of the verification runtime's AMXINT4 / AMXINT8 kernels on large experts, next to the machine's
plain memory read bandwidth, in one run. Prints one JSON line per (method, shape, kernel, threads).

    python benchmarks/bench_gemv.py [--threads 1,2] [--impl all|scalar,avx2,avx512] [--mb 512] [--rounds 5]
                                    [--baseline-lib OTHER_BUILD.so]

GB/s counts weight bytes (n*k/2 INT4, n*k INT8) per second, one token. Several copies of the blob (--mb in total)
are cycled so the weights come from memory, not cache. Read bandwidth: numpy add.reduce over a uint64 array of the
same total size, split over the same thread counts (numpy releases the GIL). Every round measures the read, then
each kernel, so a machine shared with other work loads all of them alike; the best of the rounds is printed, with
``pct_of_read`` = kernel / read of the same thread count. --baseline-lib times kt_rt_gemm of another build of the
native library (e.g. main's) in the same rounds, as ``impl`` "baseline". Blob contents are random bytes (the
kernels' speed does not depend on the values).
"""
from __future__ import annotations

import argparse
import ctypes
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


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_runner(data: np.ndarray, threads: int):
    """A function reading (summing) all of `data` with `threads` threads."""
    chunks = np.array_split(data, threads)

    def run():
        workers = [threading.Thread(target=np.add.reduce, args=(c,)) for c in chunks[1:]]
        for w in workers:
            w.start()
        np.add.reduce(chunks[0])
        for w in workers:
            w.join()

    return run


def gemv_runner(method: str, blobs, scale, n: int, k: int, x, impl: str, threads: int):
    """A function running the GEMV once over every blob (impl "baseline": the --baseline-lib build)."""
    if impl == "baseline":
        fn = _baseline["lib"].kt_rt_gemm
        wtype = rt.WTYPES[method]
        y = np.empty(n, np.float32)

        def run():
            for blob in blobs:
                fn(wtype, blob.ctypes.data, scale.ctypes.data, n, k, x.ctypes.data, 1, y.ctypes.data, 0, threads)
        return run

    def run():
        for blob in blobs:
            rt.gemm(method, blob, scale, n, k, x, impl=impl, threads=threads)
    return run


_baseline: dict = {}


def load_baseline(path: str) -> None:
    lib = ctypes.CDLL(path)
    lib.kt_rt_gemm.restype = ctypes.c_int
    lib.kt_rt_gemm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    _baseline["lib"] = lib


def measure(method: str, n: int, k: int, impls: list[str], threads: int, total_mb: int, rounds: int, cpu: str):
    nbytes = rt.weight_nbytes(method, n, k)
    copies = max(1, total_mb * 2**20 // nbytes)
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(copies)]
    scale = np.full(n, 0.01, np.float32)
    x = rng.standard_normal(k).astype(np.float32)
    runners = {"read": read_runner(np.ones(nbytes * copies // 8, np.uint64), threads)}
    kernels = {}
    for impl in impls:
        try:
            kernels[impl] = "baseline" if impl == "baseline" else rt.variant(impl)
        except Exception as exc:  # impl unsupported here
            print(json.dumps({"bench": "gemv", "method": method, "impl": impl, "skipped": str(exc)}))
            continue
        runners[impl] = gemv_runner(method, blobs if impl != "scalar" else blobs[:max(1, copies // 8)], scale, n,
                                    k, x, impl, threads)
    for fn in runners.values():
        fn()  # warm up: threads, page faults
    best = {name: min(timed(fn) for _ in range(1)) for name, fn in runners.items()}
    for _ in range(rounds - 1):
        for name, fn in runners.items():
            best[name] = min(best[name], timed(fn))
    read = nbytes * copies / best["read"] / 1e9
    print(json.dumps({"bench": "read", "method": method, "shape": [n, k], "threads": threads, "gb_s": round(read, 2),
                      "cpu": cpu, "cores": os.cpu_count()}), flush=True)
    for impl, kernel in kernels.items():
        done = nbytes * (copies if impl != "scalar" else max(1, copies // 8))
        gbs = done / best[impl] / 1e9
        print(json.dumps({"bench": "gemv", "method": method, "shape": [n, k], "impl": impl, "kernel": kernel,
                          "threads": threads, "gb_s": round(gbs, 2), "pct_of_read": round(100 * gbs / read, 1)}),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--impl", default="all")
    ap.add_argument("--mb", type=int, default=512, help="total weight bytes cycled per measurement (MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-lib", default=None, help="another build of the native library to time alongside")
    args = ap.parse_args()
    impls = ["scalar", "avx2", "avx512"] if args.impl == "all" else args.impl.split(",")
    if args.baseline_lib:
        load_baseline(args.baseline_lib)
        impls.append("baseline")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown")
    for method in ("AMXINT4", "AMXINT8"):
        for n, k in SHAPES:
            for t in (int(t) for t in args.threads.split(",")):
                measure(method, n, k, impls, t, args.mb, args.rounds, cpu)


if __name__ == "__main__":
    main()

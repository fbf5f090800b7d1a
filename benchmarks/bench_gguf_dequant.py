"""GGUF dequantization speed: gguf-py's numpy `dequantize` vs ktconvert's native C, side by side per ggml type.

One JSON line per (type, implementation): MB/s of packed input, the speed-up over gguf-py measured in the same
run, and whether the bits equal gguf-py's. Input: random blocks (fp16 scales kept finite), --mb MiB per type.
The pipeline uses the bf16 output (dequantize + round to BF16 in one pass).

    python benchmarks/bench_gguf_dequant.py [--mb 4] [--repeat 5] [--threads 1] [--types Q4_K,Q6_K]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

DEFAULT_TYPES = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "MXFP4", "F16", "BF16"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def best_time(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=4.0,
                    help="MiB of packed input per type (about one expert slice of a large model)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES))
    args = ap.parse_args()

    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from ktconvert.native import gguf as native_gguf
    from ktconvert.quant import ggml

    impls = native_gguf.usable_impls()
    for type_name in args.types.split(","):
        qtype = T[type_name]
        raw = ggml.random_blocks(type_name, int(args.mb * (1 << 20)) // ggml.geometry(type_name)[1])
        mb = raw.size / (1 << 20)
        with np.errstate(all="ignore"):
            t_ref, ref = best_time(lambda: quants.dequantize(raw, qtype), args.repeat)
        ref = np.asarray(ref, np.float32).reshape(-1)
        base = {"type": type_name, "mib": round(mb, 2), "threads": args.threads, "cpu": cpu_model()}
        print(json.dumps({**base, "impl": "gguf-py", "out": "f32", "mb_per_s": round(mb / t_ref, 1)}), flush=True)
        if not native_gguf.supports(qtype.value):
            continue
        for impl in impls:
            for out_kind, fn in (("f32", native_gguf.dequantize_f32), ("bf16", native_gguf.dequantize_bf16)):
                t, got = best_time(lambda: fn(raw, qtype.value, threads=args.threads, impl=impl), args.repeat)
                exact = bool(np.array_equal(got.view(np.uint32), ref.view(np.uint32))) if out_kind == "f32" else None
                print(json.dumps({**base, "impl": impl, "out": out_kind, "mb_per_s": round(mb / t, 1),
                                  "speedup_vs_gguf_py": round(t_ref / t, 1), "bit_exact_f32": exact}), flush=True)


if __name__ == "__main__":
    main()

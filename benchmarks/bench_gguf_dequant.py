"""GGUF dequantization speed: gguf-py's numpy `dequantize` vs ktconvert's native C, side by side per ggml type.

One JSON line per (type, implementation): MB/s of packed input, the speed-up over gguf-py measured in the same
run, and whether the bits equal gguf-py's. Input: random blocks (fp16 scales kept finite), --mb MiB per type.

    python benchmarks/bench_gguf_dequant.py [--mb 16] [--repeat 3] [--threads 1] [--types Q4_K,Q6_K]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

F16_FIELDS = {"F16": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
              "TQ1_0": [52], "TQ2_0": [64]}
DEFAULT_TYPES = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "MXFP4", "F16", "BF16"]


def random_blocks(type_name: str, nbytes_total: int, seed: int = 0) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    block_bytes = GGML_QUANT_SIZES[T[type_name]][1]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(nbytes_total // block_bytes, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS.get(type_name, []):
        h = np.ascontiguousarray(raw[:, off:off + 2]).view(np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)
        raw[:, off:off + 2] = h.view(np.uint8)
    if type_name == "BF16":
        v = raw.view(np.uint16)
        v[(v & 0x7F80) == 0x7F80] &= np.uint16(0xBFFF)
    return raw.reshape(-1)


def best_time(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0, help="MiB of packed input per type")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES))
    args = ap.parse_args()

    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from ktconvert import native
    from ktconvert.native import gguf as native_gguf

    impls = []
    for impl in ("scalar", "avx2", "avx512"):
        try:
            native.resolve_impl(impl)
            impls.append(impl)
        except Exception:
            pass
    for type_name in args.types.split(","):
        qtype = T[type_name]
        raw = random_blocks(type_name, int(args.mb * (1 << 20)))
        mb = raw.size / (1 << 20)
        with np.errstate(all="ignore"):
            t_ref, ref = best_time(lambda: quants.dequantize(raw, qtype), args.repeat)
        ref = np.asarray(ref, np.float32).reshape(-1)
        base = {"type": type_name, "mib": round(mb, 2), "threads": args.threads, "cpu": platform.processor()}
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

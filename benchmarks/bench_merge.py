"""What `ktconvert merge` costs, side by side in one run: hard links (one filesystem), copies hashed while copied
(across filesystems, forced here by making os.link fail with EXDEV), and `--verify` (every part file hashed first),
next to `cat` of the same part files (their read from the page cache) and a plain copy of them (shutil.copyfile +
fsync: what a copying merge did before it hashed). One JSON line per case and repeat.

    python benchmarks/bench_merge.py --workdir /tmp/bench-merge --layers 12 --experts 32 --hidden 1024 \
        --intermediate 512 --parts 3 --repeat 2
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ktconvert import api
from ktconvert.distributed.merge import merge
from ktconvert.examples.tiny import make_tiny_model


def _no_link(src, dst, **kw):
    raise OSError(errno.EXDEV, "Invalid cross-device link")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--arch", default="qwen3_moe")
    for name, default in (("layers", 12), ("experts", 32), ("hidden", 1024), ("intermediate", 512), ("parts", 3),
                          ("repeat", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--method", default="amxint4")
    args = ap.parse_args()
    model = make_tiny_model(args.workdir / "model", args.arch, layers=args.layers, experts=args.experts,
                            hidden=args.hidden, intermediate=args.intermediate, force=True)
    options = dict(method=args.method, numa=2)
    layers = list(api.plan(model, **options).cpu.layers)
    size = -(-len(layers) // args.parts)
    parts = []
    for k in range(0, len(layers), size):
        part = args.workdir / f"part-{k}"
        api.convert_cpu(model, part, layers=(layers[k], layers[min(k + size, len(layers)) - 1]), force=True,
                        **options)
        parts.append(part)
    part_files = [p for part in parts for p in part.rglob("*") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in part_files)
    real_link = os.link
    for repeat in range(args.repeat):
        t0 = time.perf_counter()
        subprocess.run(["cat", *map(str, part_files)], stdout=subprocess.DEVNULL, check=True)
        cases = {"cat": time.perf_counter() - t0}
        plain = args.workdir / "plain-copy"
        shutil.rmtree(plain, ignore_errors=True)
        t0 = time.perf_counter()
        for k, path in enumerate(part_files):
            target = plain / f"{k}-{path.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            with open(target, "rb+") as fh:
                os.fsync(fh.fileno())
        cases["plain copy"] = time.perf_counter() - t0
        for case, verify, link in (("link", False, real_link), ("verify+link", True, real_link),
                                   ("copy+hash", False, _no_link)):
            out = args.workdir / f"out-{case}"
            shutil.rmtree(out, ignore_errors=True)
            os.link = link
            try:
                t0 = time.perf_counter()
                merge(out, parts, verify=verify)
                cases[case] = time.perf_counter() - t0
            finally:
                os.link = real_link
        for case, seconds in cases.items():
            print(json.dumps({"bench": "merge", "case": case, "repeat": repeat, "parts": len(parts),
                              "files": len(part_files), "bytes": nbytes, "seconds": round(seconds, 4),
                              "gb_per_s": round(nbytes / seconds / 1e9, 3)}))


if __name__ == "__main__":
    main()

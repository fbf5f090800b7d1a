"""Per-layer wall time of ``cpu --quant gptq``: the single process against ``--executor ray --workers N`` on a local
Ray instance, side by side in one run, with a check that every output is byte-identical to the single process's.

A tiny Qwen3-MoE checkpoint is converted to AMXINT4 (T=1 unless --numa) with the default held-out selection.
Per layer: the seconds between two layers written (the writer's progress calls); ``first_layer_s`` includes the
Ray workers' start (imports, the meta skeleton), ``layer_s`` is the median of the later layers. One JSON line per
run. Ray's workers run at niceness 0 here (Ray's default, 15, loses every core to any other job on a shared host).

    python benchmarks/bench_gptq_ray.py [--layers 4] [--experts 16] [--hidden 512] [--intermediate 256]
        [--samples 16] [--length 128] [--workers 1 2 4] [--cpus N] [--repeat 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def timed(convert) -> dict:
    """{"total_s", "first_layer_s", "layer_s"} of `convert(progress)`."""
    from ktconvert.util.progress import Progress

    marks = []

    class Marks(Progress):
        def _on_advance(self, nbytes: int, due: bool) -> None:
            marks.append(time.perf_counter())

    t0 = time.perf_counter()
    convert(Marks())
    steps = [b - a for a, b in zip([t0] + marks, marks)]
    return {"total_s": round(time.perf_counter() - t0, 2), "first_layer_s": round(steps[0], 2),
            "layer_s": round(statistics.median(steps[1:]), 2) if len(steps) > 1 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--numa", type=int, default=1)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--cpus", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    import ray
    import torch

    from ktconvert import api
    from ktconvert.examples.tiny import make_tiny_model

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = make_tiny_model(tmp / "model", "qwen3_moe", layers=args.layers, experts=args.experts,
                              hidden=args.hidden, intermediate=args.intermediate)
        g = torch.Generator().manual_seed(0)
        calib = tmp / "calib.jsonl"
        calib.write_text("".join(json.dumps({"input_ids": torch.randint(4, 500, (args.length,), generator=g).tolist()})
                                 + "\n" for _ in range(args.samples)))
        options = dict(method="amxint4", numa=args.numa, quant="gptq", calibration=calib)
        case = {"bench": "gptq_ray", "layers": args.layers, "experts": args.experts, "hidden": args.hidden,
                "intermediate": args.intermediate, "samples": args.samples, "tokens": args.length,
                "cpus": args.cpus, "host_cores": os.cpu_count()}
        runs = [("local", None)] + [("ray", w) for w in args.workers]
        for rep in range(args.repeat):
            golden = None
            for executor, workers in runs:
                out = tmp / f"out-{rep}-{executor}-{workers}"
                extra = {} if workers is None else dict(executor="ray", workers=workers)
                fig = timed(lambda progress: api.convert_cpu(src, out, **options, **extra, progress=progress))
                tree = files(out)
                golden = golden or tree
                print(json.dumps({**case, "repeat": rep, "impl": executor, "workers": workers, **fig,
                                  "identical": tree == golden}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()

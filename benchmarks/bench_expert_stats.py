"""Wall time and peak RSS of ``ktconvert expert-stats`` (float32 and bfloat16 forward) side by side with the GPTQ
stream (routed-only and calibrate-all, W4A16) on the same model and calibration tokens, and with transformers'
own whole-model forward (``from_pretrained``, float32) as the floor of what any counting costs.

Each run happens in a fresh subprocess (peak RSS = that child's VmHWM). Prints one JSON line per run. Models are
tiny Qwen3-MoE checkpoints that differ only in layer count (expert-stats should stay flat in memory).

    python benchmarks/bench_expert_stats.py [--layers 2 8] [--hidden 512] [--intermediate 256] [--experts 32]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
src, which, n, length = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
samples = [torch.randint(4, 512, (length,), generator=g) for _ in range(n)]
t0 = time.perf_counter()
if which.startswith("expert-stats"):
    from ktconvert.activation.stats import collect_activation
    collect_activation(src, samples, dtype=which.split(":")[1])
elif which.startswith("gptq"):
    from ktconvert.gptq.loop import GpuQuantizer, GptqOptions, LayerStream
    opts = GptqOptions(calibrate_all=which.endswith("all"))
    for _ in LayerStream(src, samples, GpuQuantizer(4, 128), opts).layers_results():
        pass
else:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for s in samples:
            model(input_ids=s[None], use_cache=False)
print(json.dumps({"wall_s": round(time.perf_counter() - t0, 2),
                  "peak_rss_mb": round(next(int(l.split()[1]) for l in open("/proc/self/status")
                                            if l.startswith("VmHWM:")) / 1024, 1)}))
"""
WHICH = ["expert-stats:float32", "expert-stats:bfloat16", "gptq:routed", "gptq:all", "transformers-forward"]


def run(src: Path, which: str, samples: int, length: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), which, str(samples), str(length)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--which", nargs="+", default=WHICH)
    args = ap.parse_args()
    from ktconvert.testing.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            src = make_tiny_model(Path(tmp) / f"q{layers}", "qwen3_moe", layers=layers, experts=args.experts,
                                  hidden=args.hidden, intermediate=args.intermediate)
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            for which in args.which:
                fig = run(src, which, args.samples, args.length)
                print(json.dumps({"bench": "expert-stats", "impl": which, "layers": layers,
                                  "model_mb": round(size / 2**20, 1), "samples": args.samples,
                                  "tokens": args.length, **fig}), flush=True)


if __name__ == "__main__":
    main()

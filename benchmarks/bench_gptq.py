"""Peak RSS and wall time: ktconvert's layer-streaming GPTQ against llmcompressor ``oneshot`` (in RAM), and
``expert-stats`` (the same stream without GPTQ: float forward, routed tokens counted) on the same tokens.

Each run happens in a fresh subprocess (peak RSS = that child's VmHWM; ru_maxrss would start from the parent's size). Two tiny Qwen3-MoE sizes that
differ only in layer count: ours should stay flat, oneshot grows with the model. Prints one JSON line per run;
wall_s counts from after the imports (torch, transformers, llmcompressor are imported first in every case).

    python benchmarks/bench_gptq.py [--layers 2 8] [--hidden 512] [--intermediate 256] [--experts 16]
        [--which ours oneshot expert-stats expert-stats-bf16]
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
import transformers, llmcompressor
from ktconvert.gptq.skeleton import silence_llmcompressor
silence_llmcompressor()
t0 = time.perf_counter()
if which.startswith("expert-stats"):
    from ktconvert.activation.stats import collect_activation
    collect_activation(src, samples, dtype="bfloat16" if which.endswith("bf16") else "float32")
elif which == "ours":
    from ktconvert.gptq.loop import GpuQuantizer, GptqOptions, LayerStream
    for _ in LayerStream(src, samples, GpuQuantizer(4, 128), GptqOptions(causal_mask=False)).layers_results():
        pass
else:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ds = Dataset.from_dict({"input_ids": [s.tolist() for s in samples], "attention_mask": [[1] * length] * n})
    ignore = ["lm_head", r"re:.*self_attn.*", r"re:.*mlp\.gate$", r"re:.*mlp\.(gate|up|down)_proj$"]
    oneshot(model=model, dataset=ds, num_calibration_samples=n, max_seq_length=length,
            recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore, dampening_frac=0.1),
            shuffle_calibration_samples=False)
print(json.dumps({"wall_s": round(time.perf_counter() - t0, 2),
                  "peak_rss_mb": round(next(int(l.split()[1]) for l in open("/proc/self/status")
                                            if l.startswith("VmHWM:")) / 1024, 1)}))
"""


def run(src: Path, which: str, samples: int, length: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), which, str(samples), str(length)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--which", nargs="+", default=["ours", "oneshot"])
    args = ap.parse_args()
    from ktconvert.examples.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            src = make_tiny_model(Path(tmp) / f"q{layers}", "qwen3_moe", layers=layers, experts=args.experts,
                                  hidden=args.hidden, intermediate=args.intermediate)
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            for which in args.which:
                fig = run(src, which, args.samples, args.length)
                print(json.dumps({"bench": "gptq", "impl": which, "layers": layers, "model_mb": round(size / 2**20, 1),
                                  "samples": args.samples, "tokens": args.length, **fig}), flush=True)


if __name__ == "__main__":
    main()

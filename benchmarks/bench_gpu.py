"""GPU checkpoint benchmarks (JSON lines): peak RSS and wall of `ktconvert gpu` (RTN) against llmcompressor's
model_free_ptq and oneshot on two model sizes, and the one-pass `convert` against `cpu` + `gpu` run one after the
other. Each measured command runs in its own process (peak RSS = that child's VmHWM).

    python benchmarks/bench_gpu.py [--workdir DIR] [--sizes small,large] [--skip-oneshot]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = {"small": dict(layers=4, experts=16, hidden=512, intermediate=256),
         "large": dict(layers=8, experts=32, hidden=1024, intermediate=512)}
ARCH = "qwen3_moe"
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens$"]

MODEL_FREE = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(sys.argv[1], sys.argv[2], scheme="W4A16", ignore={ignore!r}, device="cpu")
"""
ONESHOT = """
import sys, torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="W4A16", ignore={ignore!r}))
model.save_pretrained(sys.argv[2], save_compressed=True)
"""


def run_measured(cmd: list[str]) -> dict:
    """Run `[python, "-c", code, *args]`; wall time and the child's own peak RSS (VmHWM — see peak_rss.py for why
    not wait4's ru_maxrss, which starts from the parent's size)."""
    from peak_rss import run_python

    code, argv = cmd[2], [str(a) for a in cmd[3:]]
    wall, peak, _ = run_python(f"import sys; sys.argv = ['-c', *{argv!r}]\n" + code,
                               env=dict(os.environ, KTCONVERT_NO_PROGRESS="1"))
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(peak / 2**20, 1)}


def ktconvert(*args) -> list[str]:
    return [sys.executable, "-c", "from ktconvert.cli import main; main()", *map(str, args)]


def model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--skip-oneshot", action="store_true")
    args = ap.parse_args()
    from ktconvert.testing.tiny import make_tiny_model

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_gpu_"))
    for size in args.sizes.split(","):
        src = make_tiny_model(root / f"src-{size}", ARCH, force=True, **SIZES[size])
        base = {"bench": "gpu", "size": size, "model_mib": round(model_bytes(src) / 2**20, 1), **SIZES[size]}
        rows = {"ktconvert gpu": ktconvert("gpu", src, root / f"gpu-{size}", "--force", "--quiet"),
                "model_free_ptq": [sys.executable, "-c", MODEL_FREE.format(ignore=IGNORE), str(src),
                                   str(root / f"mf-{size}")]}
        if not args.skip_oneshot:
            rows["oneshot"] = [sys.executable, "-c", ONESHOT.format(ignore=IGNORE), str(src), str(root / f"os-{size}")]
        for tool, cmd in rows.items():
            print(json.dumps({**base, "tool": tool, **run_measured(cmd)}), flush=True)
        cpu = run_measured(ktconvert("cpu", src, root / f"cpu-{size}", "--method", "amxint4", "--numa", "2",
                                     "--force", "--quiet"))
        gpu = run_measured(ktconvert("gpu", src, root / f"gpu-{size}", "--force", "--quiet"))
        both = run_measured(ktconvert("convert", src, "--cpu", root / f"c1-{size}", "--method", "amxint4", "--numa",
                                      "2", "--gpu", root / f"g1-{size}", "--force", "--quiet"))
        print(json.dumps({**base, "bench": "one-pass", "cpu_then_gpu_wall_s": round(cpu["wall_s"] + gpu["wall_s"], 2),
                          "convert_wall_s": both["wall_s"], "convert_peak_rss_mib": both["peak_rss_mib"],
                          "cpu_peak_rss_mib": cpu["peak_rss_mib"], "gpu_peak_rss_mib": gpu["peak_rss_mib"]}),
              flush=True)


if __name__ == "__main__":
    main()

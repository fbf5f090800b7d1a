"""GPU checkpoint benchmarks (JSON lines): peak RSS and wall of `ktconvert gpu` (RTN) against llmcompressor's
model_free_ptq and oneshot on two model sizes, and the one-pass `convert` against `cpu` + `gpu` run one after the
other. Each measured command runs in its own process (peak RSS = that child's VmHWM).

    python benchmarks/bench_gpu.py [--workdir DIR] [--sizes small,large] [--skip-oneshot]
    python benchmarks/bench_gpu.py --one-pass [--three] [--repeats 3] [--baseline-src DIR] [--workdir DIR]

--one-pass: the issue-16 target on the 3.6 GB BF16 model with Qwen3-30B-A3B expert dims (the model of
bench_convert.py: 3 MoE layers, 128 experts, H 2048, I 768): `cpu` AMXINT4 (numa 2), `gpu` W4A16 and `convert`
(both) interleaved `--repeats` times, warm cache, then the best and median `convert` / `cpu` ratio of wall time and
the ratio of core-seconds (user + system of the child: less sensitive to other work on the machine). With
--baseline-src (another ktconvert source tree, e.g. an export of main) the same commands also run with that tree
first on sys.path, in the same rounds, so before/after share the machine's load. The native library of this tree
serves both (KTCONVERT_NATIVE_LIB), so a baseline must not need newer C functions than this build has.
--three: `cpu` AMXINT4 T=2, `cpu` AMXINT8 T=1, `gpu` W4A16 each alone and one `convert` writing all three, per round
and best: convert / the three one after the other, convert / the slowest single run (issue-16 target: <= 1.5).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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
    return [sys.executable, "-c", "from ktconvert.cli.main import main; main()", *map(str, args)]


def model_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


ONE_PASS_MODEL = dict(layers=3, experts=128, hidden=2048, intermediate=768)
CLI = ("import sys\nsys.path.insert(0, {src!r})\nsys.argv = ['ktconvert', *sys.argv[1:]]\n"
       "from ktconvert.cli.main import main\n"
       "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n")


def three_targets(src: Path, root: Path) -> dict:
    """--three: the three single commands and the one `convert` writing all three outputs."""
    return {"cpu_amxint4_numa2": ["cpu", src, root / "o-a", "--method", "amxint4", "--numa", "2"],
            "cpu_amxint8_numa1": ["cpu", src, root / "o-b", "--method", "amxint8", "--numa", "1"],
            "gpu_w4a16": ["gpu", src, root / "o-g", "--experts", "w4a16"],
            "convert_3": ["convert", src, "--cpu", root / "o-3a", "--method", "amxint4", "--numa", "2", "--cpu",
                          root / "o-3b", "--method", "amxint8", "--numa", "1", "--gpu", root / "o-3g", "--experts",
                          "w4a16"]}


def three_summary(walls: dict, cores: dict, tree: str, repeats: int) -> dict:
    """convert_3 against the three single runs one after the other and against the slowest of them: per round
    (the commands of a round ran side by side, so they share the machine's load) and best of the rounds."""
    import statistics

    singles = ["cpu_amxint4_numa2", "cpu_amxint8_numa1", "gpu_w4a16"]
    per_round = [{"sequential_s": round(sum(walls[tree, c][r] for c in singles), 2),
                  "slowest_s": round(max(walls[tree, c][r] for c in singles), 2),
                  "convert_3_s": round(walls[tree, "convert_3"][r], 2)} for r in range(repeats)]
    best = {c: min(walls[tree, c]) for c in singles + ["convert_3"]}
    return {"summary": True, "rounds": per_round, "best_wall_s": {k: round(v, 2) for k, v in best.items()},
            "best_core_s": {c: round(min(cores[tree, c]), 2) for c in best},
            "convert_3_over_sequential_median": round(statistics.median(
                r["convert_3_s"] / r["sequential_s"] for r in per_round), 2),
            "convert_3_over_slowest_median": round(statistics.median(
                r["convert_3_s"] / r["slowest_s"] for r in per_round), 2),
            "convert_3_over_slowest_best": round(best["convert_3"] / max(best[c] for c in singles), 2),
            "target": "convert_3 <= 1.5 x the slowest single run"}


def one_pass(root: Path, repeats: int, baseline: str | None, three: bool = False) -> None:
    """`cpu`, `gpu`, `convert` on the 3.6 GB model, interleaved; JSON line per run, then a summary per tree.
    three: the three outputs of three_targets alone and in one `convert` instead."""
    import statistics

    from peak_rss import run_python

    from ktconvert import native
    from ktconvert.examples.tiny import make_tiny_model

    src = root / "qwen3-30b-dims"
    if not (src / "config.json").is_file():
        make_tiny_model(src, ARCH, force=True, **ONE_PASS_MODEL)
    for f in sorted(src.glob("*.safetensors")):      # warm the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    lib = native.lib()
    env = dict(os.environ, KTCONVERT_NO_PROGRESS="1", KTCONVERT_NATIVE_LIB=lib._name if lib is not None else "")
    this = str(Path(__file__).resolve().parents[1])
    trees = {"this": this} | ({"baseline": str(Path(baseline).resolve())} if baseline else {})
    commands = three_targets(src, root) if three else \
        {"cpu": ["cpu", src, root / "o-cpu", "--method", "amxint4", "--numa", "2"],
         "gpu": ["gpu", src, root / "o-gpu", "--experts", "w4a16"],
         "convert": ["convert", src, "--cpu", root / "o-c1", "--method", "amxint4", "--numa", "2", "--gpu",
                     root / "o-g1", "--experts", "w4a16"]}
    walls: dict = {(tree, cmd): [] for tree in trees for cmd in commands}
    cores: dict = {(tree, cmd): [] for tree in trees for cmd in commands}
    base = {"bench": "one-pass", "model_mib": round(model_bytes(src) / 2**20, 1), **ONE_PASS_MODEL,
            "cores": os.cpu_count(), "native": native.implementation()}
    for round_ in range(repeats):
        for tree, path in trees.items():
            for cmd, argv in commands.items():
                code = f"import sys; sys.argv = ['-c', *{[str(a) for a in argv + ['--force', '--quiet']]!r}]\n"
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                wall, peak, _ = run_python(code + CLI.format(src=path), env=env)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                core_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                walls[tree, cmd].append(wall)
                cores[tree, cmd].append(core_s)
                print(json.dumps({**base, "tree": tree, "round": round_, "command": cmd, "wall_s": round(wall, 2),
                                  "core_s": round(core_s, 2), "peak_rss_mib": round(peak / 2**20, 1)}), flush=True)
    for tree in trees:
        if three:
            print(json.dumps({**base, "tree": tree, **three_summary(walls, cores, tree, repeats)}), flush=True)
            continue
        best = {cmd: min(walls[tree, cmd]) for cmd in commands}
        median = {cmd: statistics.median(walls[tree, cmd]) for cmd in commands}
        print(json.dumps({**base, "tree": tree, "summary": True, "best_wall_s": {k: round(v, 2) for k, v in best.items()},
                          "median_wall_s": {k: round(v, 2) for k, v in median.items()},
                          "best_core_s": {cmd: round(min(cores[tree, cmd]), 2) for cmd in commands},
                          "convert_over_cpu_best": round(best["convert"] / best["cpu"], 2),
                          "convert_over_cpu_core_s": round(min(cores[tree, "convert"]) / min(cores[tree, "cpu"]), 2),
                          "convert_over_cpu_median": round(median["convert"] / median["cpu"], 2),
                          "target": "convert <= 1.3 x cpu"}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--skip-oneshot", action="store_true")
    ap.add_argument("--one-pass", action="store_true", help="convert vs cpu on the 3.6 GB model (see above)")
    ap.add_argument("--three", action="store_true", help="with --one-pass: AMXINT4 T=2, AMXINT8 T=1 and GPU W4A16 "
                                                          "alone vs one convert writing all three")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-src", default=None, help="another ktconvert source tree to time in the same rounds")
    args = ap.parse_args()
    from ktconvert.examples.tiny import make_tiny_model

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_gpu_"))
    if args.one_pass:
        one_pass(root, args.repeats, args.baseline_src, args.three)
        return
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

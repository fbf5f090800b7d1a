"""Conversion speed and memory, ktconvert vs kt-kernel's own quantize-and-write path, in one run.

Prints one JSON line per measurement:
  * warm read of the source (`cat` to /dev/null, second pass): the floor any converter pays;
  * `ktconvert cpu` wall time and source GB/s per method and layout (3 MoE layers with Qwen3-30B-A3B expert dims:
    H=2048, I=768, 128 experts; 3.6 GB of BF16 experts);
  * peak RSS for 2 vs 16 layers and 8 vs 128 experts (each in its own process);
  * where the CPU has AVX-512 and kt-kernel 0.7.2 is installed: kt-kernel's converter path on the same model —
    what `convert_cpu_weights.py` does per layer (stack the layer's BF16 experts, KTMoEWrapper(cpu_save=True)
    .load_weights_from_tensors writing .kt files) — with its wall time and peak RSS.

    python benchmarks/bench_convert.py [--workdir DIR] [--quick] [--no-ktkernel]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def make_model(path: Path, layers: int, experts: int, hidden: int, inter: int) -> Path:
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "ktconvert.cli.main", "tiny-model", str(path), "--arch", "qwen3_moe",
                        "--layers", str(layers), "--experts", str(experts), "--hidden", str(hidden),
                        "--intermediate", str(inter), "--force"], check=True, stdout=subprocess.DEVNULL)
    return path


def expert_bytes(model: Path) -> int:
    from ktconvert.formats.hf_source import HFSource

    src = HFSource.open(model)
    info = src.info
    return len(info.moe_layers) * info.n_experts * 3 * info.hidden * info.intermediate * 2


def warm_read_seconds(model: Path) -> float:
    files = sorted(model.glob("*.safetensors"))
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def run_measured(code: str, env=None) -> tuple[float, int]:
    """Run python code in a fresh process; returns (wall seconds, peak RSS bytes of that process)."""
    from peak_rss import run_python

    wall, peak, _ = run_python(code, env={**os.environ, "KTCONVERT_NO_PROGRESS": "1", **(env or {})})
    return wall, peak


def ktconvert_run(model: Path, out: Path, method: str, layout: str, numa: int = 2) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    code = (f"from ktconvert.cpu.convert import convert_cpu; convert_cpu({str(model)!r}, {str(out)!r}, "
            f"method={method!r}, numa={numa}, layout={layout!r}, force=True)")
    return run_measured(code)


KTKERNEL_CODE = """
import sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from ktkernel_util import ktkernel_write_kt
from ktconvert.formats.hf_source import HFSource
src = HFSource.open({model!r})
info = src.info
for layer in info.moe_layers:
    experts = [src.read_expert(layer, e) for e in range(info.n_experts)]
    stack = lambda p: np.stack([getattr(x, p) for x in experts])
    ktkernel_write_kt({out!r}, {method!r}, stack("gate"), stack("up"), stack("down"), {numa}, layer_idx=layer, threads=2)
"""


def ktkernel_run(model: Path, out: Path, method: str, numa: int = 2) -> tuple[float, int] | None:
    sys.path.insert(0, str(ROOT / "tests"))
    from ktkernel_util import ktkernel_skip_reason

    reason = ktkernel_skip_reason(method.upper())
    if reason:
        emit(case="ktkernel", skipped=reason)
        return None
    shutil.rmtree(out, ignore_errors=True)
    code = KTKERNEL_CODE.format(tests=str(ROOT / "tests"), model=str(model), out=str(out), method=method.upper(),
                                numa=numa)
    return run_measured(code, env={"KT_FORCE_SYNC_SUBMIT": "1"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ktconvert-bench"))
    ap.add_argument("--quick", action="store_true", help="smaller models (for a smoke run)")
    ap.add_argument("--no-ktkernel", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    from ktconvert import native
    from ktconvert.util.envinfo import env_info

    emit(case="env", cpu_count=os.cpu_count(), native=native.implementation(), flags=env_info()["cpu_flags"])

    experts = 16 if args.quick else 128
    main_model = make_model(work / f"qwen3-30b-dims-e{experts}", 3, experts, 2048, 768)
    nbytes = expert_bytes(main_model)
    emit(case="warm_read", model=main_model.name, source_bytes=nbytes, seconds=round(warm_read_seconds(main_model), 3))
    for method in ("amxint4", "amxint8"):
        for layout in ("safetensors", "kt"):
            wall, rss = ktconvert_run(main_model, work / "out", method, layout)
            emit(case="ktconvert_cpu", method=method, layout=layout, numa=2, source_bytes=nbytes,
                 wall_s=round(wall, 3), source_GBps=round(nbytes / wall / 1e9, 3), peak_rss_MB=round(rss / 2**20))
        if not args.no_ktkernel:
            res = ktkernel_run(main_model, work / "out-ktkernel", method)
            if res:
                emit(case="ktkernel_convert_path", method=method, layout="kt", numa=2, source_bytes=nbytes,
                     wall_s=round(res[0], 3), source_GBps=round(nbytes / res[0] / 1e9, 3),
                     peak_rss_MB=round(res[1] / 2**20))

    # peak RSS flatness: layers and experts
    small_e = 8
    for layers, e in ((2, small_e), (16, small_e), (2, 128 if not args.quick else 32)):
        model = make_model(work / f"rss-l{layers}-e{e}", layers, e, 2048, 768)
        wall, rss = ktconvert_run(model, work / "out-rss", "amxint4", "safetensors")
        emit(case="peak_rss", layers=layers, experts=e, source_bytes=expert_bytes(model),
             wall_s=round(wall, 3), peak_rss_MB=round(rss / 2**20))
    shutil.rmtree(work / "out", ignore_errors=True)
    shutil.rmtree(work / "out-rss", ignore_errors=True)


if __name__ == "__main__":
    main()

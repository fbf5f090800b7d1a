"""The whole job at the speed of storage (issue 16): every converter side by side in one run, JSON lines.

On one multi-shard BF16 model made by `ktconvert tiny-model` at Qwen3-30B-A3B expert dims (H=2048, I=768, 128
experts; a layer's experts over five shards by number, as a hub checkpoint stores them, 1.2 GB per layer; --layers
sets the size, default 3 = 3.6 GB), each case in its own process (wall seconds, core seconds = user + system of the
process, source GB/s, peak RSS from VmHWM):

  * ``cat``: the source read to /dev/null, warm (second pass), and cold (pages dropped with
    posix_fadvise(DONTNEED) first, where the kernel lets go of them; the page-cache residency after the drop is
    printed so a cold figure that was not cold can be told);
  * ``ktkernel``: kt-kernel 0.7.2's converter path (what convert_cpu_weights.py does per layer) where it runs;
  * ``cpu`` AMXINT4 / AMXINT8, ``cpu`` LLAMAFILE Q4_K (GGUF experts, llama.cpp's quantizer), ``gpu`` W4A16,
    ``convert`` with 1, 2 (AMXINT4 + W4A16, the issue's target) and 3 outputs (AMXINT4 + AMXINT8 + W4A16) through
    ktconvert.convert's Python API;
  * thread scaling of ``cpu`` AMXINT4 (1, 2, 4, ... up to the cores, --threads-list to choose);
  * ``cpu`` AMXINT4 cold (source pages dropped first).

Then one ``ratios`` line: cpu GB/s per method, convert(2) / cpu, convert(3) / slowest single run, cold / warm cat,
against the targets (cpu >= 2 GB/s, convert <= 1.3x cpu, peak RSS <= 0.5 GB), each as a wall ratio and as a
core-second ratio (``_core``: what a machine loaded by other work disturbs least). With --profile, each ktconvert run
also reports its --profile breakdown (the table on stderr, the numbers in its JSON line). Timings on a shared
machine are noisy: run it twice and prefer the ratios, which are measured side by side.

    python benchmarks/bench_throughput.py [--workdir DIR] [--layers 3] [--experts 128] [--profile]
                                          [--no-ktkernel] [--skip gpu_w4a16,convert3,...] [--threads-list 1,2]
                                          [--baseline TREE]   (each ktconvert case also run with TREE's version)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_convert import ktkernel_run, make_model  # noqa: E402  (kt-kernel's converter path, same model)
from peak_rss import run_python  # noqa: E402

TARGETS = {"cpu_GBps_min": 2.0, "convert_over_cpu_max": 1.3, "peak_rss_MB_max": 512}


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def source_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> float:
    """posix_fadvise(DONTNEED) over `files`; returns the fraction of their pages still resident after it."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(files)


def resident_fraction(files: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if not size:
            continue
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            first = ctypes.c_char.from_buffer(mapped)
            try:
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size), vec) != 0:
                    return float("nan")
            finally:
                del first
            resident += sum(b & 1 for b in vec)
            total += pages
    return resident / total if total else 0.0


def cat_seconds(files: list[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def run_ktconvert(code: str, profile: bool, pythonpath: str | None = None) -> dict:
    """Run python `code` (which binds `results`, a list of ConvertResults) in a fresh process; wall, peak RSS and,
    with profile, the --profile report. pythonpath: a source tree of another ktconvert version to run instead."""
    prologue = ("import json\ntry:\n    from ktconvert.util import profile as _p\n"
                "except ImportError:\n    from ktconvert import profile as _p   # a tree from before util/\n"
                + ("_p.enable()\n" if profile else ""))
    epilogue = ("\nrep = _p.disable()\n"
                "if rep:\n    import sys; print('PROFILE_JSON', json.dumps(rep), file=sys.stderr)\n"
                "    print(_p.render(rep), file=sys.stderr)\n")
    env = {**os.environ, "KTCONVERT_NO_PROGRESS": "1", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, peak, stderr = run_python(prologue + code + epilogue, env=env, cwd=tempfile.gettempdir())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    core = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    row = {"wall_s": round(wall, 3), "core_s": round(core, 3), "peak_rss_MB": round(peak / 2**20)}
    for line in stderr.splitlines():
        if line.startswith("PROFILE_JSON "):
            row["profile"] = _compact(json.loads(line.split(" ", 1)[1]))
    if profile:
        table = [ln for ln in stderr.splitlines() if not ln.startswith(("PROFILE_JSON", "PEAK_RSS_KB"))]
        print("\n".join(table), file=sys.stderr, flush=True)
    return row


def _compact(report: dict) -> dict:
    kinds = {k: [round(v["wall_s"], 2), round(v["core_s"], 2)] for k, v in sorted(report["kinds"].items())
             if v["wall_s"] >= 0.05 or v["core_s"] >= 0.05}
    return {"wall_s": round(report["wall_s"], 2), "core_s": round(report["core_s"], 2), "kinds_wall_core_s": kinds}


def convert_code(model: Path, targets: list[tuple[Path, dict]], threads: int | None) -> str:
    """Code converting `model` into every (out, options) of `targets` in one pass (ktconvert.convert), or with
    convert_cpu / convert_gpu for a single target."""
    pairs = [(str(out), opts) for out, opts in targets]
    return (f"import ktconvert\nresults = ktconvert.convert({str(model)!r}, {pairs!r}, threads={threads!r}, "
            f"force=True)\n")


CPU4 = {"method": "amxint4", "numa": 2}
CPU8 = {"method": "amxint8", "numa": 2}
GPU = {"experts": "w4a16", "group_size": 128}
Q4K = {"method": "llamafile", "ggml_type": "Q4_K", "numa": 1}     # issue 28: RSS <= 0.5 GB, time <= 1.5x AMXINT4


def single_code(model: Path, out: Path, opts: dict, threads: int | None) -> str:
    fn = "convert_gpu" if "experts" in opts else "convert_cpu"
    return f"import ktconvert\nresults = [ktconvert.{fn}({str(model)!r}, {str(out)!r}, threads={threads!r}, " \
           f"force=True, **{opts!r})]\n"


class Bench:
    def __init__(self, args, model: Path):
        self.args, self.model = args, model
        self.files = source_files(model)
        self.nbytes = sum(p.stat().st_size for p in self.files)
        self.work = Path(args.workdir)
        self.rows: dict[str, dict] = {}

    def record(self, name: str, row: dict, **fields) -> None:
        row = {"case": name, **fields, **row}
        if "wall_s" in row:
            row["source_GBps"] = round(self.nbytes / row["wall_s"] / 1e9, 3)
        self.rows[name] = row
        emit(**row)

    def outs(self, n: int) -> list[Path]:
        paths = [self.work / f"out{i}" for i in range(n)]
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        return paths

    def cat(self) -> None:
        cat_seconds(self.files)
        self.record("cat_warm", {"wall_s": round(cat_seconds(self.files), 3)})
        if self.args.no_cold:
            return
        left = drop_cache(self.files)
        self.record("cat_cold", {"wall_s": round(cat_seconds(self.files), 3)}, resident_after_drop=round(left, 3))

    def ktconvert(self, name: str, targets: list[dict], threads: int | None = None, cold: bool = False) -> None:
        if name.split("@")[0] in self.args.skip:
            return
        outs = self.outs(len(targets))
        code = single_code(self.model, outs[0], targets[0], threads) if len(targets) == 1 and name != "convert1" \
            else convert_code(self.model, list(zip(outs, targets)), threads)
        for suffix, tree in [("", None)] + ([("@baseline", self.args.baseline)] if self.args.baseline else []):
            cat_seconds(self.files)
            extra = {"resident_after_drop": round(drop_cache(self.files), 3)} if cold else {}
            if self.args.profile:
                print(f"--- {name}{suffix}", file=sys.stderr, flush=True)
            row = run_ktconvert(code, self.args.profile, tree)
            row["version"] = "baseline" if tree else "this"
            self.record(name + suffix, row, threads=threads or os.cpu_count(), outputs=len(targets), **extra)
            self.outs(len(targets))

    def ktkernel(self) -> None:
        if self.args.no_ktkernel:
            return
        for method in self.args.ktkernel_methods:
            res = ktkernel_run(self.model, self.work / "out-ktkernel", method)
            if res:
                self.record(f"ktkernel_{method}", {"wall_s": round(res[0], 3), "peak_rss_MB": round(res[1] / 2**20)},
                            layout="kt", numa=2)
            shutil.rmtree(self.work / "out-ktkernel", ignore_errors=True)

    def ratios(self) -> None:
        """Wall ratios, and core-second ratios (``_core``: user + system of the process, what a loaded machine
        disturbs least) for the ktconvert cases."""
        r, out = self.rows, {"case": "ratios", "targets": TARGETS}

        def of(name, key="wall_s"):
            return r[name].get(key) if name in r else None

        def ratio(label, num, den, keys=("wall_s", "core_s")):
            for key in keys:
                if of(num, key) and of(den, key):
                    out[label + ("_core" if key == "core_s" else "")] = round(of(num, key) / of(den, key), 3)

        for name in ("cpu_amxint4", "cpu_amxint8"):
            if name in r:
                out[f"{name}_GBps"] = r[name]["source_GBps"]
        ratio("convert2_over_cpu_amxint4", "convert2", "cpu_amxint4")
        ratio("llamafile_q4k_over_cpu_amxint4", "cpu_llamafile_q4k", "cpu_amxint4")
        singles = ("cpu_amxint4", "cpu_amxint8", "gpu_w4a16")
        for key in ("wall_s", "core_s"):
            if of("convert3", key) and all(of(n, key) for n in singles):
                slowest = max(singles, key=lambda n: of(n, key))
                ratio("convert3_over_slowest_single", "convert3", slowest, (key,))
        ratio("cold_over_warm_cat", "cat_cold", "cat_warm", ("wall_s",))
        ratio("cpu_cold_over_cat_cold", "cpu_amxint4@cold", "cat_cold", ("wall_s",))
        ratio("speedup_2t_over_1t", "cpu_amxint4@1t", "cpu_amxint4@2t", ("wall_s",))
        ratio("ktkernel_over_cpu_amxint4", "ktkernel_amxint4", "cpu_amxint4", ("wall_s",))
        for name in [n for n in r if n.endswith("@baseline")]:
            ratio(f"{name[:-len('@baseline')]}_over_baseline", name[:-len("@baseline")], name)
        out["peak_rss_MB_max"] = max((v.get("peak_rss_MB", 0) for k, v in r.items()
                                      if not k.startswith("ktkernel") and not k.endswith("@baseline")),
                                     default=None)
        emit(**out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ktconvert-bench-throughput"))
    ap.add_argument("--layers", type=int, default=3, help="MoE layers (1.2 GB of BF16 experts each at 128 experts)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--threads-list", default=None, help="comma list for the scaling table (default 1,2,4,.. cores)")
    ap.add_argument("--profile", action="store_true", help="--profile breakdown of every ktconvert run")
    ap.add_argument("--no-ktkernel", action="store_true")
    ap.add_argument("--baseline", default=None, help="source tree of another ktconvert version (e.g. `git archive "
                                                     "main` with its built native library): each ktconvert case is "
                                                     "also run with it, right after, as CASE@baseline")
    ap.add_argument("--ktkernel-methods", default="amxint4", help="comma list (amxint4,amxint8)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    ap.add_argument("--skip", default="", help="comma list of cases to leave out (cpu_amxint8, gpu_w4a16, "
                                               "cpu_llamafile_q4k, convert1, convert2, convert3, scaling, cold)")
    args = ap.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    args.ktkernel_methods = [m for m in args.ktkernel_methods.split(",") if m]
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads_list.split(",")] if args.threads_list else \
        [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= cores]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / f"qwen3-30b-dims-l{args.layers}-e{args.experts}", args.layers, args.experts,
                       args.hidden, args.intermediate)
    bench = Bench(args, model)
    emit(case="env", cpu_count=cores, model=model.name, source_files=len(bench.files), source_bytes=bench.nbytes)
    bench.cat()
    bench.ktkernel()
    bench.ktconvert("cpu_amxint4", [CPU4])
    bench.ktconvert("cpu_amxint8", [CPU8])
    bench.ktconvert("gpu_w4a16", [GPU])
    bench.ktconvert("cpu_llamafile_q4k", [Q4K])
    bench.ktconvert("convert1", [CPU4])
    bench.ktconvert("convert2", [CPU4, GPU])
    bench.ktconvert("convert3", [CPU4, CPU8, GPU])
    if "scaling" not in args.skip:
        for t in threads:
            bench.ktconvert(f"cpu_amxint4@{t}t", [CPU4], threads=t)
    if not args.no_cold and "cold" not in args.skip:
        bench.ktconvert("cpu_amxint4@cold", [CPU4], cold=True)
    bench.ratios()


if __name__ == "__main__":
    main()

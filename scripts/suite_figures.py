"""Measure the test suite and write its figures into README.md (between the suite-figures markers), so the README
says what a run measured instead of what someone typed.

    python scripts/suite_figures.py run [--fresh-clone] [--slow] [--dry-run]
    python scripts/suite_figures.py from-logs CI_LOG [--slow-log LOG] [--dry-run]

``run`` times the README's test command here (``--fresh-clone``: `git clone` of HEAD into a temporary folder and
its ``.ci/run``, install included, the way CI runs it; ``--slow``: also ``-m slow``). ``from-logs`` reads the output
of earlier runs instead: a log holding pytest's last summary line (``N passed, M skipped, ... in S s``) and, for the
whole ``.ci/run``, bash's ``time`` lines (``real 11m25.0s``). The machine is named from /proc/cpuinfo and
os.cpu_count(). Nothing here is imported by ktconvert; it needs only the standard library.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- suite-figures:begin -->", "<!-- suite-figures:end -->"
SUMMARY = re.compile(r"=*\s*((?:\d+ \w+(?:, )?)+)(?:, \d+ warnings?)? in ([\d.]+)s")
REAL = re.compile(r"^real\s+(\d+)m([\d.]+)s", re.M)


def summary(text: str) -> tuple[dict[str, int], float]:
    """({outcome: count}, seconds) of the last pytest summary line in `text`; ValueError when there is none."""
    found = SUMMARY.findall(text)
    if not found:
        raise ValueError("no pytest summary line (N passed ... in S s) in the log")
    counts, seconds = found[-1]
    return {w: int(n) for n, w in re.findall(r"(\d+) (\w+)", counts) if not w.startswith("warning")}, float(seconds)


def real_seconds(text: str) -> float | None:
    m = REAL.findall(text)
    return int(m[-1][0]) * 60 + float(m[-1][1]) if m else None


def machine() -> str:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    isa = "AMX" if " amx_tile" in flags else "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else ""
    return f"{os.cpu_count()} cores, {model or 'unknown CPU'}" + (f", {isa}" if isa else "")


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60))} s"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped", "deselected") if k in counts)


def paragraph(ci: tuple[dict, float], ci_total: float | None, slow: tuple[dict, float] | None) -> str:
    (counts, seconds) = ci
    whole = f"a fresh clone's `.ci/run` (install, then this command) took {_mmss(ci_total)}, " if ci_total else ""
    text = (f"How long it takes, measured by `scripts/suite_figures.py` on {machine()}: {whole}the tests "
            f"{_mmss(seconds)} ({_counts(counts)}; the skips are checks this CPU cannot run, each with its reason: "
            "kt-kernel's AVX-512 / AMX backends, the runtime's AVX-512 kernels, llama.cpp's own loader where "
            "llama-cpp-python is not installed)")
    if slow:
        counts = {k: v for k, v in slow[0].items() if k != "deselected"}
        text += f"; `-m slow` adds {_mmss(slow[1])} ({_counts(counts)})"
    return text + "."


def write_readme(text: str, dry_run: bool) -> None:
    readme = ROOT / "README.md"
    body = readme.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"error: {readme}: no {BEGIN} ... {END} markers")
    head, rest = body.split(BEGIN, 1)
    new = head + BEGIN + "\n" + _wrap(text) + "\n" + END + rest.split(END, 1)[1]
    if dry_run:
        print(_wrap(text))
    else:
        readme.write_text(new)
        print(f"README.md: {text}")


def _wrap(text: str, width: int = 116) -> str:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join(lines + [line])


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> tuple[str, float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.stderr.write(out[-4000:])
        raise SystemExit(f"error: {' '.join(cmd)} exited {proc.returncode} in {cwd}: figures not written")
    return out, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run", help="run the suite and write its figures")
    run.add_argument("--fresh-clone", action="store_true", help="clone HEAD and run its .ci/run (install included)")
    run.add_argument("--slow", action="store_true", help="also run `-m slow`")
    logs = sub.add_parser("from-logs", help="take the figures from earlier runs' output")
    logs.add_argument("ci_log", type=Path, help="output of .ci/run under `time` (or of the test command)")
    logs.add_argument("--slow-log", type=Path, help="output of `pytest -m slow`")
    for p in (run, logs):
        p.add_argument("--dry-run", action="store_true", help="print the paragraph, leave README.md as it is")
    args = ap.parse_args()
    if args.mode == "from-logs":
        text = args.ci_log.read_text(errors="replace")
        slow = summary(args.slow_log.read_text(errors="replace")) if args.slow_log else None
        write_readme(paragraph(summary(text), real_seconds(text), slow), args.dry_run)
        return
    python = [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    total = None
    if args.fresh_clone:
        with tempfile.TemporaryDirectory() as tmp:
            clone = Path(tmp) / "ktconvert"
            _run(["git", "clone", "-q", str(ROOT), str(clone)], ROOT)
            out, total = _run(["bash", ".ci/run"], clone, {**os.environ, "CI": "true"})
    else:
        out, _ = _run(python, ROOT)
    slow = summary(_run(python + ["-m", "slow"], ROOT)[0]) if args.slow else None
    write_readme(paragraph(summary(out), total, slow), args.dry_run)


if __name__ == "__main__":
    main()

"""Peak RSS of a child process, measured correctly.

`ru_maxrss` (getrusage / wait4) is the wrong number for a child: Linux carries the parent's resident size at
fork over into the child's high-water mark, so a child forked from a large parent reports at least the parent's
size. /proc/self/status VmHWM belongs to the address space, which exec replaces, so the child reads its own peak
there just before it exits. Used by the benchmark scripts; not a test.
"""
from __future__ import annotations

import subprocess
import sys
import time

_REPORT = ("\nimport atexit\n"
           "def _ktconvert_peak():\n"
           "    import sys\n"
           "    for line in open('/proc/self/status'):\n"
           "        if line.startswith('VmHWM:'):\n"
           "            print('PEAK_RSS_KB', line.split()[1], file=sys.stderr)\n"
           "atexit.register(_ktconvert_peak)\n")


def run_python(code: str, env=None, cwd=None) -> tuple[float, int, str]:
    """Run `code` in a fresh interpreter (in folder `cwd`: `python -c` imports from there first); (wall seconds,
    peak RSS bytes, stderr). Raises on a non-zero exit."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _REPORT + code], capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    kb = next(int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS_KB"))
    return wall, kb * 1024, proc.stderr


def run_cli(args: list[str], env=None) -> tuple[float, int]:
    """`ktconvert ARGS` in a fresh interpreter; (wall seconds, peak RSS bytes)."""
    code = f"import sys; sys.argv = ['ktconvert', *{[str(a) for a in args]!r}]\nfrom ktconvert.cli.main import main\n" \
           "try:\n    main()\nexcept SystemExit as exc:\n    if exc.code: raise\n"
    wall, peak, _ = run_python(code, env)
    return wall, peak

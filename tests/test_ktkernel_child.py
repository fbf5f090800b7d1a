"""kt-kernel runs only in child processes (tests/ktkernel_util.in_child): a crash there fails the one test that
made the call, naming the signal, and kt_kernel is never imported into the test process."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ktkernel_util import KtKernelCrash, in_child, ktkernel_info


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
def test_a_crash_in_the_child_fails_one_call_naming_the_signal(sig):
    with pytest.raises(KtKernelCrash, match=f"crashed with {sig.name} in _signal_here"):
        in_child("_signal_here", signum=int(sig))


def test_exceptions_and_results_cross_the_process_boundary():
    with pytest.raises(RuntimeError, match="TypeError"):
        in_child("_signal_here", bogus=1)
    got = in_child("relative_l2", a=np.ones(4), b=np.full(4, 2.0))
    assert got == pytest.approx(0.5)


def test_probing_never_loads_kt_kernel_here():
    """The skip reasons' probe runs in a child: after it, kt_kernel is absent from a fresh interpreter that asked."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import ktkernel_util as k; info = k.ktkernel_info(); "
            "assert 'error' in info; assert not [m for m in sys.modules if m.startswith('kt_kernel')], sys.modules")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "error" in ktkernel_info()
    assert not [m for m in sys.modules if m.startswith("kt_kernel")]

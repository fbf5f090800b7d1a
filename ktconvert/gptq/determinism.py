"""The same GPTQ bits on any x86-64 host: the kernels torch computes the calibration forward, the routing, the
Hessians and the solve with, pinned to ones every such CPU runs identically.

What changes the bits from one host to another, and what pins it:

* oneDNN: BF16 matmuls on CPUs with AVX-512 (AMX, AVX512_BF16, AVX-512BW) go through oneDNN's kernels, chosen per
  instruction set (``ONEDNN_MAX_CPU_ISA``) and rounding differently with the thread count. ``deterministic_cpu``
  switches oneDNN off (``torch.backends.mkldnn``) while GPTQ computes, so they run in ATen's own gemm, as they do
  on CPUs without AVX-512; float32 matmuls keep IEEE precision (no bf16 / tf32 shortcut).
* threads: ``deterministic_cpu`` runs at one torch thread (ATen's parallel reductions, MKL's Cholesky).
* ATen's vectorised kernels (BF16 gemm, softmax, reductions such as RMSNorm's mean) exist per CPU capability
  (default / avx2 / avx512); the vector width sets their summation order. torch reads the capability from
  ``ATEN_CPU_CAPABILITY`` once, at its first operation: ``pin_process`` sets it to "avx2" before then (lower only:
  a CPU without AVX2 is not pinned).
* oneMKL (float32 / float64 gemm of the Hessians, the solve and the held-out errors, Cholesky, vector math) picks
  its code path per CPU, vendor included, unless ``MKL_CBWR`` names one; read at MKL's first call. ``pin_process``
  sets "COMPATIBLE", the one path every x86-64 CPU, Intel or AMD, runs.

Both variables only work when set before torch computes anything in the process: the ``ktconvert`` command and the
API's GPTQ entry points call ``pin_process`` first; in a process where torch already ran, what could not be pinned
is left as it is and a RuntimeWarning names it (the bytes may then differ from other hosts'). Processes that
compute part of a run (Ray tasks) get the pins in effect in the driver as environment variables (``worker_env``),
so they compute what the driver would.

Cost (measured on an AVX2 AMD EPYC, one thread): MKL's COMPATIBLE path makes a float32 [2048, 1024]^T gemm 2.6x
slower and a 1024 Cholesky + inverse 1.8x (+4-6 % CPU time for a whole tiny-model conversion); without oneDNN a CPU
with AMX loses its BF16 matmul acceleration in the calibration forward.
"""
from __future__ import annotations

import contextlib
import os
import warnings

CAPABILITY, MKL_CBWR = "ATEN_CPU_CAPABILITY", "MKL_CBWR"
PINS = {CAPABILITY: "avx2", MKL_CBWR: "COMPATIBLE"}
MKL_CBWR_BRANCH, MKL_CBWR_COMPATIBLE = 1, 3   # mkl_cbwr_get's argument (the branch) and COMPATIBLE's value

_pinned: dict | None = None   # this process's pins in effect, once pin_process ran


def pin_process() -> dict:
    """Pin ATen's CPU capability and MKL's code path for this process (module docstring), once. Returns the pins in
    effect {variable: value}; what could not be pinned (torch already ran, a CPU without AVX2) keeps the
    environment it had, with a RuntimeWarning saying why."""
    global _pinned
    if _pinned is None:
        import torch

        _pinned, missed = {}, []
        for name, pin in ((CAPABILITY, _pin_capability), (MKL_CBWR, _pin_mkl)):
            why = pin(torch)
            if why is None:
                _pinned[name] = PINS[name]
            elif why:
                missed.append(f"{name}={PINS[name]} ({why})")
        if missed:
            warnings.warn("GPTQ: could not pin " + "; ".join(missed) + ": the output may differ from other hosts' "
                          "(a fresh process pins them before torch's first operation, as the ktconvert command "
                          "does)", RuntimeWarning, stacklevel=2)
    return dict(_pinned)


def worker_env() -> dict:
    """Environment variables for processes computing part of this process's GPTQ run: the pins in effect here."""
    return pin_process()


def _set(name: str, value: str, took) -> bool:
    """os.environ[name] = value, kept when took() says it is in effect, else the old value restored."""
    old = os.environ.get(name)
    os.environ[name] = value
    if took():
        return True
    if old is None:
        del os.environ[name]
    else:
        os.environ[name] = old
    return False


def _pin_capability(torch) -> str | None:
    """ATEN_CPU_CAPABILITY=avx2 where the CPU has AVX2 (a capability the CPU lacks would crash torch). None when in
    effect, else why not."""
    if not getattr(torch.cpu, "_is_avx2_supported", lambda: False)():
        return "the CPU has no AVX2"
    if _set(CAPABILITY, PINS[CAPABILITY], lambda: torch.backends.cpu.get_cpu_capability() == "AVX2"):
        return None
    return f"torch already runs {torch.backends.cpu.get_cpu_capability()}"


def _pin_mkl(torch) -> str | None:
    """MKL_CBWR=COMPATIBLE. None when in effect (or not checkable), "" without MKL (nothing to pin), else why not."""
    if not torch.backends.mkl.is_available():
        return ""
    if _set(MKL_CBWR, PINS[MKL_CBWR], lambda: _mkl_branch(torch) in (None, MKL_CBWR_COMPATIBLE)):
        return None
    return f"MKL already started on branch {_mkl_branch(torch)}"


def _mkl_branch(torch) -> int | None:
    """MKL's code path in effect (mkl_cbwr_get(MKL_CBWR_BRANCH): 1 off, 2 auto, 3 compatible, ...) from the MKL
    linked into torch's CPU library; None where it cannot be asked (then the environment variable is trusted)."""
    import ctypes

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None
    for symbol in ("mkl_cbwr_get", "mkl_serv_cbwr_get"):
        get = getattr(lib, symbol, None)
        if get is not None:
            get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
            return int(get(MKL_CBWR_BRANCH))
    return None


@contextlib.contextmanager
def deterministic_cpu(device):
    """While GPTQ computes on CPU: one torch thread, oneDNN off, IEEE float32 matmuls (module docstring); on
    another device nothing changes."""
    import torch

    if torch.device(device).type != "cpu":
        yield
        return
    mkldnn = torch.backends.mkldnn
    threads, flags = torch.get_num_threads(), mkldnn.set_flags(False, None, None, "ieee")
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        mkldnn.set_flags(flags[0], None, None, flags[3])

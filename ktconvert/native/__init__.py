"""Optional native library (built from native/*.c by the package build), loaded lazily with ctypes.

Without it every caller uses the numpy reference paths; ``available()`` says which. Which kernels run on this CPU
is decided once, in the library (native/dispatch.c: one table of implementations, best first, each with the CPU
features it needs): the best of avx512 > avx2 > scalar, or the one ``KTCONVERT_FORCE_IMPL=scalar|avx2|avx512``
names (forcing one the CPU lacks raises NativeError naming the missing feature). ``KTCONVERT_FORCE_IMPL=numpy``
makes ``available()`` False, so callers take their numpy paths. ``KTCONVERT_NO_NATIVE=1`` hides the library
altogether; ``KTCONVERT_NATIVE_LIB=/path.so`` loads that file instead of the one next to this module.
``KTCONVERT_DISABLE_CPU_FEATURES=avx512f,...`` hides CPU features from the table, to run the fallbacks on one host.

The modules binding C functions (amx_quantize here; decode, gguf, mse, forward, ct_rtn) share what this module
provides: ``bind(signatures)`` sets ctypes signatures whose array arguments are ``array(dtype)`` /
``out_array(dtype)`` (``np.ctypeslib.ndpointer``: ctypes checks dtype, contiguity and writability), and
``run_ranges`` is the one split-run-collect loop (row ranges over the shared thread pool, statuses turned into
errors). Importing this module loads neither numpy nor the library; both happen on first use.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ktconvert.errors import NativeError, NumericError, ShapeError

if TYPE_CHECKING:
    import numpy as np

# Status codes and implementation ids of native/kt_native.h.
KT_OK, KT_E_SHAPE, KT_E_NONFINITE, KT_E_IMPL, KT_E_ARG = 0, 1, 2, 3, 4
KT_RT_E_NOMEM, KT_RT_E_THREAD = 33, 34
IMPL_IDS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
ABI_VERSION = 1
STATUS_TEXT = {KT_E_SHAPE: "bad shape", KT_E_NONFINITE: "NaN/Inf in input", KT_E_IMPL: "implementation not supported",
               KT_E_ARG: "bad argument", KT_RT_E_NOMEM: "out of memory", KT_RT_E_THREAD: "cannot start a thread"}

_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL | None, "error": str | None, "pool": ThreadPoolExecutor, "pool_size": int

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DISPATCH_SIGNATURES = {
    "kt_abi_version": (_INT, []),
    "kt_fp_flush_mode": (_INT, []),
    "kt_fp_set_flush_mode": (None, [_INT]),
    "kt_cpu_features": (_INT, []),
    "kt_cpu_feature_name": (ctypes.c_char_p, [_INT]),
    "kt_impl_missing": (_INT, [_INT]),
    "kt_impl_best": (_INT, []),
    "kt_select_impl": (_INT, []),
    "kt_resolve_impl": (_INT, [_INT]),
    "kt_impl_name": (ctypes.c_char_p, [_INT]),
    "kt_impl_variant": (ctypes.c_char_p, [_INT]),
    "kt_amx_nblock_rows": (_I64, [_INT]),
    "kt_amx_nblocks": (_I64, [_I64, _INT]),
    "kt_amx_check_shape": (_INT, [_I64, _I64, _INT]),
}


# ---------------------------------------------------------------------------------------------- ctypes argument types

def array(dtype=None, *, nullable: bool = False) -> type:
    """ctypes argument type of a C-contiguous numpy array of `dtype` (any dtype when None), read by C.
    nullable: None passes NULL."""
    return _ndpointer(dtype, "C_CONTIGUOUS", nullable)


def out_array(dtype=None, *, nullable: bool = False) -> type:
    """ctypes argument type of a C-contiguous, writable numpy array of `dtype` that C writes."""
    return _ndpointer(dtype, "C_CONTIGUOUS,WRITEABLE", nullable)


def _ndpointer(dtype, flags: str, nullable: bool) -> type:
    import numpy as np

    base = np.ctypeslib.ndpointer(dtype=dtype, flags=flags)
    if not nullable:
        return base

    class NullableArray(base):
        @classmethod
        def from_param(cls, obj):
            return None if obj is None else base.from_param(obj)

    return NullableArray


# ---------------------------------------------------------------------------------------------- loading and binding

def _library_candidates() -> list[Path]:
    """Paths to try, best first: $KTCONVERT_NATIVE_LIB, else _ktnative<EXT_SUFFIX> next to this file (where both
    ``pip install .`` and the in-place build of ``pip install -e .`` / ``setup.py build_ext --inplace`` put it)."""
    explicit = os.environ.get("KTCONVERT_NATIVE_LIB")
    if explicit:
        return [Path(explicit)]
    here = Path(__file__).resolve().parent
    exact = [here / f"_ktnative{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    return [p for p in exact if p.is_file()] or sorted(here.glob("_ktnative*.so"))


def _set_signatures(handle: ctypes.CDLL, signatures: dict) -> None:
    """Set restype/argtypes of every {name: (restype, [argtypes])}; AttributeError if a function is missing."""
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(handle, name)
        fn.restype, fn.argtypes = restype, argtypes


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("KTCONVERT_NO_NATIVE", "") not in ("", "0"):
        return None, "disabled by KTCONVERT_NO_NATIVE"
    candidates = _library_candidates()
    if not candidates:
        return None, "native library not built (pip install -e . --no-deps, or python setup.py build_ext --inplace)"
    try:
        handle = ctypes.CDLL(str(candidates[0]))
        _set_signatures(handle, _DISPATCH_SIGNATURES)
    except (OSError, AttributeError) as exc:
        return None, f"cannot load {candidates[0].name}: {exc} (stale build? rebuild with pip install -e .)"
    if handle.kt_abi_version() != ABI_VERSION:
        return None, f"{candidates[0].name}: ABI version {handle.kt_abi_version()}, expected {ABI_VERSION} (rebuild)"
    return handle, None


def lib() -> ctypes.CDLL | None:
    """The loaded ctypes library (dispatch functions bound), or None when it is missing or unloadable."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["error"] = _load()
    return _state["lib"]


def load_error() -> str | None:
    """Why lib() is None (one line), or None when the library is loaded."""
    lib()
    return _state["error"]


_bound: dict[Callable, bool] = {}


def bind(signatures: Callable[[], dict]) -> ctypes.CDLL | None:
    """The loaded library with the table ``signatures()`` returns ({name: (restype, [argtypes])}, built on first use
    because array types need numpy) set, once per table; None when the library is missing, or lacks one of the
    functions (built before they existed: rebuild)."""
    handle = lib()
    if handle is None:
        return None
    if signatures not in _bound:
        with _lock:
            try:
                _set_signatures(handle, signatures())
                _bound[signatures] = True
            except AttributeError:
                _bound[signatures] = False
    return handle if _bound[signatures] else None


def bound_or_raise(signatures: Callable[[], dict], what: str, name: str | None = None) -> ctypes.CDLL:
    """bind(signatures), or NativeError naming `what` (library missing, or built before `what` existed)."""
    handle = bind(signatures)
    if handle is None:
        raise NativeError(load_error() or f"{what} is not in the native library",
                          tensor=name, hint=None if lib() is None else "rebuild: pip install -e . --no-deps")
    return handle


# ---------------------------------------------------------------------------------------------- implementations

def _numpy_forced() -> bool:
    return os.environ.get("KTCONVERT_FORCE_IMPL", "").strip().lower() == "numpy"


def available() -> bool:
    """True when native kernels should be used: the library is built, loadable and not disabled
    (KTCONVERT_NO_NATIVE), and KTCONVERT_FORCE_IMPL is not "numpy" (which selects the numpy reference paths)."""
    return lib() is not None and not _numpy_forced()


def fp_flush_mode() -> bool:
    """Whether flush-to-zero / denormals-are-zero is on in this thread (kt-kernel switches it on at import)."""
    handle = lib()
    return bool(handle.kt_fp_flush_mode()) if handle is not None else False


def set_fp_flush_mode(on: bool) -> None:
    """Switch flush-to-zero / denormals-are-zero on or off in this thread (numpy keeps subnormals only when off)."""
    handle = lib()
    if handle is not None:
        handle.kt_fp_set_flush_mode(int(bool(on)))


def _feature_names(handle: ctypes.CDLL, mask: int) -> list[str]:
    return [handle.kt_cpu_feature_name(i).decode() for i in range(32)
            if mask >> i & 1 and handle.kt_cpu_feature_name(i)]


def cpu_features() -> list[str]:
    """Names of the usable CPU features the library detected (e.g. ["avx2", "fma", "avx512f", ...]); [] without it."""
    handle = lib()
    return _feature_names(handle, handle.kt_cpu_features()) if handle is not None else []


def resolve_impl(impl: str | None = None) -> int:
    """Implementation id (1 scalar, 2 avx2, 3 avx512) a call with ``impl`` runs; None means the automatic choice
    (KTCONVERT_FORCE_IMPL honoured). Raises NativeError if the library is missing, the name is unknown or the CPU
    lacks a feature it needs."""
    handle = lib()
    if handle is None:
        raise NativeError(load_error() or "native library not available")
    if impl is not None and impl not in IMPL_IDS:
        raise NativeError("unknown implementation", expected=" | ".join(IMPL_IDS), found=repr(impl))
    requested = IMPL_IDS[impl or "auto"]
    chosen = handle.kt_resolve_impl(requested)
    if chosen > 0:
        return chosen
    forced = os.environ.get("KTCONVERT_FORCE_IMPL", "") if requested == 0 else impl
    source = "KTCONVERT_FORCE_IMPL" if requested == 0 else "impl"
    if -chosen == KT_E_IMPL and forced in IMPL_IDS:
        missing = ", ".join(_feature_names(handle, handle.kt_impl_missing(IMPL_IDS[forced])))
        hint = "unset KTCONVERT_FORCE_IMPL to pick the best supported one" if requested == 0 else None
        raise NativeError(f"{source}={forced}: this CPU lacks {missing}", hint=hint)
    raise NativeError(f"{source}={forced!r} is not an implementation", expected="scalar | avx2 | avx512")


def implementation() -> str | None:
    """"avx512" | "avx2" | "scalar": what the native kernels run by default here; None when available() is False.
    Raises NativeError when KTCONVERT_FORCE_IMPL names an unknown or unsupported implementation."""
    if not available():
        return None
    return lib().kt_impl_name(resolve_impl(None)).decode()


def variant(impl: str | None = None) -> str:
    """The kernels a call with ``impl`` runs: "avx512-vnni" | "avx512" | "avx2" | "scalar" (NativeError as
    resolve_impl)."""
    return lib().kt_impl_variant(resolve_impl(impl)).decode()


def usable_impls() -> list[str]:
    """The implementations ("scalar", "avx2", "avx512") that can run here, worst first; [] unless available()."""
    if not available():
        return []
    handle = lib()
    return [name for name, i in IMPL_IDS.items() if i and handle.kt_impl_missing(i) == 0]


# ---------------------------------------------------------------------------------------------- split, run, collect

def split(count: int, parts: int) -> list[tuple[int, int]]:
    """[0, count) as `parts` contiguous ranges of near-equal length (none empty; one empty range when count is 0)."""
    parts = max(1, min(int(parts), count))
    bounds = [count * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _submit(fn, items: range, workers: int) -> list:
    """Submit fn(i) for i in items to a shared pool of at least ``workers`` threads (ctypes calls release the
    GIL). Done under the lock, so a pool is never shut down between being picked and being used."""
    with _lock:
        if _state.get("pool_size", 0) < workers:
            old = _state.get("pool")
            _state["pool"] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ktnative")
            _state["pool_size"] = workers
            if old is not None:
                old.shutdown(wait=False)  # work already queued on it still runs
        return [_state["pool"].submit(fn, i) for i in items]


def run_ranges(fn: Callable, count: int, parts: int, *, what: str, name: str | None = None, found=None,
               w_bf16: np.ndarray | None = None) -> None:
    """The split-run-collect loop of every native call that threads can share.

    [0, count) is split into `parts` ranges; ``fn(begin, end, err_row) -> status`` runs for each (the first range
    on the calling thread, the others on the shared pool); err_row is an int64 [1] array the C function may set to
    the first row holding NaN/Inf. Raises NumericError naming row and column (KT_E_NONFINITE; `w_bf16` uint16
    [n, k] is the input searched for the column) or NativeError naming `what`, `name` and `found` (other statuses).
    """
    import numpy as np

    ranges = split(count, parts)
    err_rows = np.full(len(ranges), -1, dtype=np.int64)

    def one(i: int) -> int:
        return fn(ranges[i][0], ranges[i][1], err_rows[i:i + 1])

    futures = _submit(one, range(1, len(ranges)), len(ranges) - 1) if len(ranges) > 1 else []
    statuses = [one(0)] + [f.result() for f in futures]
    if w_bf16 is not None and KT_E_NONFINITE in statuses:
        raise_nonfinite(w_bf16, int(min(r for r, s in zip(err_rows, statuses) if s == KT_E_NONFINITE)), name)
    check_status(next((s for s in statuses if s != KT_OK), KT_OK), what, name, found)


def check_status(status: int, what: str, name: str | None = None, found=None) -> None:
    """NativeError "<what> failed: <reason> (<status>)" naming tensor `name` unless status is KT_OK."""
    if status != KT_OK:
        raise NativeError(f"{what} failed: {STATUS_TEXT.get(status, 'status')} ({status})", tensor=name, found=found)


def raise_nonfinite(w_bf16: np.ndarray, row: int, name: str | None) -> None:
    """NumericError naming the first NaN/Inf of uint16 [n, k] BF16 bits `w_bf16` in `row`."""
    import numpy as np

    special = (w_bf16 & np.uint16(0x7F80)) == np.uint16(0x7F80)
    col = int(np.flatnonzero(special[row])[0])
    kind = "NaN" if w_bf16[row, col] & np.uint16(0x007F) else "Inf"
    raise NumericError(f"{int(special.sum())} non-finite value(s), first {kind} at row {row}, column {col}",
                       tensor=name, hint="the source checkpoint is corrupt at this tensor")


# ---------------------------------------------------------------------------------------------- AMX quantize + tiles

def _amx_signatures() -> dict:
    import numpy as np

    return {"kt_amx_quantize": (_INT, [array(np.uint16), _I64, _I64, _INT, _INT, out_array(np.uint8),
                                       out_array(np.float32), _I64, _I64, out_array(np.int64, nullable=True)]),
            "kt_amx_quantize_rows": (_INT, [np.ctypeslib.ndpointer(dtype=np.uint16, flags="ALIGNED"), _I64, _I64,
                                            _I64, _INT, _INT, out_array(np.uint8), out_array(np.float32), _I64,
                                            _I64, out_array(np.int64, nullable=True)])}


def amx_lib() -> ctypes.CDLL:
    """The library with kt_amx_quantize bound (NativeError when it is missing)."""
    return bound_or_raise(_amx_signatures, "kt_amx_quantize")


def check_amx_input(w_bf16: np.ndarray, bits: int, name: str | None) -> None:
    """ShapeError unless w_bf16 is uint16 [n, k] with n % 32 == 0 and k % (128 for bits 4, 64 for bits 8) == 0."""
    import numpy as np

    if bits not in (4, 8):
        raise ShapeError("unsupported AMX bit width", tensor=name, expected="4 or 8", found=bits)
    if not isinstance(w_bf16, np.ndarray) or w_bf16.dtype != np.uint16 or w_bf16.ndim != 2:
        found = f"{getattr(w_bf16, 'dtype', type(w_bf16).__name__)} {list(getattr(w_bf16, 'shape', ()))}"
        raise ShapeError("weights must be BF16 bits", tensor=name, expected="uint16 [n, k]", found=found)
    n, k = w_bf16.shape
    k_multiple = 128 if bits == 4 else 64
    if n <= 0 or k <= 0 or n % 32 or k % k_multiple:
        raise ShapeError(f"AMXINT{bits} needs n % 32 == 0 and k % {k_multiple} == 0", tensor=name,
                         expected=f"[n, k] with n a multiple of 32, k a multiple of {k_multiple}", found=[n, k])


def amx_quantize(w_bf16: np.ndarray, bits: int, threads: int = 1, impl: str | None = None,
                 name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """AMXINT4 (bits=4) / AMXINT8 (bits=8) quantization and tile packing (kt-format.md 2.1, 2.2) in C.

    w_bf16: uint16 [n, k] BF16 bits (n % 32 == 0; k % 128 == 0 for bits 4, k % 64 == 0 for bits 8); rows may lie
    apart (a column slice of a wider matrix: read in place, not copied).
    threads: worker threads; N-blocks are split between them, the bytes never depend on it.
    impl: None (automatic, KTCONVERT_FORCE_IMPL honoured) or "scalar" | "avx2" | "avx512".
    name: tensor name used in error messages.
    returns: (blob uint8 [n*k/2] or [n*k] in kt-kernel's tile order, scale float32 [n] = d per row);
    byte-identical to ktconvert.quant.amx_rows + ktconvert.layouts.tiles.
    Raises ShapeError, NumericError (NaN/Inf: names the first row and column), NativeError (library missing,
    unsupported impl).
    """
    import numpy as np

    check_amx_input(w_bf16, bits, name)
    impl_id = resolve_impl(impl)
    handle = amx_lib()
    n, k = w_bf16.shape
    rows_apart = w_bf16.strides[1] == 2 and w_bf16.strides[0] >= 2 * k and w_bf16.strides[0] % 2 == 0
    w = w_bf16 if rows_apart and w_bf16.flags.aligned else np.ascontiguousarray(w_bf16)
    ld = w.strides[0] // 2
    blob = np.empty(n * k // (2 if bits == 4 else 1), dtype=np.uint8)
    scale = np.empty(n, dtype=np.float32)
    run_ranges(lambda begin, end, err: handle.kt_amx_quantize_rows(w, n, k, ld, bits, impl_id, blob, scale, begin,
                                                                   end, err),
               int(handle.kt_amx_nblocks(n, bits)), threads, what="kt_amx_quantize", name=name,
               found=f"[n, k] = [{n}, {k}], bits {bits}", w_bf16=w)
    return blob, scale

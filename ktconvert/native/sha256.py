"""ctypes bindings of the native multi-stream SHA-256 (native/sha256_multi.c): ``Sha256``, hashlib's interface on
the native state; ``new()``, the file hasher ``fileio`` uses; ``sha256_multi``, several streams updated at once on
one thread.

Every update of a ``Sha256`` goes through the library's shared lane (``kt_sha256_update_shared``): threads hashing at
the same moment have their streams interleaved two at a time on one core (SHA-NI's round chain is latency-bound; two
chains fill it), with no copy of the data and no queue; one stream alone runs at one-stream speed. ``new()`` gives
a ``Sha256`` where the library runs SHA-NI and ``hashlib.sha256()`` otherwise: both give the standard digest.

``impl``: None (automatic: "sha-ni" where the CPU has the SHA extensions, unless KTCONVERT_FORCE_IMPL=scalar or
KTCONVERT_DISABLE_CPU_FEATURES=sha) or "portable" | "sha-ni" (NativeError when the CPU lacks it).
"""
from __future__ import annotations

import ctypes
import hashlib

from ktconvert import native
from ktconvert.errors import NativeError

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
IMPL_IDS = {None: 0, "portable": 1, "sha-ni": 2}
_State = ctypes.c_uint32 * 8
BUFFER_BYTES = 4096     # updates smaller than this are gathered before C hashes them


def _signatures() -> dict:
    return {
        "kt_sha256_impl": (_INT, [_INT]),
        "kt_sha256_impl_name": (ctypes.c_char_p, [_INT]),
        "kt_sha256_init": (None, [_P]),
        "kt_sha256_blocks": (_INT, [_P, _P, _I64, _INT]),
        "kt_sha256_update_shared": (_INT, [_P, _P, _I64, _INT]),
        "kt_sha256_multi": (_INT, [_INT, _P, _P, _P, _INT]),
        "kt_sha256_finish": (_INT, [_P, _P, _I64, ctypes.c_uint64, _P, _INT]),
    }


def available() -> bool:
    """Whether the native SHA-256 can be used (library built with it and not disabled)."""
    return native.available() and native.bind(_signatures) is not None


def _resolve(impl: str | None) -> tuple[ctypes.CDLL, int]:
    handle = native.bound_or_raise(_signatures, "the native sha256")
    if impl not in IMPL_IDS:
        raise NativeError("unknown sha256 implementation", expected="portable | sha-ni", found=repr(impl))
    chosen = handle.kt_sha256_impl(IMPL_IDS[impl])
    if chosen <= 0:
        raise NativeError(f"sha256 implementation {impl}: this CPU lacks the SHA extensions")
    return handle, chosen


def implementation(impl: str | None = None) -> str:
    """"sha-ni" | "portable": what a hasher with `impl` runs here (NativeError as Sha256)."""
    handle, chosen = _resolve(impl)
    return handle.kt_sha256_impl_name(chosen).decode()


def usable_impls() -> list[str]:
    """The implementations that run here ("portable", and "sha-ni" where the CPU has it); [] without the library."""
    if not available():
        return []
    handle = native.bind(_signatures)
    return [name for name, i in IMPL_IDS.items() if name and handle.kt_sha256_impl(i) > 0]


def _address(view: memoryview) -> int:
    """Address of the first byte of non-empty contiguous `view` (read-only buffers too; the caller keeps `view`
    alive while C reads it)."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


class Sha256:
    """SHA-256 with hashlib's interface (``update``, ``digest``, ``hexdigest``, ``copy``, ``name``, ``digest_size``,
    ``block_size``), whole blocks hashed in the native library through its shared lane (see the module).
    One object must not be updated from two threads at once (hashlib's objects lock; these do not)."""

    name = "sha256"
    digest_size = 32
    block_size = 64
    __slots__ = ("_lib", "_impl", "_state", "_tail", "_length")

    def __init__(self, data=b"", *, impl: str | None = None):
        self._lib, self._impl = _resolve(impl)
        self._state = _State()
        self._lib.kt_sha256_init(ctypes.addressof(self._state))
        self._tail = bytearray()
        self._length = 0
        if data:
            self.update(data)

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self._length += len(view)
        if len(self._tail) + len(view) < BUFFER_BYTES:      # small updates gather here: one C call per few KiB
            self._tail += view
            return
        view = self._absorb_tail(view)
        whole = len(view) // 64
        if whole:
            self._blocks(view, whole)
        self._tail += view[whole * 64:]

    def _absorb_tail(self, view: memoryview) -> memoryview:
        """Complete the pending bytes to whole blocks from the front of `view` and hash them; the rest of `view`."""
        tail = self._tail
        if not tail:
            return view
        take = min(-len(tail) % 64, len(view))
        tail += view[:take]
        whole = len(tail) // 64
        if whole:
            self._blocks(memoryview(tail), whole)
            del tail[:whole * 64]
        return view[take:]

    def _blocks(self, view: memoryview, nblocks: int) -> None:
        status = self._lib.kt_sha256_update_shared(ctypes.addressof(self._state), _address(view), nblocks, self._impl)
        native.check_status(status, "kt_sha256_update_shared")

    def digest(self) -> bytes:
        state = _State.from_buffer_copy(self._state)       # the object itself goes on unchanged
        tail = bytes(self._tail)
        whole = len(tail) // 64
        if whole:
            native.check_status(self._lib.kt_sha256_blocks(ctypes.addressof(state), tail, whole, self._impl),
                                "kt_sha256_blocks")
        out = ctypes.create_string_buffer(32)
        rest = tail[whole * 64:]
        status = self._lib.kt_sha256_finish(ctypes.addressof(state), rest, len(rest), self._length, out, self._impl)
        native.check_status(status, "kt_sha256_finish")
        return out.raw

    def hexdigest(self) -> str:
        return self.digest().hex()

    def copy(self) -> Sha256:
        other = Sha256.__new__(Sha256)
        other._lib, other._impl = self._lib, self._impl
        other._state = _State.from_buffer_copy(self._state)
        other._tail = bytearray(self._tail)
        other._length = self._length
        return other


def new(data=b""):
    """A SHA-256 hasher: ``Sha256`` where the library runs SHA-NI here, else ``hashlib.sha256`` (OpenSSL's vector code
    outruns the portable C; KTCONVERT_DISABLE_CPU_FEATURES=sha selects it too). The same digests either way."""
    return Sha256(data) if runs_sha_ni() else hashlib.sha256(data)


def runs_sha_ni() -> bool:
    """Whether ``new()`` gives the native hasher here (the library runs SHA-NI by default)."""
    if "sha-ni" not in _cache:
        _cache["sha-ni"] = available() and implementation() == "sha-ni"
    return _cache["sha-ni"]


_cache: dict[str, bool] = {}


def sha256_multi(states: list, pieces: list, impl: str | None = None) -> None:
    """Update each ``Sha256`` of `states` by the bytes-like piece of `pieces` at the same index, all on this thread,
    two streams interleaved at a time (each piece's tail below a whole block is kept for the next update, as
    ``update`` does)."""
    if len(states) != len(pieces):
        raise ValueError(f"{len(states)} states but {len(pieces)} pieces")
    handle, chosen = _resolve(impl)
    views, state_ptrs, data_ptrs, counts = [], [], [], []
    for h, piece in zip(states, pieces):
        view = memoryview(piece).cast("B")
        h._length += len(view)
        view = h._absorb_tail(view)     # pending bytes completed to whole blocks first, on their own
        whole = len(view) // 64
        if whole:
            views.append(view)
            state_ptrs.append(ctypes.addressof(h._state))
            data_ptrs.append(_address(view))
            counts.append(whole)
        h._tail += view[whole * 64:]
    n = len(counts)
    if n:
        status = handle.kt_sha256_multi(n, (_P * n)(*state_ptrs), (_P * n)(*data_ptrs), (_I64 * n)(*counts), chosen)
        native.check_status(status, "kt_sha256_multi")

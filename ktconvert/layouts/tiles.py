"""AMX tile orders of kt-kernel's BufferB as int64 index permutations (kt-format.md §2.1, §2.2).

A blob is ordered, outermost first: N-blocks (128 rows INT4, 64 rows INT8) -> K-blocks of 3584 columns (the last
one shorter) -> 32-row panels -> tiles of 128 (INT4) / 64 (INT8) columns, 2048 bytes each. A tile is two 1024-byte
halves (rows 0-15, 16-31), each a 16x16 grid of dwords whose rows are k-quads and whose columns are weight rows
(the transposed VNNI layout). INT4 puts tile column j in the low nibble and column j + 64 in the high nibble.

For a shape (n, k) we build ``perm``: int64 [n * k], ``perm[slot] = r * k + c``, where ``slot`` is the byte offset
(INT8) or ``2 * byte + nibble`` (INT4, nibble 0 = low). Packing is then one ``np.take`` and unpacking one scatter.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ktconvert.errors import ShapeError

K_BLOCK = 3584
N_STEP = 32                 # rows per panel; n % 32 == 0
INT4_N_BLOCK, INT4_TILE_K = 128, 128
INT8_N_BLOCK, INT8_TILE_K = 64, 64


def _check_shape(n: int, k: int, k_multiple: int, name: str) -> None:
    if n <= 0 or k <= 0 or n % N_STEP or k % k_multiple:
        raise ShapeError(f"{name} tile layout needs n % {N_STEP} == 0 and k % {k_multiple} == 0",
                         expected=f"[n, k] with n a positive multiple of {N_STEP}, k of {k_multiple}",
                         found=f"[{n}, {k}]")


def _block_slots(nbs: int, k: int, tile_k: int, nibbles: bool) -> np.ndarray:
    """int64 [nbs, k]: slot of each element of one N-block of nbs rows, relative to the block start.

    Byte (per element units of the block, before the INT4 halving):
      kb0*nbs + s0*kbs + t0*32 + (rr//16)*1024*u + (j//4)*64 + (rr%16)*4 + j%4
    with u = 2 for INT4 (the tile-internal terms are already bytes), j = column within the 64-wide byte group.
    """
    r = np.arange(nbs, dtype=np.int64)[:, None]
    c = np.arange(k, dtype=np.int64)[None, :]
    kb0 = (c // K_BLOCK) * K_BLOCK
    kbs = np.minimum(K_BLOCK, k - kb0)
    s0, rr = (r // N_STEP) * N_STEP, r % N_STEP
    c1 = c - kb0
    t0, cc = (c1 // tile_k) * tile_k, c1 % tile_k
    tile_elems = kb0 * nbs + s0 * kbs + t0 * N_STEP          # element offset of the tile (2 per byte for INT4)
    j = cc % 64
    inner = (rr // 16) * 1024 + (j // 4) * 64 + (rr % 16) * 4 + j % 4
    if not nibbles:
        return tile_elems + inner
    return tile_elems + 2 * inner + (cc >= 64)               # (tile_elems/2 + inner) * 2 + nibble


@lru_cache(maxsize=4)   # one method converts two shapes (gate/up, down): ~2 x 8 bytes x n x k
def _permutation(n: int, k: int, n_block: int, tile_k: int, nibbles: bool) -> np.ndarray:
    """int64 [n * k] with perm[slot] = r * k + c; read-only, cached per shape."""
    perm = np.empty(n * k, dtype=np.int64)
    flat = np.arange(n_block * k, dtype=np.int64)
    for nb0 in range(0, n, n_block):
        nbs = min(n_block, n - nb0)
        slots = _block_slots(nbs, k, tile_k, nibbles).ravel() + nb0 * k
        perm[slots] = flat[: nbs * k] + nb0 * k
    perm.flags.writeable = False
    return perm


def int4_permutation(n: int, k: int) -> np.ndarray:
    """int64 [n * k]: element (row-major flat index) held by nibble slot 2*byte + (0 low | 1 high) of an INT4 blob."""
    _check_shape(n, k, INT4_TILE_K, "INT4")
    return _permutation(n, k, INT4_N_BLOCK, INT4_TILE_K, True)


def int8_permutation(n: int, k: int) -> np.ndarray:
    """int64 [n * k]: element (row-major flat index) held by byte ``slot`` of an INT8 blob."""
    _check_shape(n, k, INT8_TILE_K, "INT8")
    return _permutation(n, k, INT8_N_BLOCK, INT8_TILE_K, False)


def _codes_2d(codes: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(codes, np.ndarray) or codes.ndim != 2 or codes.dtype != np.int8:
        raise ShapeError(f"{name} codes must be a 2-D int8 array", expected="int8 [n, k]",
                         found=f"{getattr(codes, 'dtype', type(codes).__name__)} {list(getattr(codes, 'shape', ()))}")
    return codes


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int8 [n, k] codes in -8..7 -> uint8 [n*k/2] AMXINT4 blob (n % 32 == 0, k % 128 == 0, else ShapeError)."""
    n, k = _codes_2d(codes, "INT4 tile").shape
    if codes.size and (codes.min() < -8 or codes.max() > 7):
        raise ShapeError("INT4 tile codes out of the 4-bit range", expected="-8..7 (kt-kernel needs -7..7)",
                         found=f"{int(codes.min())}..{int(codes.max())}")
    pairs = np.ascontiguousarray(codes).ravel().take(int4_permutation(n, k)).view(np.uint8).reshape(-1, 2)
    return (pairs[:, 0] & np.uint8(0x0F)) | (pairs[:, 1] << np.uint8(4))


def unpack_int4(blob: np.ndarray, n: int, k: int) -> np.ndarray:
    """uint8 [n*k/2] AMXINT4 blob -> int8 [n, k] codes (nibbles sign-extended from 4 bits)."""
    perm = int4_permutation(n, k)
    raw = _blob_bytes(blob, n * k // 2, "INT4 tile")
    nibbles = np.empty(n * k, dtype=np.uint8)
    nibbles[0::2] = raw << np.uint8(4)
    nibbles[1::2] = raw & np.uint8(0xF0)
    codes = np.empty(n * k, dtype=np.int8)
    codes[perm] = nibbles.view(np.int8) >> 4               # arithmetic shift sign-extends
    return codes.reshape(n, k)


def pack_int8(codes: np.ndarray) -> np.ndarray:
    """int8 [n, k] codes -> uint8 [n*k] AMXINT8 blob (n % 32 == 0, k % 64 == 0, else ShapeError)."""
    n, k = _codes_2d(codes, "INT8 tile").shape
    return np.ascontiguousarray(codes).ravel().take(int8_permutation(n, k)).view(np.uint8)


def unpack_int8(blob: np.ndarray, n: int, k: int) -> np.ndarray:
    """uint8 [n*k] AMXINT8 blob -> int8 [n, k] codes."""
    perm = int8_permutation(n, k)
    raw = _blob_bytes(blob, n * k, "INT8 tile")
    codes = np.empty(n * k, dtype=np.int8)
    codes[perm] = raw.view(np.int8)
    return codes.reshape(n, k)


def _blob_bytes(blob: np.ndarray, nbytes: int, name: str) -> np.ndarray:
    """Any 1-byte-dtype array (or bytes) -> flat uint8 view; ShapeError if the size is not nbytes."""
    raw = np.frombuffer(blob, dtype=np.uint8) if isinstance(blob, (bytes, bytearray, memoryview)) \
        else np.ascontiguousarray(blob).reshape(-1).view(np.uint8)
    if raw.size != nbytes:
        raise ShapeError(f"{name} blob has the wrong size", expected=f"{nbytes} bytes", found=f"{raw.size} bytes")
    return raw

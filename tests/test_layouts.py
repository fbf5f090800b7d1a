"""AMX tile layouts and the NUMA split, against references written here from kt-format.md §2.0-2.2.

Two independent references for the tile order: (1) the per-element byte formula of the spec in plain Python loops,
(2) a re-enactment of kt-kernel's packing loops (N-block -> K-block -> 32-row panel -> tile; each row's 64 bytes
row-major, then a 16x16 dword transpose of each 1024-byte half).
"""
from __future__ import annotations

import numpy as np
import pytest

from ktconvert.errors import ShapeError
from ktconvert.formats.base import ExpertWeights
from ktconvert.layouts import tiles
from ktconvert.layouts.numa import numa_slices, split_expert
from ktconvert.methods import METHODS
from ktconvert.methods.amx import AmxInt4, AmxInt8


def random_codes(rng, n, k, lo, hi):
    return rng.integers(lo, hi + 1, (n, k)).astype(np.int8)


# ----------------------------------------------------------------------------------------------------------------
# reference 1: the spec's byte formula, element by element


def spec_tile_start(r, c, n, k, n_block, tile_k):
    """(tile offset in elements, row rr in the 32-row panel, column cc in the tile) per the spec's block walk."""
    nb0 = (r // n_block) * n_block
    nbs = min(n_block, n - nb0)
    kb0 = (c // 3584) * 3584
    kbs = min(3584, k - kb0)
    r1 = r - nb0
    s0 = (r1 // 32) * 32
    rr = r1 - s0
    c1 = c - kb0
    t0 = (c1 // tile_k) * tile_k
    cc = c1 - t0
    return nb0 * k + kb0 * nbs + s0 * kbs + t0 * 32, rr, cc


def spec_byte_int4(r, c, n, k):
    start, rr, cc = spec_tile_start(r, c, n, k, 128, 128)
    tile = start // 2
    j = cc % 64
    byte = tile + (rr // 16) * 1024 + (j // 4) * 64 + (rr % 16) * 4 + (j % 4)
    return byte, cc >= 64


def spec_byte_int8(r, c, n, k):
    start, rr, cc = spec_tile_start(r, c, n, k, 64, 64)
    return start + (rr // 16) * 1024 + (cc // 4) * 64 + (rr % 16) * 4 + (cc % 4)


def spec_pack_int4(codes):
    n, k = codes.shape
    out = bytearray(n * k // 2)
    for r in range(n):
        for c in range(k):
            byte, high = spec_byte_int4(r, c, n, k)
            nib = int(codes[r, c]) & 0xF
            out[byte] |= (nib << 4) if high else nib
    return np.frombuffer(bytes(out), np.uint8)


def spec_pack_int8(codes):
    n, k = codes.shape
    out = bytearray(n * k)
    for r in range(n):
        for c in range(k):
            out[spec_byte_int8(r, c, n, k)] = int(codes[r, c]) & 0xFF
    return np.frombuffer(bytes(out), np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# reference 2: the packing loops


def transpose_halves(tile_rows):
    """uint8 [32, 64] row-major tile -> 2048 bytes: each 16-row half as a 16x16 dword grid, transposed."""
    halves = []
    for h in range(2):
        dwords = tile_rows[16 * h: 16 * h + 16].copy().view(np.uint32)        # [16 rows, 16 dwords]
        halves.append(np.ascontiguousarray(dwords.T).view(np.uint8).ravel())
    return np.concatenate(halves)


def loop_pack(codes, n_block, tile_k, nibbles):
    n, k = codes.shape
    chunks = []
    for nb0 in range(0, n, n_block):
        nbs = min(n_block, n - nb0)
        for kb0 in range(0, k, 3584):
            kbs = min(3584, k - kb0)
            for s0 in range(nb0, nb0 + nbs, 32):
                for t0 in range(kb0, kb0 + kbs, tile_k):
                    block = codes[s0:s0 + 32, t0:t0 + tile_k].view(np.uint8)
                    if nibbles:
                        block = (block[:, :64] & 0x0F) | (block[:, 64:] << 4)
                    chunks.append(transpose_halves(np.ascontiguousarray(block)))
    return np.concatenate(chunks)


# ----------------------------------------------------------------------------------------------------------------
# golden worked examples (kt-format.md §2.1, §2.2)


def test_int4_worked_example_byte_3204_high_nibble():
    codes = np.zeros((128, 256), np.int8)
    codes[17, 200] = -3
    blob = tiles.pack_int4(codes)
    assert blob.size == 16384
    assert np.flatnonzero(blob).tolist() == [3204]
    assert blob[3204] == 0xD0                       # -3 & 0xF = 0xD in the high nibble
    assert tiles.unpack_int4(blob, 128, 256)[17, 200] == -3


def test_int8_worked_example_byte_6242():
    codes = np.zeros((64, 128), np.int8)
    codes[40, 70] = -100
    blob = tiles.pack_int8(codes)
    assert np.flatnonzero(blob).tolist() == [6242]
    assert blob[6242] == 156                        # -100 as a byte


# ----------------------------------------------------------------------------------------------------------------
# fast packers == references


@pytest.mark.parametrize("shape", [(32, 128), (160, 256), (64, 384)])
def test_pack_int4_matches_spec_formula(shape):
    codes = random_codes(np.random.default_rng(shape[0]), *shape, -8, 7)
    assert np.array_equal(tiles.pack_int4(codes), spec_pack_int4(codes))


@pytest.mark.parametrize("shape", [(32, 64), (96, 128), (160, 192)])
def test_pack_int8_matches_spec_formula(shape):
    codes = random_codes(np.random.default_rng(shape[0]), *shape, -128, 127)
    assert np.array_equal(tiles.pack_int8(codes), spec_pack_int8(codes))


def test_spec_formula_and_packing_loops_agree_with_k_tail():
    """The two references agree with each other (element loop on a K-tail shape, INT8 to keep it quick)."""
    codes = random_codes(np.random.default_rng(1), 32, 3712, -128, 127)
    assert np.array_equal(spec_pack_int8(codes), loop_pack(codes, 64, 64, False))


@pytest.mark.parametrize("shape", [(288, 3712), (160, 7296), (32, 3584)])
def test_pack_int4_matches_packing_loops(shape):
    """K-block tails (3712 = 3584 + 128, 7296 = 2*3584 + 128), several and partial N-blocks (288 = 2*128 + 32)."""
    codes = random_codes(np.random.default_rng(shape[1]), *shape, -8, 7)
    assert np.array_equal(tiles.pack_int4(codes), loop_pack(codes, 128, 128, True))


@pytest.mark.parametrize("shape", [(224, 3712), (96, 7232), (32, 3584)])
def test_pack_int8_matches_packing_loops(shape):
    codes = random_codes(np.random.default_rng(shape[1]), *shape, -128, 127)
    assert np.array_equal(tiles.pack_int8(codes), loop_pack(codes, 64, 64, False))


# ----------------------------------------------------------------------------------------------------------------
# properties


@pytest.mark.parametrize("shape", [(32, 128), (160, 3712), (288, 256)])
def test_round_trip_and_permutation(shape):
    rng = np.random.default_rng(9)
    c4 = random_codes(rng, *shape, -8, 7)
    c8 = random_codes(rng, *shape, -128, 127)
    assert np.array_equal(tiles.unpack_int4(tiles.pack_int4(c4), *shape), c4)
    assert np.array_equal(tiles.unpack_int8(tiles.pack_int8(c8), *shape), c8)
    for perm in (tiles.int4_permutation(*shape), tiles.int8_permutation(*shape)):
        assert perm.dtype == np.int64
        assert np.array_equal(np.sort(perm), np.arange(shape[0] * shape[1]))


def test_unpack_accepts_int8_views_and_bytes():
    codes = random_codes(np.random.default_rng(2), 64, 128, -7, 7)
    blob = tiles.pack_int4(codes)
    assert np.array_equal(tiles.unpack_int4(blob.view(np.int8), 64, 128), codes)
    assert np.array_equal(tiles.unpack_int4(blob.tobytes(), 64, 128), codes)


@pytest.mark.parametrize("fn,shape", [(tiles.pack_int4, (48, 128)), (tiles.pack_int4, (32, 64)),
                                      (tiles.pack_int8, (32, 96)), (tiles.pack_int8, (0, 64))])
def test_pack_shape_errors(fn, shape):
    with pytest.raises(ShapeError, match="n % 32 == 0"):
        fn(np.zeros(shape, np.int8))


def test_pack_rejects_wrong_dtype_and_range_and_unpack_wrong_size():
    with pytest.raises(ShapeError):
        tiles.pack_int8(np.zeros((32, 64), np.int16))
    with pytest.raises(ShapeError, match="4-bit range"):
        tiles.pack_int4(np.full((32, 128), 9, np.int8))
    with pytest.raises(ShapeError, match="2048 bytes"):
        tiles.unpack_int4(np.zeros(100, np.uint8), 32, 128)


# ----------------------------------------------------------------------------------------------------------------
# NUMA split


def _expert(rng, inter, hidden, bias=False):
    bits = lambda *s: rng.integers(0, 1 << 15, s).astype(np.uint16)  # noqa: E731
    ew = ExpertWeights(bits(inter, hidden), bits(inter, hidden), bits(hidden, inter))
    if bias:
        ew.gate_bias, ew.up_bias = rng.standard_normal(inter), rng.standard_normal(inter)
        ew.down_bias = rng.standard_normal(hidden)
    return ew


@pytest.mark.parametrize("parts", [1, 2, 3, 6])
def test_split_expert_parts_concatenate_back(parts):
    ew = _expert(np.random.default_rng(parts), 768, 256, bias=True)
    split = split_expert(ew, parts)
    assert len(split) == parts
    for p in split:
        assert p.gate.shape == (768 // parts, 256) and p.down.shape == (256, 768 // parts)
        assert p.down.flags.c_contiguous
    assert np.array_equal(np.concatenate([p.gate for p in split]), ew.gate)
    assert np.array_equal(np.concatenate([p.up for p in split]), ew.up)
    assert np.array_equal(np.concatenate([p.down for p in split], axis=1), ew.down)
    assert np.array_equal(np.concatenate([p.gate_bias for p in split]), ew.gate_bias)
    assert np.array_equal(np.concatenate([p.up_bias for p in split]), ew.up_bias)
    assert np.array_equal(sum(p.down_bias for p in split), ew.down_bias)


def test_split_expert_part_one_holds_second_rows_and_columns():
    """kt-format.md §2.1 worked example: part 1 of I=256, T=2 holds gate rows 128..255 and down columns 128..255."""
    ew = _expert(np.random.default_rng(0), 256, 256)
    part1 = split_expert(ew, 2)[1]
    assert np.array_equal(part1.gate[0], ew.gate[128]) and np.array_equal(part1.down[:, 0], ew.down[:, 128])


def test_split_expert_errors():
    ew = _expert(np.random.default_rng(0), 768, 256)
    with pytest.raises(ShapeError, match="I=768, T=5"):
        split_expert(ew, 5)
    with pytest.raises(ShapeError):
        split_expert(ExpertWeights(ew.gate, ew.up, ew.down.T), 2)
    assert [s.start for s in numa_slices(12, 3)] == [0, 4, 8]


def test_valid_numa_counts():
    # kt-format.md §2.0 item 5: Qwen3-30B-A3B (I=768, H=2048) works with T=2 but not T=4 for INT4
    assert METHODS.get("amxint4").valid_numa(2048, 768) == [1, 2, 3, 6]
    assert AmxInt8.valid_numa(2048, 768) == [1, 2, 3, 4, 6, 12]
    assert METHODS.get("int4").valid_numa(7168, 2048) == [1, 2, 4, 8, 16]
    assert METHODS.get("int4").valid_numa(2000, 768) == []            # H itself breaks the tile rule
    for t in AmxInt4.valid_numa(4096, 1536):
        AmxInt4.check_shape(1536 // t, 4096)
        AmxInt4.check_shape(4096, 1536 // t)

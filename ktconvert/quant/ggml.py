"""ggml (GGUF) tensor types: names, block geometry, and dequantization to float32 or BF16 bits.

Dequantization runs in C (ktconvert.native.gguf) for the types the native library implements and through gguf-py's
numpy ``gguf.quants.dequantize`` (imported lazily) for the rest; both give the same bits. ``impl``: None (native
where possible, KTCONVERT_FORCE_IMPL honoured), "numpy" (gguf-py), or "scalar" | "avx2" | "avx512".
"""
from __future__ import annotations

import numpy as np

from ktconvert.errors import InputError, ShapeError
from ktconvert.native import gguf as native_gguf
from ktconvert.quant.bf16 import f32_to_bf16_bits

# ggml type id -> (name, elements per block, bytes per block)   (ggml.h; gguf.constants.GGML_QUANT_SIZES)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36),
}
# Types gguf-py 0.19 `dequantize` implements: the ones an expert weight may have.
DEQUANT_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
    "MXFP4", "NVFP4",
})
TYPE_IDS = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}


def type_name(ggml_type: int | str) -> str:
    """"Q4_K" for 12 (a name is returned as is); "type N" for an id this table does not know."""
    if isinstance(ggml_type, str):
        return ggml_type
    entry = GGML_TYPES.get(int(ggml_type))
    return entry[0] if entry else f"type {int(ggml_type)}"


def type_id(ggml_type: int | str) -> int:
    """The ggml type id of an id or a name ("Q4_K" -> 12); InputError for an unknown name."""
    if not isinstance(ggml_type, str):
        return int(ggml_type)
    if ggml_type not in TYPE_IDS:
        raise InputError("unknown ggml tensor type", expected="one of " + ", ".join(sorted(TYPE_IDS)),
                         found=ggml_type)
    return TYPE_IDS[ggml_type]


def supported(ggml_type: int | str) -> bool:
    """True when tensors of this type can be dequantized (natively or by gguf-py)."""
    return type_name(ggml_type) in DEQUANT_TYPES


def native_supported(ggml_type: int | str) -> bool:
    """True when the native library is loaded and dequantizes this type in C."""
    return supported(ggml_type) and native_gguf.supports(type_id(ggml_type))


def geometry(ggml_type: int | str) -> tuple[int, int]:
    """(elements, bytes) per block; InputError for an unknown type."""
    entry = GGML_TYPES.get(type_id(ggml_type))
    if entry is None:
        raise InputError("unknown ggml tensor type", expected="one of " + ", ".join(sorted(TYPE_IDS)),
                         found=f"type id {int(ggml_type)}")
    return entry[1], entry[2]


def packed_bytes(ggml_type: int | str, n_elements: int, row: int | None = None) -> int:
    """Bytes of `n_elements` values stored as `ggml_type`. row (the innermost dimension) must be a whole number of
    blocks, else ShapeError."""
    elems, nbytes = geometry(ggml_type)
    if (row if row is not None else n_elements) % elems:
        raise ShapeError(f"row size is not a multiple of the {type_name(ggml_type)} block size",
                         expected=f"a multiple of {elems}", found=row if row is not None else n_elements)
    return n_elements // elems * nbytes


def _use_native(ggml_type: int | str, impl: str | None) -> bool:
    if impl == "numpy":
        return False
    if impl is not None:
        return True  # an explicit ISA: the native call raises if it cannot run it
    return native_supported(ggml_type)


def _numpy_f32(raw: np.ndarray, ggml_type: int | str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    with np.errstate(all="ignore"):
        out = quants.dequantize(np.ascontiguousarray(raw).reshape(-1).view(np.uint8),
                                GGMLQuantizationType(type_id(ggml_type)))
    return np.asarray(out, dtype=np.float32).reshape(-1)


def _check(raw: np.ndarray, ggml_type: int | str, name: str | None) -> None:
    if not supported(ggml_type):
        raise InputError(f"ggml type {type_name(ggml_type)} cannot be dequantized", tensor=name,
                         expected="one of " + ", ".join(sorted(DEQUANT_TYPES)), found=type_name(ggml_type))
    nbytes = geometry(ggml_type)[1]
    if raw.size % nbytes:
        raise ShapeError("packed data is not a whole number of blocks", tensor=name,
                         expected=f"a multiple of {nbytes} bytes ({type_name(ggml_type)})", found=f"{raw.size} bytes")


def dequantize(raw: np.ndarray, ggml_type: int | str, threads: int = 1, impl: str | None = None,
               name: str | None = None) -> np.ndarray:
    """Packed bytes (uint8, whole blocks) of type `ggml_type` (id or name) -> float32 [n_elements], flat; bits equal
    gguf-py's ``gguf.quants.dequantize``. name: tensor named in errors."""
    _check(raw, ggml_type, name)
    if _use_native(ggml_type, impl):
        return native_gguf.dequantize_f32(raw, type_id(ggml_type), threads=threads, impl=impl, name=name)
    return _numpy_f32(raw, ggml_type)


def dequantize_bf16(raw: np.ndarray, ggml_type: int | str, threads: int = 1, impl: str | None = None,
                    name: str | None = None) -> np.ndarray:
    """Packed bytes -> uint16 BF16 bits [n_elements], flat: f32_to_bf16_bits (RNE) of ``dequantize``."""
    _check(raw, ggml_type, name)
    if _use_native(ggml_type, impl):
        return native_gguf.dequantize_bf16(raw, type_id(ggml_type), threads=threads, impl=impl, name=name)
    return f32_to_bf16_bits(_numpy_f32(raw, ggml_type))


# byte offsets of the fp16 scale fields inside one block of each type
F16_FIELDS = {"F16": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
              "TQ1_0": (52,), "TQ2_0": (64,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
              "IQ3_S": (0,), "IQ1_S": (0,)}


def random_blocks(ggml_type: int | str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """uint8 [n_blocks * block bytes] of random blocks whose values are all finite (fp16 scale fields, F32 and BF16
    values get their exponent kept below all-ones): test and benchmark input."""
    name = type_name(ggml_type)
    nbytes = geometry(ggml_type)[1]
    raw = np.random.default_rng(seed).integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for off in F16_FIELDS.get(name, ()):
        h = np.ascontiguousarray(raw[:, off:off + 2]).view(np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)
        raw[:, off:off + 2] = h.view(np.uint8)
    if name == "F32":
        v = raw.view(np.uint32)
        v[(v & 0x7F800000) == 0x7F800000] &= np.uint32(0xBFFFFFFF)
    elif name == "BF16":
        v = raw.view(np.uint16)
        v[(v & 0x7F80) == 0x7F80] &= np.uint16(0xBFFF)
    return raw.reshape(-1)

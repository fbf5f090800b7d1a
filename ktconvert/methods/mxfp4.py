"""The in-place MXFP4 method: kt-kernel 0.7.2's ``MXFP4`` (DeepSeek-V4-Flash's native expert format,
kt-native-formats.md "MXFP4").

Per expert matrix ``model.layers.L.ffn.experts.E.{w1,w3,w2}`` (gate, up, down: the only names kt-kernel's
MXFP4SafeTensorLoader reads; it also finds them without the ``model.`` prefix, as DeepSeek-V4 stores them),
[n, k] = [out, in]:

* ``weight`` I8 [n, k/2]: E2M1 codes, element 2j in the low nibble of byte j, 2j+1 in the high nibble (bit 3 of a
  code is the sign);
* ``scale`` F8_E8M0 [n, k/32]: one exponent per 32 in-features, W = e2m1 * 2^(e - 127).

Encoders (the scale exponent is the encoder's choice; kt-kernel's decode is fixed):

* ``--quant rtn``: OCP MX, e = floor(log2(group amax)) - 2 (E2M1's emax), stored e + 127 clipped to [1, 254]
  (0 for an all-zero group, whose codes are all 0), codes e2m1(w / 2^e) rounded to nearest, ties to the even
  code, saturating at +-6. Groups encoded this way (gpt-oss's MXFP4) come back byte for byte.
* ``--quant mse``: per group the exponent among e - 1, e, e + 1 (OCP's, then one coarser, then one finer) with the
  least squared error of the decoded group, OCP's on ties.

Group 32 only: kt-kernel's AVX-512 kernel hard-codes 32-element groups and returns garbage for a 64-group file
(measured rel L2 3.2-7.4), its Python never checks. NUMA parts must hold whole groups (I/T % 32 == 0).

Carry-over: a source storing each routed expert matrix as exactly these tensors (DeepSeek-V4-Flash's
``ffn.experts.E.w{1,3,2}.{weight,scale}``) or as compressed-tensors ``mxfp4-pack-quantized``
(``weight_packed`` U8, ``weight_scale`` U8) is copied byte for byte under this method's names and dtype labels
(U8 bytes are the same as I8 / F8_E8M0 bytes). gpt-oss's fused, gate/up-interleaved MXFP4 is not stored per expert:
it is decoded and encoded again, and ``rtn`` gives its bytes back (its encoder is OCP's).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ktconvert.errors import KtConvertError, NumericError
from ktconvert.methods.base import TensorSpecs
from ktconvert.methods.inplace import InplaceMethod
from ktconvert.methods.native import e2m1_rne
from ktconvert.quant import nvfp4
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.quant.mxfp4 import E2M1_TO_F32, E8M0_BIAS

GROUP = 32
E2M1_EMAX = 2                      # 6 = 1.5 * 2^2
STORED_MIN, STORED_MAX = 1, 254    # kt-kernel loads 0 as the BF16 subnormal 2^-127 (it runs with FTZ/DAZ on); 255 NaN
# dtypes holding the same bytes: the output's dtype -> the source dtypes accepted for it
SAME_BYTES = {"I8": ("I8", "U8"), "F8_E8M0": ("F8_E8M0", "U8")}
# the input decoders' schemes whose per-expert tensors are this method's bytes -> what they are
SOURCE_FORMATS = {"deepseek-v4": "DeepSeek-V4 MXFP4 experts (E2M1, E8M0 exponent per 32 in-features)",
                  "mxfp4-pack-quantized": "compressed-tensors mxfp4-pack-quantized experts (E2M1, E8M0 exponent per "
                                          "32 in-features)"}


class Mxfp4(InplaceMethod):
    """OCP MXFP4 experts (E2M1 pairs, one E8M0 exponent per 32 in-features) under DeepSeek-V4's names."""

    name, kt_method, file_prefix = "mxfp4", "MXFP4", "MXFP4"
    expert_template: ClassVar[str] = "model.layers.{L}.ffn.experts.{E}.{proj}"
    proj_names: ClassVar[dict[str, str]] = {"gate": "w1", "up": "w3", "down": "w2"}
    group_sizes: ClassVar[tuple[int, ...]] = (GROUP,)
    group_size: ClassVar[int] = GROUP
    group_size_limit: ClassVar[str] = ("kt-kernel 0.7.2's AVX-512 MXFP4 kernel assumes group size 32: a 64-group "
                                       "file runs and returns garbage (measured)")
    k_multiple: ClassVar[int] = GROUP
    quants: ClassVar[tuple[str, ...]] = ("rtn", "mse")
    stored_aliases = {"weight_packed": "weight", "weight_scale": "scale"}   # compressed-tensors' names
    # MXFP4 of the tiny heavy-tailed models (qwen3_moe, deepseek_v3, mixtral, glm4_moe, qwen2_moe), verify's MoE
    # rel L2 vs source (all experts): measured max 0.26-0.28 (rtn), 0.24-0.26 (mse); power-of-two scales cost more
    # than NVFP4's (0.16-0.17); kt-kernel's forward agrees with the decode to 0.36-0.39 % (AVX2 kernel)
    thresholds = {"moe_rel_l2": 0.4}

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return {"weight": ("I8", (n, k // 2)), "scale": ("F8_E8M0", (n, k // GROUP))}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "", quant: str = "rtn") -> dict[str, np.ndarray]:
        w = bf16_bits_to_f32(np.asarray(w_bf16, dtype=np.uint16))
        if not np.isfinite(w).all():
            raise NumericError("NaN or Inf in weights", tensor=where or None)
        codes, stored = mx_fp4_encode(w, search=quant == "mse")
        return {"weight": nvfp4.pack_e2m1(codes).view(np.int8), "scale": stored}

    @classmethod
    def write_matrix(cls, writer, proj: str, expert: int, w_bf16, *, numa: int, quant: str, where: str) -> None:
        """Encoded whole with the --quant encoder: kt-kernel slices the NUMA parts in memory."""
        writer.put_stored(proj, expert, cls.encode(w_bf16, where, quant))

    @classmethod
    def quantization_config(cls) -> dict:
        """DeepSeek-V4's own marker of FP4 experts (``expert_dtype: fp4``; formats/decoders/deepseek_v4.py reads
        the output back by it) with the scale format and group."""
        return {"quant_method": "mxfp4", "expert_dtype": "fp4", "fmt": "e2m1", "scale_fmt": "ue8m0",
                "weight_block_size": [1, GROUP]}

    @classmethod
    def reads_as_is(cls, source) -> str | None:
        """Only DeepSeek-V4's names: kt-kernel's MXFP4 loader looks for ffn.experts.E.{w1,w3,w2}.{weight,scale}."""
        try:
            gate = source.info.expert_names(source.info.moe_layers[0], 0)["gate"]
        except (KtConvertError, AttributeError, IndexError, KeyError):
            return None
        if not gate.endswith(".ffn.experts.0.w1.weight") or not source.kt_native_names():
            return None
        group = source.expert_quantization()
        return SOURCE_FORMATS["deepseek-v4"] if group is not None and group.fmt == "deepseek-v4" else None

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        group = source.expert_quantization()
        return None if group is None else SOURCE_FORMATS.get(group.fmt)

    @classmethod
    def _renamed(cls, stored: dict, n: int, k: int) -> dict[str, str] | None:
        """As InplaceMethod's, a source dtype holding the same bytes (U8 for I8 or F8_E8M0) counting as equal."""
        want = {suffix: (dtype, tuple(shape)) for suffix, (dtype, shape) in cls.tensor_specs(n, k).items()}
        names = {suffix: cls.stored_aliases.get(suffix, suffix) for suffix in stored}
        if sorted(names.values()) != sorted(want):
            return None
        for suffix, out in names.items():
            dtype, shape = stored[suffix]
            if dtype not in SAME_BYTES[want[out][0]] or tuple(shape) != want[out][1]:
                return None
        return names

    @classmethod
    def carried(cls, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().carried(arrays)
        return {"weight": np.asarray(out["weight"]).view(np.int8), "scale": np.asarray(out["scale"]).view(np.uint8)}


def mx_fp4_encode(w: np.ndarray, search: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, k] (k % 32 == 0) -> (E2M1 codes uint8 [n, k], stored E8M0 exponents uint8 [n, k/32]); the OCP
    exponent, or with `search` the least-squared-error one of OCP's and its two neighbours (module docstring)."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    amax = np.abs(g).max(axis=2)
    _, exp2 = np.frexp(np.where(amax > 0, amax, 1).astype(np.float32))     # amax = m * 2^exp2, m in [0.5, 1)
    ocp = np.clip(exp2.astype(np.int64) - 1 - E2M1_EMAX + E8M0_BIAS, STORED_MIN, STORED_MAX)
    best_stored = ocp
    best_codes = _codes(g, ocp)
    if search:
        best_err = _sq_error(g, best_codes, ocp)
        for step in (1, -1):
            stored = np.clip(ocp + step, STORED_MIN, STORED_MAX)
            codes = _codes(g, stored)
            err = _sq_error(g, codes, stored)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_stored = np.where(better, stored, best_stored)
            best_codes = np.where(better[:, :, None], codes, best_codes)
    best_stored = np.where(amax > 0, best_stored, 0)
    return best_codes.reshape(n, k), best_stored.astype(np.uint8)


def _scale(stored: np.ndarray) -> np.ndarray:
    return np.ldexp(np.float32(1), (stored - E8M0_BIAS).astype(np.int32)).astype(np.float32)


def _codes(g: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """[n, G, 32] float32 groups at exponents `stored` [n, G] -> E2M1 codes uint8 [n, G, 32]."""
    return e2m1_rne(g / _scale(stored)[:, :, None])


def _sq_error(g: np.ndarray, codes: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Squared error [n, G] (float64) of the groups decoded from (codes, stored) against `g`."""
    diff = E2M1_TO_F32[codes].astype(np.float64) * _scale(stored)[:, :, None] - g
    return (diff * diff).sum(axis=2)

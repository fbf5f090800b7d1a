"""In-place methods for checkpoint formats kt-kernel 0.7.2 reads natively (kt-native-formats.md): FP8_PERCHANNEL,
GPTQ_INT4, MXFP8 and NVFP4.

Per expert matrix ``model.layers.L.mlp.experts.E.{gate,up,down}_proj`` ([n, k] = [out, in]):

* ``fp8_perchannel`` -> ``weight`` F8_E4M3 [n, k], ``weight_scale`` F32 [n, 1]: s = row amax / 448, codes
  e4m3(w / s) (RNE, saturating), W = e4m3 * s[n]; config ``quant_method: fbgemm_fp8`` (transformers' per-channel
  FP8; kt-kernel's FP8SafeTensorLoader(scale_suffix="weight_scale") does not read the config). kt-kernel 0.7.2
  has no AVX2 kernel for it: only its amx and avx512_* builds run it.
* ``gptq_int4`` -> ``qweight`` I32 [k/8, n] (element k at bits 4*(k%8) of row k/8), ``qzeros`` I32 [k/gs, n/8]
  (0x77777777: v1 stores z - 1, z = 8), ``scales`` F16 [k/gs, n], ``g_idx`` I32 [k] (= k // gs): AutoGPTQ v1
  symmetric RTN, scale = fp16(2 * amax / 15) per (group, column), q = clip(rint(w / s) + 8, 0, 15), W = (q - 8) * s.
  kt-kernel reads qweight and scales only, and refuses ``desc_act: true`` / ``sym: false`` configs. Group 32, 64
  or 128 (default 128); a NUMA part of down must hold whole groups (I/T % gs == 0: with less kt-kernel's AVX2
  backend returns zeros, its VNNI backend refuses). ``--quant mse`` searches each (group, column)'s scale
  (``gptq_sym_mse``); ``--quant gptq`` solves the codes on the grid ``GptqInt4.gptq_grid`` declares
  (ktconvert.gptq.groups). Both write the same tensors, decoded the same way.
* ``mxfp8`` -> ``model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}`` (gate, up, down: the only names kt-kernel's
  MXFP8SafeTensorLoader reads) ``.weight`` F8_E4M3 [n, k], ``.weight_scale_inv`` U8 [n, k/32] E8M0 exponents that
  multiply despite the name: W = e4m3 * 2^(e - 127). OCP MX encoder: e = floor(log2(group amax)) - 8 (e4m3's
  emax), stored e + 127 clipped to [1, 254] (0 for an all-zero group: kt-kernel's C++ decodes 0 as 0.0), codes
  e4m3(w / 2^e), saturating at 448; config ``quant_method: mxfp8``, ``weight_block_size: [1, 32]`` (MiniMax).
  Group 32 only (kt-kernel: "MXFP8 MoE requires group_size == 32").
* ``nvfp4`` -> ``weight`` U8 [n, k/2] (E2M1, element 2j in the low nibble), ``weight_scale`` F8_E4M3 [n, k/16],
  ``weight_scale_2`` F32 0-d: ModelOpt's encoder, ws2 = amax(W) / (6 * 448), ws = e4m3(block amax / 6 / ws2),
  codes e2m1(w / (e4m3(ws) * ws2)); W = e2m1 * e4m3(ws) * ws2; config ``quant_method: modelopt``,
  ``quant_algo: NVFP4``. Group 16 only. kt-kernel 0.7.2 runs it on its AVX2 FP4 kernel only: automatic on the
  avx2 build, ``KT_MXFP4_BACKEND=avx2`` on the amx / avx512_* builds (they raise otherwise).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ktconvert.errors import KtConvertError, NumericError
from ktconvert.methods.base import TensorSpecs
from ktconvert.methods.inplace import InplaceMethod
from ktconvert.gptq.grid import Grid
from ktconvert.quant import fp8, mse, nvfp4, qweight
from ktconvert.quant.bf16 import bf16_bits_to_f32

MX_GROUP = 32
NV_GROUP = 16

GPTQ_ZERO = 8            # symmetric 4-bit zero point
GPTQ_V1_ZEROS = 0x77777777   # eight stored fields of z - 1 = 7


def _finite_f32(w_bf16: np.ndarray, where: str) -> np.ndarray:
    w = bf16_bits_to_f32(np.asarray(w_bf16, dtype=np.uint16))
    if not np.isfinite(w).all():
        raise NumericError("NaN or Inf in weights", tensor=where or None)
    return w


class Fp8PerChannel(InplaceMethod):
    """FP8 e4m3 experts with one F32 scale per output row (GLM-4.7-FP8 / fbgemm_fp8 layout)."""

    name, aliases, kt_method, file_prefix = "fp8_perchannel", ("fp8-perchannel", "fp8-channel"), \
        "FP8_PERCHANNEL", "FP8_PERCHANNEL"
    needs_avx512 = True   # kt-kernel 0.7.2: AMXFP8PerChannel_MOE only (no avx2 build class)
    # per-row FP8 of the tiny heavy-tailed models (deepseek_v3, mixtral, glm4_moe, qwen2_moe, qwen3_moe): verify's
    # MoE rel L2 vs source measured max 0.040-0.042; kt-kernel's forward agrees with the decode to 0.31-0.40 % on
    # AVX-512 hosts (kt-native-formats.md)
    thresholds = {"moe_rel_l2": 0.1}

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F32", (n, 1))}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        w = _finite_f32(w_bf16, where)
        amax = np.abs(w).max(axis=1, keepdims=True)
        s = np.where(amax > 0, amax / np.float32(fp8.E4M3_MAX), 1).astype(np.float32)
        return {"weight": fp8.f32_to_e4m3(w / s), "weight_scale": s}

    @classmethod
    def quantization_config(cls) -> dict:
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        group = source.expert_quantization()
        if group is not None and group.fmt in ("fp8-scaled", "float-quantized") and group.strategy == "channel" \
                and group.num_bits == 8:
            return "FP8 e4m3 experts with per-channel (per output row) scales"
        return None


class GptqInt4(InplaceMethod):
    """AutoGPTQ v1 symmetric INT4 experts, F16 group scales, no act-order (Qwen3-*-GPTQ-Int4 layout)."""

    name, aliases, kt_method, file_prefix = "gptq_int4", ("gptq-int4",), "GPTQ_INT4", "GPTQ_INT4"
    group_sizes: ClassVar[tuple[int, ...]] = (32, 64, 128)
    group_size: ClassVar[int] = 128
    group_size_limit: ClassVar[str] = ("ktconvert writes GPTQ_INT4 at group size 32, 64 or 128 (the sizes measured "
                                       "with kt-kernel 0.7.2's GPTQ_INT4 backends)")
    k_multiple: ClassVar[int] = 128
    n_multiple: ClassVar[int] = 8         # qzeros pack eight out-features per int32
    quants: ClassVar[tuple[str, ...]] = ("rtn", "mse", "gptq")
    # symmetric RTN INT4 of the tiny heavy-tailed models (deepseek_v3, mixtral, glm4_moe, qwen2_moe, qwen3_moe),
    # verify's MoE rel L2 vs source, measured max 0.27 (g32), 0.35 (g64), 0.44-0.46 (g128)
    thresholds = {"moe_rel_l2": 0.8}

    @classmethod
    def part_checks(cls, hidden: int, part: int) -> list[dict]:
        """Whole groups along H and per NUMA part of down: kt-kernel 0.7.2 slices down's qweight / scales rows by
        I/T in memory; a part smaller than one group returns all zeros on its AVX2 backend (measured)."""
        checks = super().part_checks(hidden, part)
        return [dict(c, detail=c["detail"] + " (less than whole groups: kt-kernel's AVX2 GPTQ_INT4 returns zeros)")
                if not c["ok"] and "I/T" in c["check"] else c for c in checks]

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        g = k // cls.group_size
        return {"qweight": ("I32", (k // 8, n)), "qzeros": ("I32", (g, n // 8)), "scales": ("F16", (g, n)),
                "g_idx": ("I32", (k,))}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "", quant: str = "rtn") -> dict[str, np.ndarray]:
        """uint16 [n, k] BF16 bits -> the four tensors, scales by ``quant`` ("rtn" or "mse")."""
        return cls.from_codes(*cls.group_codes(w_bf16, where, quant), where)

    @classmethod
    def group_codes(cls, w_bf16: np.ndarray, where: str = "", quant: str = "rtn") -> tuple[np.ndarray, np.ndarray]:
        """Data-free codes on ``gptq_grid``: (codes int8 [n, k] in -8..7, steps float32 [n, k/gs], each an F16
        value) with W = codes * step."""
        if quant not in ("rtn", "mse"):
            raise ValueError(f"GPTQ_INT4's data-free quantizers are rtn and mse, not {quant}")
        q, scale = (gptq_sym_mse if quant == "mse" else gptq_sym_rtn)(_finite_f32(w_bf16, where), cls.group_size)
        return q.astype(np.int8) - np.int8(GPTQ_ZERO), scale.T.astype(np.float32)

    @classmethod
    def from_codes(cls, codes: np.ndarray, steps: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        """(codes int8 [n, k] in -8..7, steps float32 [n, k/gs] of F16 values) -> {qweight, qzeros, scales,
        g_idx}: AutoGPTQ v1's stored q = code + 8."""
        n, k = codes.shape
        gs = cls.group_size
        q = (codes.astype(np.int16) + GPTQ_ZERO).astype(np.uint8)
        return {"qweight": qweight.pack_rows(np.ascontiguousarray(q.T), 4, where),
                "qzeros": np.full((k // gs, n // 8), GPTQ_V1_ZEROS, dtype=np.uint32).view(np.int32),
                "scales": np.ascontiguousarray(steps.T.astype(np.float16)),
                "g_idx": (np.arange(k, dtype=np.int32) // gs).astype(np.int32)}

    @classmethod
    def gptq_grid(cls) -> Grid:
        """The grid ``--quant gptq`` solves on: AutoGPTQ symmetric INT4, codes -8..7 per (group, column), F16 steps
        (the GPU checkpoint's W4A16 grid, gptq.loop.GpuQuantizer.grid, with F16 scales instead of BF16)."""
        return Grid.int_sym(4, cls.group_size, "F16")

    @classmethod
    def write_matrix(cls, writer, proj: str, expert: int, w_bf16, *, numa: int, quant: str, where: str) -> None:
        """Encoded whole with the --quant encoder: kt-kernel slices the NUMA parts in memory."""
        if quant == "rtn":
            writer.put_matrix(proj, expert, w_bf16)
        else:
            writer.put_stored(proj, expert, cls.encode(w_bf16, where, quant))

    @classmethod
    def quantization_config(cls) -> dict:
        return {"quant_method": "gptq", "bits": 4, "group_size": int(cls.group_size), "desc_act": False,
                "sym": True, "checkpoint_format": "gptq", "true_sequential": True, "static_groups": False}

    @classmethod
    def reads_as_is(cls, source) -> str | None:
        """kt-kernel reads qweight / scales of any symmetric int4 GPTQ (v1 or v2: it ignores qzeros) without
        act-order, taking the group size from the scales' shape."""
        if not source.kt_native_names():
            return None
        return _gptq_sym_int4(source, ("gptq", "gptq-v2"), cls.group_sizes)

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        """Carry-over: v1 (qzeros as this method writes them) at exactly this group size."""
        return _gptq_sym_int4(source, ("gptq",), (cls.group_size,))


def _gptq_sym_int4(source, fmts: tuple[str, ...], sizes: tuple[int, ...]) -> str | None:
    group = source.expert_quantization()
    if group is None or group.fmt not in fmts or group.num_bits != 4 or not group.symmetric \
            or group.strategy != "group" or group.group_size not in sizes:
        return None
    config = getattr(getattr(source, "checkpoint", None), "config", None) or {}
    if (config.get("quantization_config") or {}).get("desc_act"):
        return None
    return f"GPTQ {'v1' if group.fmt == 'gptq' else 'v2'} symmetric int4 experts, group {group.group_size}, " \
        "desc_act false"


def gptq_sym_rtn(w: np.ndarray, gs: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, k] -> (q uint8 [n, k] in 0..15, scale float16 [k/gs, n]): per (k-group, column) scale =
    fp16(2 * amax / 15) (1 for an all-zero group), q = clip(rint(w / scale) + 8, 0, 15)."""
    n, k = w.shape
    amax = np.abs(w).reshape(n, k // gs, gs).max(axis=2)                   # [n, G]
    scale = (np.float32(2) * amax / np.float32(15)).astype(np.float16)
    scale[scale == 0] = 1
    s = np.repeat(scale.astype(np.float32), gs, axis=1)                     # [n, k]
    q = np.clip(np.rint(w / s) + GPTQ_ZERO, 0, 15).astype(np.uint8)
    return q, np.ascontiguousarray(scale.T)


MSE_GROUP_CHUNK = 1 << 14   # groups per numpy pass of the scale search (bounds its float64 temporaries)


def gptq_sym_mse(w: np.ndarray, gs: int) -> tuple[np.ndarray, np.ndarray]:
    """As gptq_sym_rtn, each (k-group, column)'s scale searched: ktconvert.quant.mse's least-squares search over
    the group on codes -8..7 (``least_squares_search``, INT4's candidate levels), the step rounded to F16 and the
    codes rounded on it as rtn rounds them. A group keeps rtn's scale and codes unless the searched ones decode it
    with a strictly smaller squared error (float64), so no group is worse than rtn's."""
    q, scale = gptq_sym_rtn(w, gs)
    n, k = w.shape
    groups = n * (k // gs)
    x, qg = w.reshape(groups, gs), q.reshape(groups, gs)              # group r * G + g: row r, k-group g
    s = np.ascontiguousarray(scale.T).reshape(groups)
    for g0 in range(0, groups, MSE_GROUP_CHUNK):
        sl = slice(g0, g0 + MSE_GROUP_CHUNK)
        s[sl], qg[sl] = _mse_groups(x[sl], s[sl], qg[sl])
    return qg.reshape(n, k), np.ascontiguousarray(s.reshape(n, k // gs).T)


def _mse_groups(x: np.ndarray, s_rtn: np.ndarray, q_rtn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups float32 [g, gs] with rtn's (scales float16 [g], q uint8 [g, gs]) -> the better of rtn's and the
    searched (scales, q) per group."""
    s_out, q_out = s_rtn.copy(), q_rtn.copy()
    amax = np.abs(x).max(axis=1)
    live = np.flatnonzero(amax >= mse.ZERO_ROW_AMAX)
    if live.size == 0:
        return s_out, q_out
    xl = x[live]
    _, ratio, e = mse.least_squares_search(xl, amax[live], mse.grid(4), GPTQ_ZERO - 1, -GPTQ_ZERO)
    with np.errstate(over="ignore"):
        step = np.ldexp(ratio, e - 24).astype(np.float16)
    ok = np.isfinite(step) & (step > 0)
    s32 = np.where(ok, step, 1).astype(np.float32)
    q = np.clip(np.rint(xl / s32[:, None]) + GPTQ_ZERO, 0, 15).astype(np.uint8)
    x64 = xl.astype(np.float64)
    err = np.sum((x64 - (q.astype(np.float64) - GPTQ_ZERO) * s32[:, None]) ** 2, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        old = np.sum((x64 - (q_rtn[live].astype(np.float64) - GPTQ_ZERO)
                      * s_rtn[live].astype(np.float64)[:, None]) ** 2, axis=1)
    take = ok & (err < old)
    s_out[live[take]], q_out[live[take]] = step[take], q[take]
    return s_out, q_out


class Mxfp8(InplaceMethod):
    """FP8 e4m3 experts with one E8M0 exponent per 32 in-features, MiniMax naming (block_sparse_moe w1/w3/w2)."""

    name, kt_method, file_prefix = "mxfp8", "MXFP8", "MXFP8"
    expert_template: ClassVar[str] = "model.layers.{L}.block_sparse_moe.experts.{E}.{proj}"
    proj_names: ClassVar[dict[str, str]] = {"gate": "w1", "up": "w3", "down": "w2"}
    group_sizes: ClassVar[tuple[int, ...]] = (MX_GROUP,)
    group_size: ClassVar[int] = MX_GROUP
    group_size_limit: ClassVar[str] = "kt-kernel 0.7.2's MXFP8 kernels take group size 32 only"
    k_multiple: ClassVar[int] = MX_GROUP
    # MX FP8 of the tiny heavy-tailed models (qwen3_moe, mixtral, minimax_m2, deepseek_v3), verify's MoE rel L2
    # vs source: measured max 0.066-0.069
    thresholds = {"moe_rel_l2": 0.15}

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale_inv": ("U8", (n, k // MX_GROUP))}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        codes, exps = mx_fp8_encode(_finite_f32(w_bf16, where))
        return {"weight": codes, "weight_scale_inv": exps}

    @classmethod
    def quantization_config(cls) -> dict:
        return {"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, MX_GROUP],
                "activation_scheme": "dynamic"}

    @classmethod
    def reads_as_is(cls, source) -> str | None:
        """Only under MiniMax's names: kt-kernel's MXFP8 loader looks for block_sparse_moe.experts.E.w1 and nothing
        else."""
        try:
            gate = source.info.expert_names(source.info.moe_layers[0], 0)["gate"]
        except (KtConvertError, AttributeError, IndexError, KeyError):
            return None
        if ".block_sparse_moe.experts.0.w1." not in gate + "." or not source.kt_native_names():
            return None
        return cls._reads_experts(source)

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        group = source.expert_quantization()
        if group is not None and group.fmt == "mxfp8":
            return "MXFP8 experts (e4m3, E8M0 exponent per 32 in-features)"
        return None


def mx_fp8_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, k] (k % 32 == 0) -> (e4m3 codes uint8 [n, k], stored E8M0 exponents uint8 [n, k/32])."""
    n, k = w.shape
    g = w.reshape(n, k // MX_GROUP, MX_GROUP)
    amax = np.abs(g).max(axis=2)
    _, exp2 = np.frexp(np.where(amax > 0, amax, 1).astype(np.float32))    # amax = m * 2^exp2, m in [0.5, 1)
    stored = np.clip(exp2.astype(np.int64) - 1 - 8 + 127, 1, 254)
    stored = np.where(amax > 0, stored, 0)
    scale = np.ldexp(np.float32(1), (np.maximum(stored, 1) - 127).astype(np.int32)).astype(np.float32)
    codes = fp8.f32_to_e4m3(g / scale[:, :, None]).reshape(n, k)
    return codes, stored.astype(np.uint8)


class Nvfp4(InplaceMethod):
    """ModelOpt NVFP4 experts: E2M1 pairs, E4M3 scale per 16 in-features, one F32 global scale per matrix."""

    name, kt_method, file_prefix = "nvfp4", "NVFP4", "NVFP4"
    group_sizes: ClassVar[tuple[int, ...]] = (NV_GROUP,)
    group_size: ClassVar[int] = NV_GROUP
    group_size_limit: ClassVar[str] = "kt-kernel 0.7.2's NVFP4 kernel takes group size 16 only"
    k_multiple: ClassVar[int] = NV_GROUP
    # FP4 of the tiny heavy-tailed models (qwen3_moe, deepseek_v3, mixtral, glm4_moe), verify's MoE rel L2 vs
    # source: measured max 0.162-0.167
    thresholds = {"moe_rel_l2": 0.4}

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        return {"weight": ("U8", (n, k // 2)), "weight_scale": ("F8_E4M3", (n, k // NV_GROUP)),
                "weight_scale_2": ("F32", ())}

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "") -> dict[str, np.ndarray]:
        w = _finite_f32(w_bf16, where)
        n, k = w.shape
        g = w.reshape(n, k // NV_GROUP, NV_GROUP)
        amax = np.float32(np.abs(w).max())
        ws2 = np.float32(amax / np.float32(6 * fp8.E4M3_MAX)) if amax > 0 else np.float32(1)
        ws = fp8.f32_to_e4m3(np.abs(g).max(axis=2) / np.float32(6) / ws2)
        block = fp8.E4M3_TO_F32[ws] * ws2
        codes = e2m1_rne(g / np.where(block > 0, block, 1)[:, :, None]).reshape(n, k)
        return {"weight": nvfp4.pack_e2m1(codes), "weight_scale": ws,
                "weight_scale_2": np.array(ws2, dtype=np.float32)}

    @classmethod
    def quantization_config(cls) -> dict:
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NV_GROUP,
                "producer": {"name": "modelopt"}}

    @classmethod
    def runtime_notes(cls, cpu_flags: list[str]) -> list[str]:
        if "avx512f" in set(cpu_flags):
            return ["kt-kernel 0.7.2 loads an AVX-512 build on this CPU, which runs NVFP4 only with the environment "
                    "variable KT_MXFP4_BACKEND=avx2 (it raises otherwise)"]
        return []

    @classmethod
    def _reads_experts(cls, source) -> str | None:
        group = source.expert_quantization()
        if group is not None and group.fmt == "nvfp4" and group.group_size in (None, NV_GROUP):
            return "ModelOpt NVFP4 experts (group 16)"
        return None


E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)   # between codes i and i+1


def e2m1_rne(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint8 E2M1 codes (bit 3 the sign): round to nearest, exact ties to the even code,
    saturating at +-6; -0 and values rounding to 0 get code 0."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.minimum(np.abs(x), np.float32(6.0))
    code = np.searchsorted(E2M1_MIDPOINTS, mag, side="left")          # midpoints strictly below |x|
    tie = (code < len(E2M1_MIDPOINTS)) & (E2M1_MIDPOINTS[np.minimum(code, len(E2M1_MIDPOINTS) - 1)] == mag)
    code = np.where(tie & (code % 2 == 1), code + 1, code).astype(np.uint8)
    return code | ((np.signbit(x) & (code > 0)).astype(np.uint8) << 3)

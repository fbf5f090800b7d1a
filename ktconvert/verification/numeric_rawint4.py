"""RAWINT4 part of ``ktconvert verify``'s in-place numerics: what kt-kernel does with the files, run where ktconvert
can tell.

``numeric_inplace`` decodes every sampled expert with the input decoders (compressed-tensors' reading: each q * scale
rounded to BF16) and compares it with the source. For RAWINT4 it also asks this module for:

* the group size, inferred as kt-kernel infers it: hidden / the columns of the gate ``weight_scale``. Down's scale
  columns must give the same group size, and every NUMA part of down must hold whole groups (I/T % group == 0), or
  kt-kernel cannot split it. A group size kt-kernel 0.7.2 cannot run is a problem, one line for the whole report:
  the method's ``group_sizes`` are those it runs (RawInt4 writes only those, but a folder may hold others).
* the layer's MoE forward through the native runtime (``native.forward``, weight type RAWINT4) on the files' bytes,
  every expert split into the manifest's NUMA parts as kt-kernel splits them in memory (``rawint4_parts``), against
  a float64 numpy forward of the exact dequantization (q * fp32 scale, which is what the runtime and kt-kernel
  compute): relative L2 within ``numeric_amx.KERNEL_TOL`` per projection ("kernel_rel") and for the MoE output
  ("moe_kernel_rel"); with a source, the runtime's MoE output against the source's ("runtime_moe_rel_l2").

Without the native library the forward is skipped, and the summary says why (the decode and the source comparison
still run).
"""
from __future__ import annotations

import os

import numpy as np

from ktconvert import native
from ktconvert.formats.inplace_sink import EXPERT_PREFIX, PROJ_NAMES
from ktconvert.native import forward as native_rt
from ktconvert.quant import ct_int4
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.verification.numeric_amx import KERNEL_TOL, rel_l2, silu_mul


def applies(method) -> bool:
    """Whether this module's checks belong to the manifest's method: an in-place method whose files the runtime
    reads as a grouped weight type (RAWINT4)."""
    return getattr(method, "kt_method", "") in native_rt.GROUPED


def unrunnable_group_line(method, group: int) -> str:
    """The problem line for a group size kt-kernel 0.7.2 cannot run (the method's ``group_sizes`` are those it
    can)."""
    runnable = method.group_sizes
    return (f"group size {group}: kt-kernel 0.7.2's {method.kt_method} returns NaN/garbage at group sizes other than "
            f"{' or '.join(map(str, runnable))} (measured); reconvert with --method {method.name} "
            f"(group {runnable[0]})")


def ktkernel_group(ck, layer: int, hidden: int, inter: int, numa: int) -> tuple[int | None, list[str]]:
    """(the group size kt-kernel infers for ``layer``, None where it cannot infer one; why kt-kernel cannot load the
    layer with it). Read from the headers of expert 0's gate and down ``weight_scale``; missing tensors are left to
    the decoders' checks. Whether kt-kernel computes correctly at that group size is another question (Runtime)."""
    names = [EXPERT_PREFIX.format(L=layer, E=0, proj=PROJ_NAMES[p]) + ".weight_scale" for p in ("gate", "down")]
    gate, down = (ck.tensors.get(name) for name in names)
    if gate is None or down is None:
        return None, []
    cols, down_cols = (int(ref.shape[-1]) if len(ref.shape) == 2 else 0 for ref in (gate, down))
    if cols <= 0 or hidden % cols:
        return None, [f"{names[0]}: kt-kernel infers the group size as hidden / weight_scale columns, and "
                      f"{hidden} / {list(gate.shape)} is not a whole number"]
    group = hidden // cols
    problems = []
    if down_cols * group != inter:
        problems.append(f"{names[1]}: {down_cols} scale columns for I = {inter} are not groups of {group}, the group "
                        f"size kt-kernel infers from the gate scale (hidden {hidden} / {cols} columns)")
    elif (inter // numa) % group:
        problems.append(f"group size {group}: kt-kernel cannot split down into {numa} NUMA parts of whole groups "
                        f"(I/T = {inter // numa})")
    return (None if problems else group), problems


class Runtime:
    """The RAWINT4 checks of one verify run: kt-kernel's group size per layer, and the native forward."""

    def __init__(self, manifest: dict, method, impl: str | None = None, threads: int | None = None):
        model = manifest["model"]
        self.method = method     # its group_sizes: those kt-kernel 0.7.2 runs, the only ones RawInt4 writes
        self.hidden, self.inter = int(model["hidden"]), int(model["intermediate"])
        self.numa = int(manifest.get("numa", 1))
        if self.numa < 1:
            raise ValueError(f"numa {manifest.get('numa')!r} is not a NUMA count")
        self.impl, self.threads = impl, threads or min(4, os.cpu_count() or 1)
        self.problems: dict[str, None] = {}    # report-level lines, in order, each once
        self.variant, self.unavailable = None, None
        if native_rt.available():
            self.variant = native_rt.variant(impl, method.kt_method)
        else:
            self.unavailable = native.load_error() or "the native library lacks the runtime (rebuild)"

    def layer(self, ck, layer: int, x: np.ndarray, sample: list[int]) -> "LayerForward | None":
        """The forward of ``layer`` (None: the runtime does not run here, or kt-kernel could not take the layer's
        group size; the reason is in ``problems`` / ``summary``)."""
        group, problems = ktkernel_group(ck, layer, self.hidden, self.inter, self.numa)
        if group is not None and self.method.group_sizes and group not in self.method.group_sizes:
            self.problems[unrunnable_group_line(self.method, group)] = None
        self.problems.update(dict.fromkeys(f"layer {layer}: {p}" for p in problems))
        if self.variant is None or group is None or group % native_rt.GROUP_MULTIPLE:
            return None
        return LayerForward(self, ck, layer, group, x, sample)

    def report_fields(self, limit: float) -> dict:
        if self.variant is None:
            return {}
        return {"variant": self.variant, "thresholds": {"moe_rel_l2": limit, "kernel_rel": KERNEL_TOL}}

    def summary(self, rows: list[dict]) -> str:
        if self.variant is None:
            return f"; native runtime not run ({self.unavailable})"
        worst = max((max(r.get("kernel_rel", 0.0), r.get("moe_kernel_rel", 0.0)) for r in rows), default=0.0)
        return (f"; native runtime ({self.variant}, {self.method.kt_method} in {self.numa} NUMA part(s)) vs numpy "
                f"max {worst:.2g}")


class LayerForward:
    """One layer's sampled experts through the runtime (every token through every sampled expert, weight 1, as
    numeric_inplace sums them) and through numpy's exact dequantization."""

    def __init__(self, runtime: Runtime, ck, layer: int, group: int, x: np.ndarray, sample: list[int]):
        self.rt, self.ck, self.layer, self.group, self.x = runtime, ck, layer, group, x
        tokens = x.shape[0]
        self.ids = np.tile(np.asarray(sample, np.int64), (tokens, 1))
        self.weights = np.ones(self.ids.shape, np.float32)
        self.out_rt = np.zeros((tokens, runtime.hidden))
        self.out_np = np.zeros((tokens, runtime.hidden))
        self.kernel_rel = 0.0

    def expert(self, e: int) -> np.ndarray:
        """float64 [tokens, hidden]: expert e's output on the runtime (KtConvertError for unusable tensors)."""
        rt, where = self.rt, f"layer {self.layer} expert {e}"
        mats = {}
        for proj, name in PROJ_NAMES.items():
            base = EXPERT_PREFIX.format(L=self.layer, E=e, proj=name)
            mats[proj] = (self.ck.read(f"{base}.weight_packed"), self.ck.read(f"{base}.weight_scale"))
        parts = native_rt.rawint4_parts(mats["gate"], mats["up"], mats["down"], rt.numa)
        got = native_rt.moe_forward(rt.method.kt_method, rt.hidden, rt.inter // rt.numa, {e: parts}, self.x,
                                    self.ids, self.weights, impl=rt.impl, threads=rt.threads, name=where,
                                    group=self.group).astype(np.float64)
        deq = {proj: exact_dequant(w, s, self.group, f"{where} {proj}") for proj, (w, s) in mats.items()}
        x64 = self.x.astype(np.float64)
        want = silu_mul(x64 @ deq["gate"].T, x64 @ deq["up"].T) @ deq["down"].T
        self.kernel_rel = _worst(self.kernel_rel, self._projections(mats, deq))
        self.out_rt += got
        self.out_np += want
        return got

    def _projections(self, mats: dict, deq: dict) -> float:
        """Largest relative L2 of the runtime's GEMMs on the whole matrices against numpy's (down on the runtime's
        own silu(gate) * up, as numeric_amx checks it)."""
        rt, ys, worst = self.rt, {}, 0.0
        for proj in ("gate", "up", "down"):
            (w, s), x = mats[proj], (self.x if proj != "down" else silu_mul(ys["gate"], ys["up"]).astype(np.float32))
            n, k = (rt.inter, rt.hidden) if proj != "down" else (rt.hidden, rt.inter)
            ys[proj] = native_rt.gemm(rt.method.kt_method, w, s, n, k, x, impl=rt.impl, threads=rt.threads,
                                      group=self.group).astype(np.float64)
            worst = _worst(worst, rel_l2(ys[proj], x.astype(np.float64) @ deq[proj].T))
        return worst

    def metrics(self, source_out: np.ndarray | None = None) -> dict:
        """The row's runtime keys; ``source_out``: the source weights' MoE output over the same experts."""
        row = {"kernel_rel": self.kernel_rel, "moe_kernel_rel": rel_l2(self.out_rt, self.out_np)}
        if source_out is not None:
            row["runtime_moe_rel_l2"] = rel_l2(self.out_rt, source_out)
        return row


def _worst(a: float, b: float) -> float:
    """max(a, b) that keeps a NaN (garbage must not read as agreement)."""
    return b if b != b or b > a else a


def exact_dequant(packed: np.ndarray, scale_bits: np.ndarray, group: int, where: str = "") -> np.ndarray:
    """float32 [n, k] = q * fp32(scale) of one RAWINT4 matrix (weight_packed int32 [n, k/8], weight_scale BF16 bits
    [n, k/group]), numpy only. Each product is exact in fp32 (|q| <= 8 times an 8-bit significand), unlike the BF16
    values compressed-tensors decodes to."""
    k = packed.shape[1] * 8
    q = ct_int4.unpack_int32(packed, k, 4, where, impl="numpy")
    return q * np.repeat(bf16_bits_to_f32(scale_bits), group, axis=1)

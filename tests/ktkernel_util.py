"""Drive the real kt-kernel (PyPI ``kt-kernel==0.7.2``, installed with ``pip install --no-deps``) from tests.

Reusable pieces for interop tests (format, verify runtime, error-minimising quant):

* ``ktkernel_skip_reason()``                      -> None, or why kt-kernel cannot run here (use with pytest.skip)
* ``ktkernel_write_kt(out, method, gate, up, down, threadpool_count)``
                                                  -> kt-kernel's own ``_layer_L/_numa_t/*.kt`` tree for one layer
* ``read_kt_tree(root)``                          -> {relative path: bytes} of every .kt file under root
* ``kt_file_name(prefix, proj, expert, nbytes, kind)``  -> "INT4_gate_0_16384Byte_quant_.kt"
* ``ktkernel_forward(weight_path, method, ...)``  -> kt-kernel's MoE output (float32 [tokens, H]) for .kt/merged files
* ``reference_moe_forward(x, ids, weights, gate, up, down)`` -> float64 SwiGLU MoE output of float weights
* ``relative_l2(a, b)``
* ``adversarial_bf16(rng, n, k)``                 -> uint16 [n, k] rows of every edge case (zero, -0, constant,
                                                     outlier, exact .5 ties of both roundings, subnormals, tiny
                                                     and threshold scales, bf16 max, heavy tails)
* ``numpy_kt_files(method, gate, up, down, T)``   -> {"_numa_t/<name>.kt": bytes} as ktconvert writes them
* ``write_kt_files(root, layer, files)``          -> writes such a dict as ``root/_layer_<layer>/...``
* ``dequantized_experts(method, gate, up, down, T)`` -> float32 gate/up [E, I, H], down [E, H, I] as kt-kernel
                                                     sees them after the NUMA split (down scales per part)

Expert weights go in as BF16 bit patterns (numpy uint16): gate/up [E, I, H], down [E, H, I] (HF orientation).
Nothing here imports torch or kt_kernel at module import time.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

PROJS = ("gate", "up", "down")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


RAWINT4_NEEDS_AMX = ("kt-kernel 0.7.2's RAWINT4 needs AMX: without it the avx2 backend segfaults and the amx ones "
                     "return garbage, on llmcompressor's own W4A16 files too, NaN in some runs only (observed)")


def rawint4_skip_reason() -> str | None:
    """None where kt-kernel's RAWINT4 forward can run (the CPU has AMX tiles), else the reason to skip."""
    return None if "amx_tile" in _cpu_flags() else RAWINT4_NEEDS_AMX


def ktkernel_skip_reason(method: str = "AMXINT4") -> str | None:
    """None when kt-kernel can quantize and run ``method`` here, else a one-line reason to skip."""
    flags = _cpu_flags()
    if not {"avx512f", "avx512bw"} <= flags:
        return "CPU lacks AVX-512 (avx512f+avx512bw); kt-kernel's AMXINT4/AMXINT8 need it"
    try:
        import kt_kernel  # noqa: F401
        import kt_kernel_ext.moe as moe

        _numpy_fp_mode()
    except Exception as exc:  # ImportError, or a broken install raising anything
        return f"kt_kernel not importable ({type(exc).__name__}: {exc}); pip install --no-deps kt-kernel==0.7.2"
    cls = {"AMXINT4": "AMXInt4_MOE", "AMXINT8": "AMXInt8_MOE"}.get(method)
    if cls and getattr(moe, cls, None) is None:
        return f"this kt_kernel build has no {cls}"
    return None


def kt_file_name(prefix: str, proj: str, expert: int, nbytes: int, kind: str) -> str:
    """Name of one .kt file: prefix INT4/INT8, proj gate/up/down, kind "quant" or "scale"."""
    return f"{prefix}_{proj}_{expert}_{nbytes}Byte_{kind}_.kt"


@contextlib.contextmanager
def _no_pin_memory():
    """kt-kernel allocates pinned buffers; CPU-only torch refuses pin_memory=True. Drop the flag meanwhile."""
    import torch

    saved = {name: getattr(torch, name) for name in ("zeros", "empty", "full", "ones")}

    def unpinned(fn):
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)
        return call

    try:
        if not torch.cuda.is_available():
            for name, fn in saved.items():
                setattr(torch, name, unpinned(fn))
        yield torch
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


def _cpu_infer_for(threadpool_count: int) -> None:
    """kt-kernel keeps one CPUInfer per wrapper class (set on the subclass that first asks), sized by the first
    caller's threadpool_count; drop every cached one when T changes so the next wrapper gets a pool of T parts."""
    from kt_kernel.experts_base import _MoEBase

    if getattr(_MoEBase, "_ktconvert_tp", None) == threadpool_count:
        return
    stack = [_MoEBase]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "_cpu_infer_instance" in vars(cls):
            cls._cpu_infer_instance = None
    _MoEBase._ktconvert_tp = threadpool_count


def _bf16_tensor(bits: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def _wrapper(torch, *, method, weight_path, num_experts, top_k, hidden, intermediate, threadpool_count,
             layer_idx, threads, cpu_save, max_tokens):
    from kt_kernel import KTMoEWrapper

    _cpu_infer_for(threadpool_count)
    _forget_loaders()
    return KTMoEWrapper(
        layer_idx=layer_idx, num_experts=num_experts, num_experts_per_tok=top_k, hidden_size=hidden,
        moe_intermediate_size=intermediate, gpu_experts_mask=torch.zeros(num_experts, dtype=torch.bool),
        cpuinfer_threads=max(threads, threadpool_count), threadpool_count=threadpool_count,
        weight_path=str(weight_path), chunked_prefill_size=max_tokens, cpu_save=cpu_save, method=method,
    )


def _numpy_fp_mode() -> None:
    """kt-kernel switches flush-to-zero / denormals-are-zero on for the whole process when it loads: switch them
    off again so numpy references computed in the same test run keep their subnormals."""
    from ktconvert import native

    native.set_fp_flush_mode(False)


@contextlib.contextmanager
def _ktkernel_fp_mode():
    """Run kt-kernel as it runs in its own processes: with FTZ/DAZ on (it sets them at import), then off again."""
    from ktconvert import native

    native.set_fp_flush_mode(True)
    try:
        yield
    finally:
        native.set_fp_flush_mode(False)


def _forget_loaders() -> None:
    """kt-kernel keeps one process-wide SafeTensorLoader per wrapper class, opened on the first weight_path it saw;
    a later wrapper for another folder would silently read the first one's files. Drop them before each wrapper."""
    from kt_kernel.utils import amx

    amx.AMXMoEWrapper._safetensor_loader_instance = None
    native = getattr(amx, "NativeMoEWrapper", None)
    if native is not None and native._native_loader_instance is not None:
        native._native_loader_instance.close_all_handles()
        native._native_loader_instance = None


def ktkernel_write_kt(out: Path, method: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                      threadpool_count: int, layer_idx: int = 0, threads: int = 2) -> Path:
    """Let kt-kernel quantize one MoE layer and write its .kt files, as convert_cpu_weights.py does.

    method: "AMXINT4" | "AMXINT8". gate/up uint16 [E, I, H], down uint16 [E, H, I] BF16 bits.
    Writes ``out/_layer_<layer_idx>/_numa_<t>/<INT4|INT8>_<proj>_<e>_<bytes>Byte_{quant,scale}_.kt`` and
    returns ``out/_layer_<layer_idx>``.
    """
    num_experts, intermediate, hidden = gate.shape
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with _no_pin_memory() as torch, _ktkernel_fp_mode():
        wrapper = _wrapper(torch, method=method, weight_path=out, num_experts=num_experts, top_k=1,
                           hidden=hidden, intermediate=intermediate, threadpool_count=threadpool_count,
                           layer_idx=layer_idx, threads=threads, cpu_save=True, max_tokens=64)
        wrapper.load_weights_from_tensors(_bf16_tensor(gate), _bf16_tensor(up), _bf16_tensor(down),
                                          torch.arange(num_experts, dtype=torch.int64))
        del wrapper
    return out / f"_layer_{layer_idx}"


def read_kt_tree(root: Path) -> dict[str, bytes]:
    """{path relative to root (posix): file bytes} for every *.kt file under root."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.kt"))}


def ktkernel_forward(weight_path: Path, method: str, *, num_experts: int, hidden: int, intermediate: int,
                     threadpool_count: int, x_bf16: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                     layer_idx: int = 0, threads: int = 2) -> np.ndarray:
    """Load converted files (``.kt`` tree, or merged safetensors at the top of weight_path) and run kt-kernel's
    CPU MoE forward.

    x_bf16: uint16 [tokens, H] BF16 bits; topk_ids: int [tokens, k]; topk_weights: float32 [tokens, k].
    returns: float32 [tokens, H] (kt-kernel computes in BF16 and quantizes activations internally).
    """
    tokens, top_k = topk_ids.shape
    saved_env = os.environ.get("KT_FORCE_SYNC_SUBMIT")
    os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"
    with _no_pin_memory() as torch, _restore_env("KT_FORCE_SYNC_SUBMIT", saved_env), _ktkernel_fp_mode():
        wrapper = _wrapper(torch, method=method, weight_path=weight_path, num_experts=num_experts, top_k=top_k,
                           hidden=hidden, intermediate=intermediate, threadpool_count=threadpool_count,
                           layer_idx=layer_idx, threads=threads, cpu_save=False, max_tokens=max(tokens, 64))
        wrapper.load_weights(torch.arange(num_experts, dtype=torch.int64))
        # kt-kernel caches its I/O buffers by batch size only: a cached buffer of another hidden size would be reused
        wrapper.clear_buffer_cache()
        out = wrapper.forward(_bf16_tensor(x_bf16), torch.from_numpy(np.asarray(topk_ids, np.int64)),
                              torch.from_numpy(np.asarray(topk_weights, np.float32)), None)
        result = out.float().numpy().copy()
        del wrapper
    return result


@contextlib.contextmanager
def _restore_env(name: str, value: str | None):
    try:
        yield
    finally:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def reference_moe_forward(x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray, gate: np.ndarray,
                          up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """float64 [tokens, H]: sum_k w_k * down_e @ (silu(gate_e @ x) * (up_e @ x)) with float weights
    gate/up [E, I, H], down [E, H, I] and x float [tokens, H]."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t], topk_weights[t]):
            g = gate[e].astype(np.float64) @ x[t]
            u = up[e].astype(np.float64) @ x[t]
            out[t] += float(w) * (down[e].astype(np.float64) @ (g / (1.0 + np.exp(-g)) * u))
    return out


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||."""
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


# ---------------------------------------------------------------------------------------------------------------
# Weight generators and ktconvert-side counterparts of kt-kernel's output


def _bf16(values: np.ndarray) -> np.ndarray:
    """float -> BF16 bits with subnormal results flushed to signed zero explicitly, so the bits do not depend on
    the process's FTZ/DAZ state (kt_kernel's import turns FTZ/DAZ on for the main thread)."""
    from ktconvert.quant.bf16 import f32_to_bf16_bits

    bits = f32_to_bf16_bits(np.asarray(values, np.float32))
    subnormal = (bits & np.uint16(0x7F80)) == 0
    bits[subnormal] &= np.uint16(0x8000)
    return bits


def _row_of_kind(kind: int, rng: np.random.Generator, k: int) -> np.ndarray:
    """uint16 [k] BF16 bits of one adversarial row; kinds cycle through 0..13."""
    m = int(rng.integers(-12, 4))                      # exponent of the exact power-of-two scale rows
    step = 2.0 ** m
    if kind == 0:                                      # plain Gaussian
        return _bf16(rng.standard_normal(k) * 0.02)
    if kind == 1:                                      # heavy tail (Student t, 2 dof)
        return _bf16(rng.standard_t(2, k) * 0.01)
    if kind == 2:                                      # all zero
        return np.zeros(k, np.uint16)
    if kind == 3:                                      # all -0
        return np.full(k, 0x8000, np.uint16)
    if kind == 4:                                      # constant row (+ or -)
        return _bf16(np.full(k, rng.choice([-1.0, 1.0]) * rng.uniform(0.01, 3)))
    if kind == 5:                                      # one huge outlier among small values
        row = rng.standard_normal(k) * 0.01
        row[rng.integers(k)] = rng.choice([-1.0, 1.0]) * 1e4
        return _bf16(row)
    if kind == 6:                                      # INT4 ties: d = 2^m exactly, x = (q + .5) d and 16v +- 8
        q = rng.integers(-112, 112, k).astype(np.float64)
        row = np.where(rng.random(k) < 0.5, q + 0.5, np.round(q / 16) * 16 + rng.choice([-8.0, 8.0], k))
        row = np.clip(row, -111.5, 111.5)
        row[0] = 112.0 * rng.choice([-1.0, 1.0])
        return _bf16(row * step)
    if kind == 7:                                      # INT8 ties: d = 2^m exactly, x = (q + .5) d
        row = rng.integers(-127, 126, k) + 0.5
        row[0] = 127.0 * rng.choice([-1.0, 1.0])
        return _bf16(row * step)
    if kind == 8:                                      # subnormal BF16 inputs (exponent 0), some with a normal max
        row = rng.integers(1, 0x80, k).astype(np.uint16) | (rng.integers(0, 2, k).astype(np.uint16) << 15)
        if rng.random() < 0.5:
            row[rng.integers(k)] = _bf16(np.array([2.0 ** -120]))[0]
        return row
    if kind == 9:                                      # tiny normals: amax/112 and amax/127 are subnormal
        return _bf16(rng.uniform(-1, 1, k) * 2.0 ** -122)
    if kind == 10:                                     # right at the flush threshold of d (INT4 112, INT8 127)
        row = rng.uniform(-1, 1, k) * 2.0 ** -121
        row[0] = rng.choice([112.0, 127.0]) * 2.0 ** -126 * rng.choice([0.9921875, 1.0, 1.0078125])
        return _bf16(row)
    if kind == 11:                                     # the largest finite BF16 in the row
        row = rng.standard_normal(k) * 1e30
        row[rng.integers(k)] = -3.3895313892515355e38
        return _bf16(row)
    if kind == 12:                                     # mixed signs of zero and tiny values, Gaussian rest
        row = _bf16(rng.standard_normal(k))
        row[rng.random(k) < 0.3] = 0x8000
        return row
    return _bf16(rng.standard_normal(k) * rng.choice([1e-3, 1.0, 300.0]))


ADVERSARIAL_KINDS = 14


def adversarial_bf16(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """uint16 [n, k] BF16 bits whose rows cycle through every adversarial kind (see _row_of_kind)."""
    start = int(rng.integers(ADVERSARIAL_KINDS))
    return np.stack([_row_of_kind((start + r) % ADVERSARIAL_KINDS, rng, k) for r in range(n)])


def heavy_tailed_bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.02) -> np.ndarray:
    """uint16 BF16 bits: Gaussian weights with 1% of entries at 12 sigma (the outlier case of kt-format §6.1)."""
    w = rng.standard_normal(shape) * scale
    mask = rng.random(shape) < 0.01
    w[mask] = np.sign(w[mask]) * 12 * scale
    return _bf16(w)


def _expert_parts(gate: np.ndarray, up: np.ndarray, down: np.ndarray, threadpool_count: int):
    from ktconvert.formats.base import ExpertWeights
    from ktconvert.layouts.numa import split_expert

    for e in range(gate.shape[0]):
        yield e, split_expert(ExpertWeights(gate[e], up[e], down[e]), threadpool_count)


def numpy_kt_files(method: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                   threadpool_count: int) -> dict[str, bytes]:
    """{"_numa_<t>/<prefix>_<proj>_<e>_<n>Byte_{quant,scale}_.kt": bytes} from ktconvert's METHODS[method]."""
    from ktconvert.methods import METHODS

    m = METHODS.get(method)
    files = {}
    for e, parts in _expert_parts(gate, up, down, threadpool_count):
        for t, part in enumerate(parts):
            for proj, w in part.projections():
                blob, scale = m.quantize(w, where=f"expert {e} {proj} numa {t}")
                files[f"_numa_{t}/" + kt_file_name(m.file_prefix, proj, e, blob.size, "quant")] = blob.tobytes()
                files[f"_numa_{t}/" + kt_file_name(m.file_prefix, proj, e, scale.nbytes, "scale")] = scale.tobytes()
    return files


def write_kt_files(root: Path, layer: int, files: dict[str, bytes]) -> Path:
    """Write {relative name: bytes} under root/_layer_<layer>/; returns root (the kt-kernel weight_path)."""
    for rel, data in files.items():
        path = Path(root) / f"_layer_{layer}" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return Path(root)


def dequantized_experts(method: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                        threadpool_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 gate/up [E, I, H], down [E, H, I]: ktconvert's quantize -> dequantize per NUMA part, reassembled."""
    from ktconvert.methods import METHODS

    m = METHODS.get(method)

    def roundtrip(w: np.ndarray) -> np.ndarray:
        return m.dequantize(*m.quantize(w), *w.shape)

    out = ([], [], [])
    for _, parts in _expert_parts(gate, up, down, threadpool_count):
        out[0].append(np.concatenate([roundtrip(p.gate) for p in parts], axis=0))
        out[1].append(np.concatenate([roundtrip(p.up) for p in parts], axis=0))
        out[2].append(np.concatenate([roundtrip(p.down) for p in parts], axis=1))
    return tuple(np.stack(x) for x in out)

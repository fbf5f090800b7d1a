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

Every call that touches kt-kernel (the probe behind the skip reasons, quantizing, loading, the forward, its
placement helper) runs in a fresh child Python process (``in_child``): kt-kernel keeps one weight loader per
process, switches FTZ/DAZ on for the whole process at import, and can crash (SIGSEGV) on inputs it does not
support. A crash fails the one test that made the call, with the signal named (``KtKernelCrash``), never the
test run; kt_kernel is never imported into the pytest process.
Nothing here imports torch or kt_kernel at module import time.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import subprocess
import sys
import tempfile
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


# ---------------------------------------------------------------------------------------------------------------
# kt-kernel runs in child processes


class KtKernelCrash(AssertionError):
    """kt-kernel's child process died from a signal (or exited without a result): the calling test fails."""


CHILD_TIMEOUT_S = 600
_CHILD = """
import pickle, sys, traceback
sys.path.insert(0, sys.argv[1])
import ktkernel_util
with open(sys.argv[2], "rb") as f:
    name, kwargs = pickle.load(f)
try:
    result = ("ok", getattr(ktkernel_util, name)(**kwargs))
except BaseException as exc:
    result = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
with open(sys.argv[3], "wb") as f:
    pickle.dump(result, f)
"""


def in_child(name: str, **kwargs):
    """``ktkernel_util.<name>(**kwargs)`` run in a fresh Python process; its return value (pickled back).

    A signal (kt-kernel's SIGSEGV / SIGABRT) or a missing result raises KtKernelCrash naming the signal and the
    child's last stderr lines; an exception in the child raises RuntimeError with the child's traceback."""
    with tempfile.TemporaryDirectory(prefix="ktkernel-child-") as tmp:
        args, result = Path(tmp, "args.pkl"), Path(tmp, "result.pkl")
        args.write_bytes(pickle.dumps((name, kwargs)))
        env = {**os.environ, "KT_FORCE_SYNC_SUBMIT": "1"}
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD, str(Path(__file__).parent), str(args), str(result)],
                                  capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise KtKernelCrash(f"kt-kernel child {name} ran past {CHILD_TIMEOUT_S} s and was killed") from exc
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        if proc.returncode < 0:
            try:
                sig = signal.Signals(-proc.returncode).name
            except ValueError:
                sig = f"signal {-proc.returncode}"
            raise KtKernelCrash(f"kt-kernel crashed with {sig} in {name}; its stderr ended:\n{tail}")
        if not result.is_file():
            raise KtKernelCrash(f"kt-kernel child {name} exited {proc.returncode} without a result:\n{tail}")
        outcome = pickle.loads(result.read_bytes())
    if outcome[0] != "ok":
        raise RuntimeError(f"in kt-kernel's child process, {name} raised {outcome[1]}\n{outcome[2]}")
    return outcome[1]


def _signal_here(signum: int) -> None:
    """(child) Die from signal `signum`, as kt-kernel does when it crashes (for the tests of in_child)."""
    os.kill(os.getpid(), signum)


def _probe_here() -> dict:
    """(child) What this kt_kernel build has: importable or the error, its CPU variant, the MoE classes and the
    native backends' support flags."""
    try:
        import kt_kernel
        import kt_kernel_ext.moe as moe
        from kt_kernel.utils import amx
    except Exception as exc:  # ImportError, or a broken install raising anything
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "variant": getattr(kt_kernel, "__cpu_variant__", None),
            "classes": sorted(n for n in dir(moe) if n.endswith("_MOE")),
            "flags": {n: bool(getattr(amx, n)) for n in dir(amx) if n.startswith("_HAS_") and n.endswith("_SUPPORT")}}


@functools.lru_cache(maxsize=1)
def ktkernel_info() -> dict:
    """_probe_here's answer, asked once per test session (in a child process: kt_kernel never loads here)."""
    try:
        return in_child("_probe_here")
    except (KtKernelCrash, RuntimeError) as exc:
        return {"error": f"probing kt_kernel failed: {str(exc).splitlines()[0]}"}


RAWINT4_NEEDS_AMX = ("kt-kernel 0.7.2's RAWINT4 forward is only known to work on AMX hosts (group size 32: rel L2 "
                     "0.013 there); without AMX its avx2 backend segfaults and the others returned garbage (observed)")


def rawint4_skip_reason() -> str | None:
    """None where kt-kernel's RAWINT4 forward can run (the CPU has AMX tiles and kt has the backend), else the
    reason to skip."""
    if "amx_tile" not in _cpu_flags():
        return RAWINT4_NEEDS_AMX
    return native_skip_reason("RAWINT4")


def ktkernel_skip_reason(method: str = "AMXINT4") -> str | None:
    """None when kt-kernel can quantize and run ``method`` here, else a one-line reason to skip."""
    flags = _cpu_flags()
    if not {"avx512f", "avx512bw"} <= flags:
        return "CPU lacks AVX-512 (avx512f+avx512bw); kt-kernel's AMXINT4/AMXINT8 need it"
    info = ktkernel_info()
    if info["error"]:
        return f"kt_kernel not usable ({info['error']}); pip install --no-deps kt-kernel==0.7.2"
    cls = {"AMXINT4": "AMXInt4_MOE", "AMXINT8": "AMXInt8_MOE"}.get(method)
    if cls and cls not in info["classes"]:
        return f"this kt_kernel build has no {cls}"
    return None


def native_skip_reason(method: str) -> str | None:
    """None when kt-kernel's native backend for BF16 / FP8 / RAWINT4 (read in place) is in this build (its AVX2
    backends run on AVX2-only CPUs too)."""
    info = ktkernel_info()
    if info["error"]:
        return f"kt_kernel not usable ({info['error']}); pip install --no-deps kt-kernel==0.7.2"
    flags = info["flags"]
    if not (flags.get(f"_HAS_{method}_SUPPORT") or flags.get(f"_HAS_AVX2_{method}_SUPPORT")):
        return f"this kt_kernel build has no {method} backend"
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


def _bf16_tensor(bits: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def _wrapper(torch, *, method, weight_path, num_experts, top_k, hidden, intermediate, threadpool_count,
             layer_idx, threads, cpu_save, max_tokens):
    from kt_kernel import KTMoEWrapper

    return KTMoEWrapper(
        layer_idx=layer_idx, num_experts=num_experts, num_experts_per_tok=top_k, hidden_size=hidden,
        moe_intermediate_size=intermediate, gpu_experts_mask=torch.zeros(num_experts, dtype=torch.bool),
        cpuinfer_threads=max(threads, threadpool_count), threadpool_count=threadpool_count,
        weight_path=str(weight_path), chunked_prefill_size=max_tokens, cpu_save=cpu_save, method=method,
    )


def ktkernel_write_kt(out: Path, method: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                      threadpool_count: int, layer_idx: int = 0, threads: int = 2) -> Path:
    """Let kt-kernel quantize one MoE layer and write its .kt files, as convert_cpu_weights.py does (in a child
    process).

    method: "AMXINT4" | "AMXINT8". gate/up uint16 [E, I, H], down uint16 [E, H, I] BF16 bits.
    Writes ``out/_layer_<layer_idx>/_numa_<t>/<INT4|INT8>_<proj>_<e>_<bytes>Byte_{quant,scale}_.kt`` and
    returns ``out/_layer_<layer_idx>``.
    """
    return in_child("_write_kt_here", out=Path(out), method=method, gate=gate, up=up, down=down,
                    threadpool_count=threadpool_count, layer_idx=layer_idx, threads=threads)


def _write_kt_here(out: Path, method: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                   threadpool_count: int, layer_idx: int, threads: int) -> Path:
    """(child) ktkernel_write_kt."""
    num_experts, intermediate, hidden = gate.shape
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with _no_pin_memory() as torch:
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
    CPU MoE forward (in a child process).

    x_bf16: uint16 [tokens, H] BF16 bits; topk_ids: int [tokens, k]; topk_weights: float32 [tokens, k].
    returns: float32 [tokens, H] (kt-kernel computes in BF16 and quantizes activations internally).
    """
    return in_child("_forward_here", weight_path=Path(weight_path), method=method, num_experts=num_experts,
                    hidden=hidden, intermediate=intermediate, threadpool_count=threadpool_count,
                    x_bf16=np.asarray(x_bf16), topk_ids=np.asarray(topk_ids), topk_weights=np.asarray(topk_weights),
                    layer_idx=layer_idx, threads=threads)


def _forward_here(weight_path: Path, method: str, *, num_experts: int, hidden: int, intermediate: int,
                  threadpool_count: int, x_bf16: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                  layer_idx: int, threads: int) -> np.ndarray:
    """(child) ktkernel_forward."""
    tokens, top_k = topk_ids.shape
    assert os.environ.get("KT_FORCE_SYNC_SUBMIT") == "1"     # in_child sets it: a synchronous forward
    with _no_pin_memory() as torch:
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


def ktkernel_load_experts(path: Path, base: str) -> dict[str, np.ndarray]:
    """kt-kernel's own BF16SafeTensorLoader on a checkpoint (in a child process): BF16 bits gate/up [E, I, H],
    down [E, H, I] of the layer ``base`` ("model.layers.L")."""
    return in_child("_load_experts_here", path=str(path), base=base)


def _load_experts_here(path: str, base: str) -> dict[str, np.ndarray]:
    """(child) ktkernel_load_experts."""
    import torch
    from kt_kernel.utils.loader import BF16SafeTensorLoader

    loader = BF16SafeTensorLoader(path)
    try:
        mats = loader.load_experts(base)
    finally:
        loader.close_all_handles()
    return {p: np.stack([t.contiguous().view(torch.int16).numpy().view(np.uint16) for t in mats[p]])
            for p in ("gate", "up", "down")}


def ktkernel_gpu_experts_masks(counts: np.ndarray, budgets: list[int]) -> dict[int, np.ndarray]:
    """{budget: kt-kernel's generate_gpu_experts_masks(counts, budget) as bool numpy} (in a child process)."""
    return in_child("_gpu_experts_masks_here", counts=np.asarray(counts), budgets=list(budgets))


def _gpu_experts_masks_here(counts: np.ndarray, budgets: list[int]) -> dict[int, np.ndarray]:
    """(child) ktkernel_gpu_experts_masks."""
    import torch
    from kt_kernel import generate_gpu_experts_masks

    return {b: generate_gpu_experts_masks(torch.from_numpy(counts.copy()), b).numpy() for b in budgets}


def ct_decoded_experts(folder: Path, layer: int, n_experts: int,
                       name: str = "model.layers.{L}.mlp.experts.{e}.{p}_proj") -> tuple[np.ndarray, ...]:
    """float32 gate/up [E, I, H], down [E, H, I] of a compressed-tensors pack-quantized checkpoint's routed experts,
    decoded by compressed-tensors' own decompressor (an independent reader of the RAWINT4 files)."""
    import json

    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    folder = Path(folder)
    config = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    group = next(iter(config.config_groups.values()))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"] \
        if (folder / "model.safetensors.index.json").is_file() else None

    def tensor(key: str):
        file = folder / (index[key] if index else "model.safetensors")
        with safe_open(str(file), "pt") as f:
            return f.get_tensor(key)

    out = []
    for p in ("gate", "up", "down"):
        mats = []
        for e in range(n_experts):
            base = name.format(L=layer, e=e, p=p)
            packed = {n: tensor(f"{base}.{n}") for n in ("weight_packed", "weight_scale", "weight_shape")}
            mats.append(PackedQuantizationCompressor.decompress(packed, group)["weight"].to(torch.float32).numpy())
        out.append(np.stack(mats))
    return tuple(out)


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

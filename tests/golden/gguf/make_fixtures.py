"""Regenerate the K-quant / IQ GGUF fixtures of this directory with llama.cpp's own quantizer (SLOW, not run by tests).

Steps: write a tiny F16 Qwen3-MoE GGUF with gguf-py (write_moe_gguf, also used by tests/test_input_gguf.py to make
gguf-py-quantizable fixtures at test time), then quantize it with llama-cpp-python's ``llama_model_quantize`` to each
ftype in FTYPES and record tool, version, ftype, sizes, sha256 and the expert tensors' ggml types in SOURCES.json.

llama-cpp-python is sdist-only: build it once in its own venv (~5 min on 2 cores), never in the project venv:

    python -m venv /tmp/llama && . /tmp/llama/bin/activate
    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF" pip install llama-cpp-python==0.3.36 numpy gguf==0.19.0
    python tests/golden/gguf/make_fixtures.py
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# llama_ftype name -> output file (each < 1 MB)
FTYPES = {"Q4_K_M": "tiny-qwen3moe-Q4_K_M.gguf", "Q6_K": "tiny-qwen3moe-Q6_K.gguf",
          "IQ4_XS": "tiny-qwen3moe-IQ4_XS.gguf", "Q2_K": "tiny-qwen3moe-Q2_K.gguf",
          "Q3_K_M": "tiny-qwen3moe-Q3_K_M.gguf", "Q5_K_M": "tiny-qwen3moe-Q5_K_M.gguf"}
TINY = dict(layers=2, experts=2, hidden=256, inter=256, vocab=32, heads=2, kv_heads=1, head_dim=128)


def _weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Gaussian weights with a few 8x outliers per row (realistic quantization ranges)."""
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    mask = rng.random(shape) < 0.002
    return np.where(mask, w * 8, w).astype(np.float32)


def write_moe_gguf(path, tensor_type=None, layers: int = 2, experts: int = 2, hidden: int = 256, inter: int = 256,
                   seed: int = 0, vocab: int = 32, heads: int = 2, kv_heads: int = 1, head_dim: int = 128,
                   arch: str = "qwen3moe", split_max_tensors: int = 0) -> dict[str, np.ndarray]:
    """A loadable-by-llama.cpp tiny MoE GGUF (llama.cpp tensor names) written with gguf-py.

    tensor_type: a gguf.GGMLQuantizationType gguf-py can quantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    MXFP4) used for the routed-expert tensors; F16 when None. Other 2-D weights are F16, norms F32.
    split_max_tensors > 0 writes a split set (NAME-0000i-of-0000n.gguf next to `path`'s stem).
    Returns {tensor name: float32 array as written before quantization} for the expert tensors.
    """
    import gguf
    from gguf import GGMLQuantizationType as T

    tensor_type = T.F16 if tensor_type is None else tensor_type
    rng = np.random.default_rng(seed)
    kwargs = {"split_max_tensors": split_max_tensors} if split_max_tensors else {}
    w = gguf.GGUFWriter(str(path), arch, **kwargs)
    w.add_name("ktconvert tiny test model")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts)
    w.add_expert_used_count(min(2, experts))
    w.add_expert_feed_forward_length(inter)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    f16 = lambda name, shape: w.add_tensor(name, _weights(rng, shape).astype(np.float16))  # noqa: E731
    f32 = lambda name, shape: w.add_tensor(name, np.ones(shape, dtype=np.float32))  # noqa: E731
    f16("token_embd.weight", (vocab, hidden))
    f32("output_norm.weight", (hidden,))
    f16("output.weight", (vocab, hidden))
    experts_f32: dict[str, np.ndarray] = {}
    for L in range(layers):
        f32(f"blk.{L}.attn_norm.weight", (hidden,))
        f16(f"blk.{L}.attn_q.weight", (heads * head_dim, hidden))
        f16(f"blk.{L}.attn_k.weight", (kv_heads * head_dim, hidden))
        f16(f"blk.{L}.attn_v.weight", (kv_heads * head_dim, hidden))
        f16(f"blk.{L}.attn_output.weight", (hidden, heads * head_dim))
        f32(f"blk.{L}.attn_q_norm.weight", (head_dim,))
        f32(f"blk.{L}.attn_k_norm.weight", (head_dim,))
        f32(f"blk.{L}.ffn_norm.weight", (hidden,))
        w.add_tensor(f"blk.{L}.ffn_gate_inp.weight", _weights(rng, (experts, hidden)))
        for proj, shape in (("gate", (experts, inter, hidden)), ("up", (experts, inter, hidden)),
                            ("down", (experts, hidden, inter))):
            name = f"blk.{L}.ffn_{proj}_exps.weight"
            experts_f32[name] = _weights(rng, shape)
            if tensor_type in (T.F32, T.F16):
                w.add_tensor(name, gguf.quants.quantize(experts_f32[name], tensor_type))
            else:
                w.add_tensor(name, gguf.quants.quantize(experts_f32[name], tensor_type), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return experts_f32


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _expert_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors if "_exps." in t.name}


def main() -> int:
    import ctypes
    from importlib.metadata import version

    import llama_cpp

    gguf_version = version("gguf")

    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tiny-qwen3moe-F16.gguf"
        write_moe_gguf(src, **{k: v for k, v in TINY.items()})
        for ftype, out_name in FTYPES.items():
            out = HERE / out_name
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.nthread = 1
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
            if rc != 0:
                print(f"{ftype}: llama_model_quantize returned {rc}", file=sys.stderr)
                return 1
            records[out_name] = {"tool": "llama-cpp-python llama_model_quantize", "tool_version": llama_cpp.__version__,
                                 "ftype": f"LLAMA_FTYPE_MOSTLY_{ftype}", "nthread": 1,
                                 "source": f"write_moe_gguf(F16, seed 0, {json.dumps(TINY)}) with gguf {gguf_version}",
                                 "bytes": out.stat().st_size, "sha256": _sha256(out),
                                 "expert_tensor_types": _expert_types(out)}
            print(f"{out_name}: {out.stat().st_size} bytes", file=sys.stderr)
    (HERE / "SOURCES.json").write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

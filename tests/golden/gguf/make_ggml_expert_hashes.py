"""Regenerate ggml-expert-hashes.json: sha256 of every routed-expert tensor of the tiny qwen3_moe model as llama.cpp's
quantizer writes it, per ggml type (SLOW, not run by tests; needs libggml-base, see make_ggml_quant_fixture.py).

The model is ``make_tiny_model(OUT, "qwen3_moe", **TINY)`` (seed 0, BF16). Each tensor ``blk.L.ffn_{gate,up,down}_
exps.weight`` is the experts' BF16 values, widened to float32 (exact) and stacked [E, rows, cols] as a GGUF holds
them, passed to ``ggml_quantize_chunk(type, ..., imatrix=NULL)`` (what ``llama_model_quantize`` calls per tensor,
after converting BF16 to float32 the same way); tests/test_llamafile.py converts the same model with the LLAMAFILE
method and compares its tensor hashes with these.

    python tests/golden/gguf/make_ggml_expert_hashes.py build/bin/libggml-base.so
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "ggml-expert-hashes.json"
TINY = dict(hidden=256, intermediate=512, experts=4, layers=2)
TYPES = {"F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}


def tiny_expert_matrices(tiny: dict = TINY):
    """(tensor name, [float32 matrix per expert]) of every routed-expert tensor of make_tiny_model(qwen3_moe,
    **tiny), in file order: the experts' BF16 values widened to float32 (exact)."""
    from ktconvert.examples.tiny import make_tiny_model
    from ktconvert.formats.sources import open_source
    from ktconvert.quant.bf16 import bf16_bits_to_f32

    with tempfile.TemporaryDirectory() as tmp:
        source = open_source(make_tiny_model(Path(tmp) / "m", "qwen3_moe", **tiny))
        for layer in source.info.moe_layers:
            experts = [source.read_expert(layer, e) for e in range(source.info.n_experts)]
            for proj in ("gate", "up", "down"):
                yield f"blk.{layer}.ffn_{proj}_exps.weight", [bf16_bits_to_f32(getattr(w, proj)) for w in experts]


def main(lib_path: str) -> int:
    spec = importlib.util.spec_from_file_location("cases", HERE / "make_ggml_quant_fixture.py")
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)
    lib = ctypes.CDLL(lib_path)
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    hashes: dict[str, dict[str, str]] = {name: {} for name in TYPES}
    for tensor, matrices in tiny_expert_matrices():
        x = np.stack(matrices).astype(np.float32)
        rows = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        for name, tid in TYPES.items():
            raw = fixture.ggml_quantize(lib, tid, rows, lib.ggml_row_size(tid, rows.shape[1]))
            hashes[name][tensor] = hashlib.sha256(raw.tobytes()).hexdigest()
    record = {"tool": "llama-cpp-python 0.3.36 vendored llama.cpp, libggml-base ggml_quantize_chunk, imatrix NULL",
              "model": f"ktconvert.examples.tiny.make_tiny_model(qwen3_moe, seed 0, {json.dumps(TINY)})",
              "sha256": hashes}
    OUT.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

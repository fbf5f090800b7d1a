"""Every input format through every output method, end to end: convert, then `verify --hashes --source` passes
(structure, sha256 of every file and tensor, the native kernels or decoders on the written files, error against
the source weights within the method's limit)."""
from __future__ import annotations

import pytest

from ktconvert.cpu.convert import convert_cpu
from ktconvert.verification.run import verify

INPUTS = [("deepseek_v3", "fp8"), ("kimi_k2", "ct-int4"), ("gpt_oss", "mxfp4"), ("qwen3_moe", "fp16"),
          ("mixtral", "fp32"), ("qwen3_moe", "gptq-int4-actorder"), ("deepseek_v3", "awq-int4"),
          ("minimax_m2", "mxfp8"), ("qwen3_5_moe", "nvfp4"), ("glm4_moe", "fp8-channel")]
METHODS = ["amxint4", "amxint8", "bf16", "rawint4", "fp8"]


@pytest.mark.parametrize("arch,dtype", INPUTS)
def test_input_through_every_method(tiny_model, tmp_path, arch, dtype):
    from ktconvert.formats.hf_source import HFSource

    model = tiny_model(arch, dtype=dtype)
    src = HFSource.open(model)
    expected_format = {"fp8": "fp8-block", "ct-int4": "ct-int4", "mxfp4": "mxfp4",
                       "gptq-int4-actorder": "gptq-int4"}.get(dtype, dtype)
    assert src.input_format == expected_format
    for method in METHODS:
        out = tmp_path / method
        convert_cpu(model, out, method=method, numa=2, allow_drop_bias=True)
        result = verify(out, source=str(model), hashes=True, layers="all")
        assert result["ok"], (method, result["problems"])
        assert result["numerics"]["layers"], method


@pytest.mark.parametrize("fixture", ["tiny-qwen3moe-Q4_K_M.gguf", "tiny-qwen3moe-IQ4_XS.gguf"])
def test_gguf_through_every_method(tmp_path, fixture):
    """GGUF files quantized by llama.cpp itself (tests/golden/gguf): convert, then verify against the GGUF."""
    from pathlib import Path

    model = Path(__file__).parent / "golden" / "gguf" / fixture
    for method in METHODS:
        out = tmp_path / method
        convert_cpu(model, out, method=method, numa=1)
        result = verify(out, source=str(model), hashes=True, layers="all")
        assert result["ok"], (method, result["problems"])

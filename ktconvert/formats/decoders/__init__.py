"""Decoders of HF weights into BF16 bits, one per storage scheme, and the one parser of ``quantization_config``.

``base`` holds the QuantScheme / QuantGroup / MatrixRefs types, the registry ``DECODERS`` and ``detect_scheme`` /
``locate`` / ``validate_matrix`` / ``decode_matrix``; ``plain`` (BF16 / F16 / F32), ``fp8`` (DeepSeek block FP8,
compressed-tensors float-quantized), ``packed`` (compressed-tensors pack-quantized), ``mxfp4`` (gpt-oss), ``gptq``
(AutoGPTQ / GPTQModel v1 and v2), ``awq`` (AutoAWQ GEMM), ``fp8_scaled`` (per-channel / per-tensor FP8, MXFP8),
``nvfp4`` (ModelOpt NVFP4, compressed-tensors NVFP4 / MXFP4, ModelOpt's quant_algo dispatch), ``deepseek_v4``
(DeepSeek-V4's FP4 experts and ue8m0 FP8 linears, claimed before any quant_method) are the decoders. A new
quantized input is one Decoder subclass in a module imported here.
"""
from ktconvert.formats.decoders import (awq, deepseek_v4, fp8, fp8_scaled, gptq, mxfp4, nvfp4,  # noqa: F401
                                        packed, plain)
from ktconvert.formats.decoders.base import (DECODERS, Decoder, MatrixRefs, QuantGroup, QuantScheme, config_summary,
                                             decode_matrix, detect_scheme, has_weight, input_format, locate,
                                             stored_arrays, stored_specs, validate_matrix)

__all__ = ["DECODERS", "Decoder", "MatrixRefs", "QuantGroup", "QuantScheme", "config_summary", "decode_matrix",
           "detect_scheme", "has_weight", "input_format", "locate", "stored_arrays", "stored_specs",
           "validate_matrix"]

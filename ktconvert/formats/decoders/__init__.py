"""Decoders of HF weights into BF16 bits, one per storage scheme, and the one parser of ``quantization_config``.

``base`` holds the QuantScheme / QuantGroup / MatrixRefs types, the registry ``DECODERS`` and ``detect_scheme`` /
``locate`` / ``validate_matrix`` / ``decode_matrix``; ``plain`` (BF16 / F16 / F32), ``fp8`` (DeepSeek block FP8,
compressed-tensors float-quantized), ``packed`` (compressed-tensors pack-quantized), ``mxfp4`` (gpt-oss) are the
decoders. A new quantized input is one Decoder subclass in a module imported here.
"""
from ktconvert.formats.decoders import fp8, mxfp4, packed, plain  # noqa: F401  (register the decoders)
from ktconvert.formats.decoders.base import (DECODERS, Decoder, MatrixRefs, QuantGroup, QuantScheme, config_summary,
                                             decode_matrix, detect_scheme, has_weight, input_format, locate,
                                             stored_arrays, stored_specs, validate_matrix)

__all__ = ["DECODERS", "Decoder", "MatrixRefs", "QuantGroup", "QuantScheme", "config_summary", "decode_matrix",
           "detect_scheme", "has_weight", "input_format", "locate", "stored_arrays", "stored_specs",
           "validate_matrix"]

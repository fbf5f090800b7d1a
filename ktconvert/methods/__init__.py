"""CPU output methods, one class each: ``METHODS.get("amxint4") -> AmxInt4``.

``base`` holds ``CpuMethod`` (every rule a method has, as class data and classmethods) and the registry; ``amx``
the converted AMXINT4 / AMXINT8 tiles; ``inplace`` the HF-tensor methods kt-kernel reads in place (BF16, RAWINT4,
FP8); ``llamafile`` LLAMAFILE (GGUF experts, or a GGUF source read as is); ``native`` the in-place FP8_PERCHANNEL,
GPTQ_INT4, MXFP8 and NVFP4; ``mxfp4`` the in-place MXFP4 (DeepSeek-V4's expert format). Importing this package
registers every method. A new method is a subclass with its own ``name`` in one of these modules (or a new module
imported here).
"""
from ktconvert.methods import amx, inplace, llamafile, mxfp4, native  # noqa: F401  (registers the methods)
from ktconvert.methods.base import METHODS, CpuMethod, all_methods, writable_names

__all__ = ["METHODS", "CpuMethod", "all_methods", "writable_names"]

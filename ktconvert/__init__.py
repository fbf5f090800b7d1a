"""ktconvert: streaming weight converter for KTransformers hybrid CPU/GPU MoE inference.

Importing this package loads nothing heavy (no numpy, torch or safetensors); the public entry points import
their implementation on first use.
"""
from ktconvert.errors import KtConvertError

__version__ = "0.1.0"
__all__ = ["KtConvertError", "__version__"]

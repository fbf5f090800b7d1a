"""ktconvert: streaming weight converter for KTransformers hybrid CPU/GPU MoE inference.

Importing this package loads nothing heavy (no numpy, torch or safetensors); the public entry points import
their implementation on first use::

    import ktconvert
    ktconvert.convert_cpu("/models/Qwen3-30B-A3B", "out", method="amxint4", numa=2)
    ktconvert.convert_gpu("/models/Qwen3-30B-A3B", "out-gpu", experts="w4a16")

`ktconvert.cpu.plan.plan`, `ktconvert.inspect.inspect` and `ktconvert.verify.verify` are the no-weights analysis and
the verifier (modules of the same names).
"""
from ktconvert.errors import KtConvertError

__version__ = "0.1.0"
__all__ = ["KtConvertError", "__version__", "convert_cpu", "convert_gpu"]

_LAZY = {
    "convert_cpu": ("ktconvert.cpu.convert", "convert_cpu"),
    "convert_gpu": ("ktconvert.gpu.convert", "convert_gpu"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'ktconvert' has no attribute {name!r}")

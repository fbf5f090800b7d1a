"""ktconvert: streaming weight converter for KTransformers hybrid CPU/GPU MoE inference.

Importing this package loads nothing heavy (no numpy, torch or safetensors); the public entry points (defined in
``ktconvert.api``, where their docstrings give the accepted values, the progress protocol and the exceptions)
are imported on first use::

    import ktconvert
    r = ktconvert.convert_cpu("/models/Qwen3-30B-A3B", "out", method="amxint4", numa=2)   # ConvertResult
    ktconvert.convert_gpu("/models/Qwen3-30B-A3B", "out-gpu", experts="w4a16")
    ktconvert.convert("/models/Qwen3-30B-A3B", targets=[{"cpu": "out-int4", "method": "amxint4", "numa": 2},
                                                        {"cpu": "out-int8", "method": "amxint8"},
                                                        {"gpu": "out-gpu", "experts": "w4a16"}])  # one read
    ktconvert.plan("/models/Qwen3-30B-A3B", method="amxint4", numa=2)                 # PlanResult
    ktconvert.inspect("/models/Qwen3-30B-A3B")                                        # InspectResult
    ktconvert.verify("out", source="/models/Qwen3-30B-A3B", hashes=True).ok          # VerifyResult
    ktconvert.check("out", ["--kt-method", "AMXINT4", "--kt-threadpool-count", "2"]).exit_code   # CheckResult
    ktconvert.bundle("out", "out.tar.zst"); ktconvert.publish("out", "me/model")     # dicts
    ktconvert.batch("jobs.toml")                                                      # per-job summary
    ktconvert.expert_stats("/models/Qwen3-30B-A3B", "experts.pt", "calib.jsonl")     # needs [gpu]
"""
from ktconvert.errors import KtConvertError

__version__ = "0.1.0"

_API = ("ConvertResult", "CpuOptions", "GpuOptions", "InspectResult", "PlanResult", "VerifyResult", "batch", "bundle",
        "check", "convert", "convert_cpu", "convert_gpu", "expert_stats", "families", "inspect", "load_jobs", "merge", "plan",
        "publish", "unbundle", "verify")
__all__ = ["KtConvertError", "__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from ktconvert import api

        return getattr(api, name)
    raise AttributeError(f"module 'ktconvert' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))

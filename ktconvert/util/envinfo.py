"""`ktconvert env`: what this machine offers the converter (versions, CPU features, native implementation, what
hashes output files: the native SHA-NI hasher, two streams per core, or hashlib)."""
from __future__ import annotations

import os
import platform
from importlib import metadata

from ktconvert import native
from ktconvert.native import sha256 as native_sha256

PACKAGES = ("ktconvert", "numpy", "safetensors", "gguf", "huggingface-hub", "torch", "compressed-tensors",
            "llmcompressor", "transformers", "kt-kernel")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_flags() -> list[str]:
    """x86 feature flags relevant to kt-kernel and our native code, from /proc/cpuinfo (Linux)."""
    wanted = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
              "amx_int8", "amx_bf16"}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return sorted(wanted & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def env_info() -> dict:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "native": {"available": native.available(), "implementation": native.implementation()},
        "file_sha256": "native sha-ni, two streams per core" if native_sha256.runs_sha_ni() else "hashlib",
        "packages": {name: _version(name) for name in PACKAGES},
    }

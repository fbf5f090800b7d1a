"""Shared fixtures. `tiny_model(arch, **kw) -> Path` builds a seeded tiny checkpoint once per session and argument
set (ktconvert.testing.tiny.make_tiny_model keywords: layers, experts, hidden, intermediate, dtype, seed). Treat the returned
directory as read-only: other tests get the same one."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from ktconvert.testing.tiny import make_tiny_model

    cache: dict[tuple, Path] = {}

    def build(arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kw.items())])
            cache[key] = make_tiny_model(tmp_path_factory.mktemp("tiny") / name, arch, **kw)
        return cache[key]

    return build

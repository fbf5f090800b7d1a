"""Folder contents as data, for tests that compare a run's output folder with a reference run's byte for byte."""
from __future__ import annotations

from pathlib import Path


def tree(folder: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `folder`."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

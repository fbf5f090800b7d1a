"""An output folder as ``verify`` sees it, read once: every ``*.safetensors`` header under it (recursively, as
kt-kernel's loader globs) and every file of its ``_layer_*`` trees. The structure check, the hash check, the
runtime reader and the numeric checks all use this one walk, so a shard header is parsed once per verify.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.formats.safetensors_reader import Checkpoint, ShardHeader, parse_header
from ktconvert.util.safe_read import read_json


@dataclass
class OutputFolder:
    """root; shards {relative path: ShardHeader}; entries {tensor key: (shard relative path, TensorRef)} over every
    shard; header_errors {relative path: message} of shards whose header does not parse; duplicate_names
    [(path, first path with that file name)] (kt-kernel keys shards by file name); duplicate_keys [(key, path,
    first path holding it)]; tree {relative path: bytes} of every file under the top-level ``_layer_*`` folders."""

    root: Path
    shards: dict[str, ShardHeader] = field(default_factory=dict)
    entries: dict = field(default_factory=dict)
    header_errors: dict[str, str] = field(default_factory=dict)
    duplicate_names: list[tuple[str, str]] = field(default_factory=list)
    duplicate_keys: list[tuple[str, str, str]] = field(default_factory=list)
    tree: dict[str, int] = field(default_factory=dict)

    @classmethod
    def scan(cls, root) -> "OutputFolder":
        """Walk `root` once (sorted, so reports are deterministic) and parse every shard header."""
        folder = cls(Path(root))
        basenames: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(folder.root):
            dirnames.sort()
            for name in sorted(f for f in filenames if f.endswith(".safetensors")):
                path = Path(dirpath) / name
                rel = path.relative_to(folder.root).as_posix()
                if name in basenames:
                    folder.duplicate_names.append((rel, basenames[name]))
                basenames.setdefault(name, rel)
                folder._add_shard(rel, path)
        folder.tree = _layer_trees(folder.root)
        return folder

    def _add_shard(self, rel: str, path: Path) -> None:
        try:
            header = parse_header(path)
        except InputError as exc:
            self.header_errors[rel] = str(exc)
            return
        self.shards[rel] = header
        for key, ref in header.tensors.items():
            if key in self.entries:
                self.duplicate_keys.append((key, rel, self.entries[key][0]))
            self.entries[key] = (rel, ref)

    def top_level_shards(self) -> list[str]:
        """Relative paths of the shards directly in root (what SGLang and kt-kernel's merged mode look at)."""
        return sorted(rel for rel in list(self.shards) + list(self.header_errors) if "/" not in rel)

    def checkpoint(self) -> Checkpoint:
        """The top-level shards as a Checkpoint (config.json included), from the headers parsed by the walk;
        InputError for an unreadable header."""
        if self.header_errors:
            raise InputError(sorted(self.header_errors.items())[0][1])
        shards = [self.shards[rel] for rel in self.top_level_shards()]
        config_file = self.root / "config.json"
        config = read_json(config_file, what="config.json") if config_file.is_file() else {}
        tensors = {key: ref for shard in shards for key, ref in shard.tensors.items()}
        return Checkpoint(root=self.root, config=config, tensors=tensors, shards=shards)


def _layer_trees(root: Path) -> dict[str, int]:
    """{relative path: size} of every file under root's ``_layer_*`` folders (including leftover .partial ones)."""
    found = {}
    if not root.is_dir():
        return found
    for name in sorted(os.listdir(root)):
        if not name.startswith("_layer_") or not (root / name).is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root / name):
            dirnames.sort()
            for fname in filenames:
                path = Path(dirpath) / fname
                found[path.relative_to(root).as_posix()] = path.stat().st_size
    return found

"""The resume journal `.ktconvert-journal.json` in an output directory being written.

It records the options the run was started with, each finished layer's output files and tensor hashes, and the
digest of each source file read to its end. `--resume` skips finished layers (after checking their files are
still there with the recorded size) and fully hashed source files, so a resumed run writes the same bytes, the
manifest included, as an uninterrupted one. The journal is rewritten atomically after every layer and removed
when the output is complete.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ktconvert.errors import OutputError
from ktconvert.formats.out_manifest import JOURNAL_NAME
from ktconvert.safe_read import MAX_MANIFEST_BYTES, read_json


class Journal:
    def __init__(self, out_dir: Path, options: dict, state: dict | None = None):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / JOURNAL_NAME
        self.options = options
        self.layers: dict[int, dict] = {}
        self.sources: dict[str, dict] = {}
        if state:
            self.layers = {int(k): v for k, v in state.get("layers", {}).items()}
            self.sources = dict(state.get("sources", {}))

    @classmethod
    def start(cls, out_dir: Path, options: dict, resume: bool) -> "Journal":
        """A fresh journal, or with resume=True the existing one (its options must equal `options`)."""
        path = Path(out_dir) / JOURNAL_NAME
        if not resume or not path.exists():
            journal = cls(out_dir, options)
            journal.save()
            return journal
        state = read_json(path, what="resume journal", max_bytes=MAX_MANIFEST_BYTES, error=OutputError)
        if not isinstance(state, dict):
            raise OutputError("resume journal is not a JSON object", file=path, hint="start over with --force")
        if state.get("options") != options:
            changed = sorted(k for k in set(options) | set(state.get("options", {}))
                             if options.get(k) != state.get("options", {}).get(k))
            raise OutputError("cannot resume: the output was started with different options or source", file=path,
                              expected=", ".join(f"{k}={state.get('options', {}).get(k)!r}" for k in changed),
                              found=", ".join(f"{k}={options.get(k)!r}" for k in changed),
                              hint="use the original options, or --force to start over")
        journal = cls(out_dir, options, state)
        journal._drop_missing_layers()
        return journal

    def _drop_missing_layers(self) -> None:
        """Forget finished layers whose files are gone or have the wrong size (they are redone)."""
        for layer in list(self.layers):
            for rec in self.layers[layer]["files"]:
                target = self.out_dir / rec["path"]
                if not target.is_file() or target.stat().st_size != rec["bytes"]:
                    del self.layers[layer]
                    break

    def layer_done(self, layer: int) -> bool:
        return layer in self.layers

    def finish_layer(self, layer: int, files: list[dict], tensors: dict[str, str]) -> None:
        self.layers[layer] = {"files": files, "tensors": tensors}
        self.save()

    def source_digest(self, name: str) -> dict | None:
        return self.sources.get(name)

    def finish_source(self, name: str, digest: dict) -> None:
        self.sources[name] = digest
        self.save()

    def save(self) -> None:
        state = {"options": self.options, "layers": {str(k): v for k, v in sorted(self.layers.items())},
                 "sources": self.sources}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

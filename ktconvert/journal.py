"""The resume journal `.ktconvert-journal.json` in an output directory being written.

It records the options the run was started with, each finished layer's output files and tensor hashes, and the
digest of each source file read to its end. `--resume` skips finished layers (after checking their files are
still there with the recorded size) and fully hashed source files, so a resumed run writes the same bytes, the
manifest included, as an uninterrupted one. The journal is rewritten atomically after every layer and removed
when the output is complete, with the calibration stream's state a ``--quant gptq`` run keeps beside it.
"""
from __future__ import annotations

import json
from pathlib import Path

from ktconvert.errors import OutputError, ResumeMismatchError
from ktconvert.formats.fileio import write_atomic
from ktconvert.formats.out_manifest import JOURNAL_NAME, STREAM_STATE_NAME
from ktconvert.safe_read import MAX_MANIFEST_BYTES, read_json


# the command-line option behind a journal / manifest key where it is not "--" + the key with dashes
OPTION_OF = {"layers": "--include-mtp (MoE layers)", "model.layers": "--include-mtp (MoE layers)",
             "source_config_sha256": "SRC", "kind": "output kind"}


def option_name(key: str) -> str:
    """The command-line option that sets journal / manifest key `key` ("group_size" -> "--group-size")."""
    if key == "source" or key.startswith("source."):
        return "SRC"
    return OPTION_OF.get(key) or "--" + key.split(".")[-1].replace("_", "-")


def _shown(option: str, value) -> str:
    if isinstance(value, bool):
        return option if value else f"no {option}"
    text = str(value)
    return f"{option} {text if len(text) <= 40 else text[:37] + '...'}"


def mismatch_error(out_dir, differences: list[tuple[str, object, object]]) -> ResumeMismatchError:
    """The error of a --resume whose options differ from OUT's: differences = [(option, OUT's value, requested
    value)], one entry per option (later entries of an option already named are dropped)."""
    named: dict[str, tuple] = {}
    for option, recorded, requested in differences:
        named.setdefault(option, (recorded, requested))
    return ResumeMismatchError(
        "cannot resume: the output was written with different options or another source", file=str(out_dir),
        expected=", ".join(_shown(o, rec) for o, (rec, _) in named.items()),
        found=", ".join(_shown(o, req) for o, (_, req) in named.items()),
        hint="resume with OUT's options, or pass --force to start over")


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
            (Path(out_dir) / STREAM_STATE_NAME).unlink(missing_ok=True)
            journal = cls(out_dir, options)
            journal.save()
            return journal
        state = read_json(path, what="resume journal", max_bytes=MAX_MANIFEST_BYTES, error=OutputError)
        if not isinstance(state, dict):
            raise OutputError("resume journal is not a JSON object", file=path, hint="start over with --force")
        recorded = state.get("options")
        if not isinstance(recorded, dict):
            raise OutputError("resume journal records no options", file=path, hint="start over with --force")
        if recorded != options:
            changed = sorted(k for k in set(options) | set(recorded) if options.get(k) != recorded.get(k))
            raise mismatch_error(out_dir, [(option_name(k), recorded.get(k), options.get(k)) for k in changed])
        try:
            journal = cls(out_dir, options, state)
            journal._drop_missing_layers()
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise OutputError(f"resume journal is damaged ({type(exc).__name__}: {exc})", file=path,
                              hint="start over with --force") from None
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
        write_atomic(self.path, json.dumps(state, sort_keys=True).encode(),     # never through a symlink
                     temp=self.path.with_name(self.path.name + ".tmp"))

    def remove(self) -> None:
        """Remove the journal and the calibration stream's state saved with it (gptq/resume.py)."""
        self.path.unlink(missing_ok=True)
        (self.out_dir / STREAM_STATE_NAME).unlink(missing_ok=True)

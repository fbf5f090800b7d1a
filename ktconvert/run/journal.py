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
from ktconvert.util.safe_read import MAX_MANIFEST_BYTES, read_json


# the command-line option behind a journal / manifest key where it is not "--" + the key with dashes
OPTION_OF = {"layers": "--include-mtp (MoE layers)", "model.layers": "--include-mtp (MoE layers)",
             "source_config_sha256": "SRC", "kind": "output kind"}


def option_name(key: str) -> str:
    """The command-line option that sets journal / manifest key `key` ("group_size" -> "--group-size")."""
    if key == "source" or key.startswith("source."):
        return "SRC"
    return OPTION_OF.get(key) or "--" + key.split(".")[-1].replace("_", "-")


def _shown(option: str, recorded, requested) -> tuple[str, str]:
    """How OUT's value and the requested one of `option` read in the error: str() (repr(), then with the type, where
    two different values read the same), at most 40 characters each, cut around the first character where the two
    differ: never the same text for two different values."""
    if isinstance(recorded, bool) and isinstance(requested, bool):
        return tuple(option if value else f"no {option}" for value in (recorded, requested))
    texts = [str(recorded), str(requested)]
    if texts[0] == texts[1]:
        texts = [repr(recorded), repr(requested)]
    if texts[0] == texts[1]:
        texts = [f"{type(value).__name__} {text}" for value, text in zip((recorded, requested), texts)]
    first = next((i for i, (a, b) in enumerate(zip(*texts)) if a != b), min(map(len, texts)))
    start = 0 if first < 30 else first - 15
    return tuple(f"{option} {_cut(text, start)}" for text in texts)


def _cut(text: str, start: int) -> str:
    if len(text) <= 40:
        return text
    head = "..." if start else ""
    return head + text[start:start + 37 - len(head)] + ("..." if start + 37 - len(head) < len(text) else "")


def mismatch_error(out_dir, differences: list[tuple[str, object, object]]) -> ResumeMismatchError:
    """The error of a --resume whose options differ from OUT's: differences = [(option, OUT's value, requested
    value)], one entry per option (later entries of an option already named are dropped)."""
    named: dict[str, tuple] = {}
    for option, recorded, requested in differences:
        named.setdefault(option, _shown(option, recorded, requested))
    return ResumeMismatchError(
        "cannot resume: the output was written with different options or another source", file=str(out_dir),
        expected=", ".join(rec for rec, _ in named.values()), found=", ".join(req for _, req in named.values()),
        hint="resume with OUT's options, or pass --force to start over")


def source_mismatch(out_dir, name: str, expected: str, found: str) -> ResumeMismatchError:
    """The error of a --resume whose source file `name` is not the one the interrupted run read."""
    return ResumeMismatchError("cannot resume: SRC is not the source the output was being written from (this file "
                               "differs from the one the interrupted run read)", file=str(out_dir), tensor=name,
                               expected=expected, found=found,
                               hint="resume with the source OUT was started from, or pass --force to start over")


def digest_mismatch(out_dir, name: str, recorded: dict, found: dict) -> ResumeMismatchError:
    """source_mismatch for two digests {"bytes", "blake3" or "sha256"}: the size where it differs, else the digest."""
    key = "bytes" if recorded.get("bytes") != found.get("bytes") else "blake3" if "blake3" in recorded else "sha256"
    return source_mismatch(out_dir, name, f"{key} {recorded.get(key)}", f"{key} {found.get(key)}")


class Journal:
    def __init__(self, out_dir: Path, options: dict, state: dict | None = None):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / JOURNAL_NAME
        self.options = options
        self.layers: dict[int, dict] = {}
        self.sources: dict[str, dict] = {}
        self.seen: dict[str, dict] = {}      # per finished source file: head_sha256, stat identity (source_identity)
        if state:
            self.layers = {int(k): v for k, v in state.get("layers", {}).items()}
            self.sources = dict(state.get("sources", {}))
            self.seen = {k: dict(v) for k, v in state.get("seen", {}).items()}

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

    def forget_layers(self, layers) -> None:
        """Forget finished `layers` (they are redone), e.g. those made from source bytes no digest vouches for."""
        dropped = [layer for layer in layers if self.layers.pop(layer, None) is not None]
        if dropped:
            self.save()

    def finish_source(self, name: str, digest: dict, seen: dict | None = None) -> None:
        """Record source file `name` read to its end: digest {"bytes", "sha256"} (the manifest's entry), seen what
        tells a resume cheaply that it is still that file (source_identity). A digest recorded before must be the
        same: ResumeMismatchError otherwise (the source changed under an unfinished OUT)."""
        recorded = self.sources.get(name)
        if recorded is not None and recorded != digest:
            raise digest_mismatch(self.out_dir, name, recorded, digest)
        self.sources[name] = digest
        if seen:
            self.seen[name] = dict(seen)
        self.save()

    def save(self) -> None:
        state = {"options": self.options, "layers": {str(k): v for k, v in sorted(self.layers.items())},
                 "sources": self.sources, "seen": self.seen}
        write_atomic(self.path, json.dumps(state, sort_keys=True).encode(),     # never through a symlink
                     temp=self.path.with_name(self.path.name + ".tmp"))

    def remove(self) -> None:
        """Remove the journal and the calibration stream's state saved with it (gptq/resume.py)."""
        self.path.unlink(missing_ok=True)
        (self.out_dir / STREAM_STATE_NAME).unlink(missing_ok=True)

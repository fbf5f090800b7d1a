"""Resuming a calibrated (``--quant gptq``) conversion at decoder-layer granularity.

Each layer's GPTQ needs the hidden states the quantized layers before it produced, so a resumed run cannot simply
skip the finished layers' work. Next to the journal, OUT holds ``STREAM_STATE_NAME``: the calibration stream's
hidden states after the last layer saved (per sample [1, S, H], the stream's dtype), the per-layer summaries of the
layers up to it (JSON: routed tokens, experts written data-free, ...) and a digest of the calibration samples. A
resumed run restores the stream from it and goes on with the next layer; layers the journal records as finished
but the state does not cover are recomputed (their files are not rewritten). Without a usable state the stream
starts again at layer 0. Every path gives the bytes an uninterrupted run writes: the saved tensors are the exact
ones, and the stream is deterministic.

The state is written (temp name, fsync, rename) after a MoE layer is journalled when ``every_s`` seconds have
passed since the last save (0: after every layer): writing it costs one copy of the calibration activations.
The journal's removal at the end of the run removes it (journal.Journal.remove).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from ktconvert.errors import ResumeMismatchError
from ktconvert.formats.fileio import NewFile
from ktconvert.formats.out_manifest import STREAM_STATE_NAME

SAVE_EVERY_S = 300.0   # default spacing of the saves (seconds of stream work between two)


def samples_digest(samples: list) -> str:
    """sha256 over the calibration samples (1-D int64 token tensors, in the order given): lengths and tokens."""
    import numpy as np

    h = hashlib.sha256()
    for ids in samples:
        arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
        h.update(len(arr).to_bytes(8, "little"))
        h.update(arr.tobytes())
    return h.hexdigest()


class StreamState:
    """OUT's saved stream state. out_dir: the output directory; digest: samples_digest of this run's calibration;
    every_s: seconds between saves (0: every layer)."""

    def __init__(self, out_dir, digest: str, every_s: float | None = None):
        self.path = Path(out_dir) / STREAM_STATE_NAME
        self.digest, self.every_s = digest, SAVE_EVERY_S if every_s is None else every_s
        self.last_save = time.monotonic()

    def restore(self, stream, unfinished: list[int]) -> dict:
        """Move `stream` (gptq.stream.DecoderStream, nothing run yet) past the saved layer; returns the saved
        per-layer summaries {layer: dict}, or {} (the stream starts at layer 0) without a state or when one of
        `unfinished` (the output's layers the journal does not record as written) is at or before the saved
        layer. ResumeMismatchError when the state was written with other calibration samples."""
        import torch

        if not self.path.is_file():
            return {}
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        if any(layer <= int(state["layer"]) for layer in unfinished):
            return {}
        if state["digest"] != self.digest:
            raise ResumeMismatchError("cannot resume: the calibration samples differ from the interrupted run's",
                                      file=str(self.path), expected=f"samples sha256 {state['digest'][:16]}...",
                                      found=f"samples sha256 {self.digest[:16]}...",
                                      hint="resume with the same --calibration, or pass --force to start over")
        stream.skip_to(int(state["layer"]), state["hidden"])
        return {int(k): v for k, v in json.loads(state["summaries"]).items()}

    def save(self, stream, summaries: dict, *, force: bool = False) -> None:
        """Save the stream after its last run layer with `summaries` ({layer: JSON-able dict}), when due."""
        import torch

        if not force and time.monotonic() - self.last_save < self.every_s:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        state = {"layer": stream.done, "hidden": list(stream.hidden), "digest": self.digest,
                 "summaries": json.dumps({str(k): v for k, v in sorted(summaries.items())})}
        new = NewFile(self.path, temp=tmp)      # never written through a symlink (fileio.NewFile)
        try:
            with os.fdopen(new.fd, "wb", closefd=False) as fh:
                torch.save(state, fh)
            new.commit()
        except BaseException:
            new.discard()
            raise
        self.last_save = time.monotonic()


def restore_for(output, stream) -> tuple[StreamState, dict]:
    """(output's StreamState for `stream`, the per-layer summaries restored from it): `stream` (built with its
    ``samples_digest``, nothing run yet) moved past the layer saved in `output`'s folder when the output resumes
    (``output.resume``; layers its journal does not record as written count as unfinished), else ({} summaries)
    left at layer 0."""
    saved = StreamState(output.out_dir, stream.samples_digest)
    unfinished = [layer for layer in output.layers if not output.journal.layer_done(layer)]
    return saved, (saved.restore(stream, unfinished) if output.resume else {})

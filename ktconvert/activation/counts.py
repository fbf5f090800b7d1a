"""``expert_activation.pt``: routed calibration tokens per decoder layer and expert, in the file SGLang-KT reads
for ``--kt-expert-placement-strategy frequency --init-expert-location FILE.pt``.

What SGLang-KT does with the file (kvcache-ai/sglang, ``kt_ep_wrapper._init_kt_gpu_experts_masks`` and
``eplb/expert_location.compute_initial_expert_location_metadata``):

* only a path ending in ``.pt`` is read (any other name silently falls back to uniform counts);
* ``torch.load(path, map_location="cpu", weights_only=True)``; a dict must hold ``logical_count`` (other keys are
  ignored; a dict without it is refused), anything else is taken as the tensor itself;
* the tensor must be 3-D ``[buffer_size, num_hidden_layers, num_experts]`` with the config's layer count (every
  decoder layer, dense ones included, MTP layers not) and routed-expert count, else the server refuses to start;
* it is summed over dim 0 and converted to float32, giving kt-kernel's ``activation_freq [layers, experts]``.

ktconvert writes ``{"logical_count": int64 [1, num_hidden_layers, num_experts]}`` (dense layers zero) plus the
metadata keys of ``METADATA_KEYS`` (plain str / int / list / dict values, which weights_only loading accepts),
through ``torch.save`` into memory and then atomically into place (temporary name, rename): same counts and
metadata give the same bytes.
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError
from ktconvert.formats.fileio import write_atomic
from ktconvert.util.safe_read import check_regular

FILE_NAME = "expert_activation.pt"
FORMAT = "ktconvert-expert-activation"
FORMAT_VERSION = 1
COUNT_KEY = "logical_count"
METADATA_KEYS = ("format", "format_version", "tool_version", "model_type", "moe_layers", "top_k", "tokens",
                 "samples", "calibration_sha256", "tokens_sha256", "source", "routing")


@dataclass
class ExpertActivation:
    """counts: int64 [num_hidden_layers, num_experts], tokens routed per (layer, expert) — each token counts once
    for each of its top_k experts, so a MoE layer's row sums to tokens * top_k; dense layers are zero rows.
    meta: the METADATA_KEYS values (source fingerprint, calibration identity, how the hidden states were made)."""

    counts: np.ndarray
    meta: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.counts.shape[1])


def activation_from_layers(per_layer: dict, n_layers: int, n_experts: int, meta: dict) -> ExpertActivation:
    """ExpertActivation from {layer: counts per expert (sequence of n_experts ints)}; layers not given are zero."""
    counts = np.zeros((n_layers, n_experts), np.int64)
    for layer, row in per_layer.items():
        if len(row) != n_experts or not 0 <= int(layer) < n_layers:
            raise ValueError(f"layer {layer}: {len(row)} counts for {n_experts} experts of {n_layers} layers")
        counts[int(layer)] = np.asarray(row, np.int64)
    return ExpertActivation(counts, dict(meta))


def tokens_sha256(samples: list) -> str:
    """sha256 over the calibration token ids as streamed: per sample its length then its ids, int64 little-endian."""
    h = hashlib.sha256()
    for s in samples:
        ids = np.asarray(s.tolist() if hasattr(s, "tolist") else s, dtype="<i8")
        h.update(np.asarray([ids.size], "<i8").tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_identity(source) -> dict:
    """A cheap fingerprint of an HFSource (no weight bytes read): config.json's sha256 and, per weight file, its
    size and the sha256 of its safetensors header (tensor names, dtypes, shapes, offsets)."""
    return {"config_sha256": source.config_sha256(), "files": source.header_digests()}


def payload_bytes(activation: ExpertActivation) -> bytes:
    """The .pt file's bytes: torch.save of {"logical_count": int64 [1, L, E], **metadata}."""
    import torch

    counts = torch.from_numpy(np.ascontiguousarray(activation.counts, np.int64)).unsqueeze(0)
    data = {COUNT_KEY: counts}
    data.update({k: activation.meta[k] for k in METADATA_KEYS if k in activation.meta})
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getvalue()


def write_activation(path, activation: ExpertActivation, durable: bool = True) -> Path:
    """Write the .pt file atomically (temporary name in the same folder, then rename); returns the path."""
    path = Path(path)
    write_atomic(path, payload_bytes(activation), durable=durable)
    return path


def load_activation(path, n_layers: int | None = None, n_experts: int | None = None) -> ExpertActivation:
    """Read a counts file the way SGLang-KT does (module docstring): weights_only torch.load, dict with
    logical_count or a bare tensor, 3-D, layer / expert counts checked when given, summed over dim 0.

    Returns ExpertActivation with counts float32 [layers, experts] exactly as kt-kernel receives them
    (``.sum(dim=0).float()``) and meta = the file's other keys. InputError naming the file on anything SGLang-KT
    would refuse."""
    import torch

    path = Path(path)
    if path.suffix != ".pt":
        raise InputError("SGLang-KT reads activation counts only from a file whose name ends in .pt",
                         file=str(path), found=path.suffix or "no suffix")
    check_regular(path, "activation counts file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise InputError("activation counts file too large to be counts", file=str(path),
                         expected=f"at most {MAX_FILE_BYTES} bytes", found=f"{size} bytes")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything torch / pickle raises on a file it refuses
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise InputError(f"cannot load the file as SGLang-KT does (torch.load weights_only=True): {reason}",
                         file=str(path)) from None
    meta = {}
    if isinstance(data, dict):
        if COUNT_KEY not in data:
            raise InputError(f"no '{COUNT_KEY}' key", file=str(path), found=", ".join(map(str, data)) or "empty dict")
        meta = {k: v for k, v in data.items() if k != COUNT_KEY}
        data = data[COUNT_KEY]
    if not isinstance(data, torch.Tensor) or data.dim() != 3:
        found = f"{data.dim()}-D {list(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise InputError("activation counts must be a 3-D tensor [buffer_size, num_hidden_layers, num_experts]",
                         file=str(path), found=found)
    _, layers, experts = data.shape
    for what, want, got in (("num_hidden_layers", n_layers, layers), ("num_experts", n_experts, experts)):
        if want is not None and want != got:
            raise InputError(f"activation counts do not fit the model: {what} differs", file=str(path),
                             tensor=COUNT_KEY, expected=str(want), found=str(got))
    _check_counts(data, path)
    return ExpertActivation(data.sum(dim=0).float().numpy(), meta)


MAX_FILE_BYTES = 64 << 20     # counts of 8 snapshots x 256 layers x 4096 experts in int64: far larger than real


def _check_counts(data, path: Path) -> None:
    """Counts a router can produce: integers (or whole-number floats) >= 0, finite, each element stored once (a
    stride-0 view would make a tiny file cost minutes of summing)."""
    import torch

    where = dict(file=str(path), tensor=COUNT_KEY)
    allowed = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
               torch.float32, torch.float64)
    if data.dtype not in allowed:
        raise InputError("activation counts must be integers", expected="an integer or float tensor",
                         found=str(data.dtype).replace("torch.", ""), **where)
    if data.numel() * data.element_size() > data.untyped_storage().nbytes():
        raise InputError("activation counts tensor repeats its storage (a strided view, not counts)",
                         expected=f"{data.numel()} stored elements", found=f"{list(data.stride())} strides", **where)
    if data.numel() * data.element_size() > MAX_FILE_BYTES:
        raise InputError("activation counts tensor too large", expected=f"at most {MAX_FILE_BYTES} bytes",
                         found=f"{data.numel() * data.element_size()} bytes", **where)
    if data.is_floating_point():
        bad = ~torch.isfinite(data) | (data < 0) | (data != torch.round(data))
        if bool(bad.any()):
            value = data[bad].flatten()[0].item()
            raise InputError("activation counts must be whole numbers >= 0 (token counts)",
                             expected="finite, non-negative, integral values", found=repr(value), **where)
    elif bool((data < 0).any()):
        raise InputError("activation counts must be >= 0 (token counts)", expected="non-negative values",
                         found=repr(data[data < 0].flatten()[0].item()), **where)

"""Integrity digests of tensors and source files: BLAKE3 since manifest format_version 3, sha256 before.

A tensor's or a source file's digest is BLAKE3 (the ``blake3`` package, one thread: about twice sha256's speed on
one core) written ``"blake3:<64 hex>"``, or a sha256 written as bare 64 hex digits: the form every manifest before
format_version 3 used, and the one a tensor keeps when it is a whole file of its own (its file's sha256 already
covers its bytes). The form names the algorithm, so a checker re-hashes with whichever one a recorded value names
(``digest_like``, ``digest_algorithm``). Output files keep their sha256 (what the hubs compare: ``fileio``).

``TensorHasher``: the digest of every tensor of a .safetensors file fed in order.
"""
from __future__ import annotations

from typing import Mapping

import blake3

from ktconvert.native import sha256 as native_sha256

BLAKE3 = "blake3"
SHA256 = "sha256"
DIGEST_ALGORITHM = BLAKE3   # what new tensor and source digests use
_PREFIX = {BLAKE3: "blake3:", SHA256: ""}


def new_hash(algorithm: str = DIGEST_ALGORITHM):
    """A fresh hash object of `algorithm` ("blake3": one thread, or "sha256": ``ktconvert.native.sha256.new``),
    hashlib's interface."""
    if algorithm == BLAKE3:
        return blake3.blake3()
    if algorithm == SHA256:
        return native_sha256.new()
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def digest_text(algorithm: str, hexdigest: str) -> str:
    """The recorded form of a digest: "blake3:<hex>", or the bare hex of a sha256."""
    return _PREFIX[algorithm] + hexdigest


def digest(data, algorithm: str = DIGEST_ALGORITHM) -> str:
    """The recorded form (``digest_text``) of bytes-like `data`'s digest."""
    h = new_hash(algorithm)
    h.update(data)
    return digest_text(algorithm, h.hexdigest())


def digest_algorithm(recorded) -> str:
    """The algorithm a recorded digest names: "blake3" for "blake3:<hex>", else "sha256" (bare hex, and anything
    else: which then matches nothing a hash gives)."""
    return BLAKE3 if isinstance(recorded, str) and recorded.startswith(_PREFIX[BLAKE3]) else SHA256


def is_digest(value) -> bool:
    """Whether `value` is a recorded digest: "blake3:" or nothing, then 64 lowercase hex digits."""
    if not isinstance(value, str):
        return False
    hexdigest = value[len(_PREFIX[BLAKE3]):] if value.startswith(_PREFIX[BLAKE3]) else value
    return len(hexdigest) == 64 and all(c in "0123456789abcdef" for c in hexdigest)


def digest_like(recorded, data) -> str:
    """`data`'s digest in the algorithm and form of `recorded` (equal to it when the bytes are the ones hashed)."""
    return digest(data, digest_algorithm(recorded))


class TensorHasher:
    """The digest (``digest_text`` form) of every tensor of a file whose bytes are fed in order (``update``), from
    its tensors {name: TensorRef} (absolute offset and byte count: a .safetensors ``ShardHeader.tensors``, a GGUF's
    ``gguf_header.read_header``): ``digests()`` -> {tensor: digest} once the whole file was fed.

    algorithms: the algorithm of each tensor: one name for all, or {tensor: name} (e.g. what a manifest's recorded
    digests name, ``digest_algorithm``; a tensor it lacks gets DIGEST_ALGORITHM)."""

    def __init__(self, tensors: Mapping, algorithms: str | Mapping[str, str] = DIGEST_ALGORITHM):
        self.spans = sorted((ref.offset, ref.offset + ref.nbytes, name) for name, ref in tensors.items())
        self._algorithms = algorithms
        self.pos, self.i, self.hashes = 0, 0, {}
        self.current = self._new(self.spans[0][2]) if self.spans else None

    def _algorithm(self, name: str) -> str:
        algorithms = self._algorithms
        return algorithms if isinstance(algorithms, str) else algorithms.get(name, DIGEST_ALGORITHM)

    def _new(self, name: str):
        return new_hash(self._algorithm(name))

    def update(self, chunk) -> None:
        pos, end, spans = self.pos, self.pos + len(chunk), self.spans
        while self.i < len(spans) and spans[self.i][0] <= end:
            begin, stop, name = spans[self.i]
            self.current.update(chunk[max(begin, pos) - pos:min(stop, end) - pos])
            if stop > end:
                break
            self.hashes[name] = digest_text(self._algorithm(name), self.current.hexdigest())
            self.i += 1
            self.current = self._new(spans[self.i][2]) if self.i < len(spans) else None
        self.pos = end

    def digests(self) -> dict[str, str]:
        for _begin, _stop, name in self.spans[self.i:]:     # only empty tensors at the very end can remain
            self.hashes.setdefault(name, digest(b"", self._algorithm(name)))
        return dict(self.hashes)

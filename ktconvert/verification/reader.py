"""Open a converted CPU-expert folder the way kt-kernel 0.7.2's loader does (kt-format.md §2.3), strictly.

kt-kernel itself checks almost nothing in merged mode (a short tensor is an out-of-bounds read, a wrong-sized one is
silently garbage). Here every blob is checked against the plan of the method and NUMA count recorded in
``ktconvert.json`` (the writing sink's, ``formats.kt_sink.KtSink``, from the method's ``tensor_specs``) before
anything computes with it, and each failure is one VerifyError naming the tensor or file.

* Mode: merged when the folder's top level holds any ``*.safetensors`` (kt-kernel's ``glob``), else the ``.kt`` tree.
* Merged: every key of every ``*.safetensors`` under the folder (recursively) is indexed; per layer, experts are
  counted by probing ``blk.L.ffn_up_exps.{e}.numa.0.weight`` and NUMA parts by ``blk.L.ffn_up_exps.0.numa.{t}.weight``.
* ``.kt``: ``_layer_L/_numa_t/{INT4|INT8}_{proj}_{E}_{bytes}Byte_{quant|scale}_.kt``; the file size must equal the
  byte count in the name, which must equal the plan's.

``KtOutput.read_expert(layer, e)`` reads one expert (all projections and NUMA parts) and nothing else.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktconvert.errors import InputError, UnknownNameError, VerifyError
from ktconvert.formats.digests import digest_like
from ktconvert.formats.kt_sink import KT_LOADS, KT_PARTS, KtSink
from ktconvert.formats.out_manifest import load_manifest
from ktconvert.formats.st_writer import NUMPY_DTYPES
from ktconvert.layouts.naming import PROJS, merged_key, parse_kt_relpath, part_shape
from ktconvert.util.safe_read import check_regular, open_regular
from ktconvert.verification.folder import OutputFolder

_NUMA_DIR = re.compile(r"^_numa_(\d+)$")


@dataclass
class ExpertBlobs:
    """One expert as stored: ``parts[t] = ((gate_w, gate_s), (up_w, up_s), (down_w, down_s))`` (uint8 blobs,
    1-D scales of the planned dtype, float32 for AMX) for NUMA part t, and ``sha256[key]`` the digest of each
    tensor's bytes under its merged key name, in the algorithm ktconvert.json's recorded one names
    (``digests.digest_like``: BLAKE3 or sha256; the field keeps its older name)."""

    layer: int
    expert: int
    parts: list = field(default_factory=list)
    sha256: dict = field(default_factory=dict)


def _method_hint(methods, proj: str, nbytes: int, hidden: int, intermediate: int, kind: str) -> str | None:
    """"looks like AMXINT8 with numa 2" when another (method of `methods`, NUMA count) gives exactly nbytes."""
    guesses = []
    for name, method in methods.items():
        if not method.needs_conversion or not method.writable:
            continue
        for numa in (1, 2, 3, 4, 6, 8, 16):
            if intermediate % numa:
                continue
            if method.matrix_bytes(*part_shape(proj, hidden, intermediate, numa)).get(kind) == nbytes:
                guesses.append(f"{method.kt_method or name} with numa {numa}")
    return f"the size fits {' or '.join(dict.fromkeys(guesses))}" if guesses else None


class KtOutput:
    """A converted folder plus its manifest. Attributes: root, manifest, method (CpuMethod), kt_method
    ("AMXINT4"), numa, layers, experts, hidden, intermediate, inter_part (I / numa), mode ("safetensors" | "kt"),
    plan (the writing KtSink, a plan only: its specs, part_bytes and .kt names), shapes {proj: (n, k)} per NUMA
    part. `methods`: the CPU method registry (name -> method class, with .get and .items), for the manifest's method
    and for hints naming what the sizes fit."""

    def __init__(self, root, manifest: dict, methods, folder: OutputFolder | None = None):
        self.root, self.manifest, self.methods = Path(root), manifest, methods
        try:
            self.method = methods.get(manifest["method"])
            model = manifest["model"]
            self.numa, self.experts = int(manifest["numa"]), int(model["experts"])
            self.hidden, self.intermediate = int(model["hidden"]), int(model["intermediate"])
            self.layers = [int(x) for x in model["layers"]]
        except (KeyError, TypeError, ValueError, UnknownNameError) as exc:
            raise InputError(f"manifest lacks what the runtime needs ({exc})", file="ktconvert.json") from None
        if not self.method.needs_conversion:
            tiles = [m.kt_method for _, m in methods.items() if m.needs_conversion and m.writable]
            raise InputError("method is not a converted kt-kernel format", file="ktconvert.json",
                             found=str(manifest["method"]), expected=" or ".join(tiles))
        self.kt_method = self.method.kt_method
        self.inter_part = self.intermediate // max(self.numa, 1)
        top = [p for p in self.root.iterdir() if p.name.endswith(".safetensors")] if self.root.is_dir() else []
        self.mode = "safetensors" if top else "kt"
        self.plan = KtSink(None, self.mode, self.method, self.numa, self.layers, self.experts, self.hidden,
                           self.intermediate)
        self.shapes = self.plan.shapes
        self._index = self._index_merged(folder or OutputFolder.scan(self.root)) if self.mode == "safetensors" \
            else None

    @classmethod
    def open(cls, out, manifest: dict | None = None, folder: OutputFolder | None = None, *,
             methods) -> "KtOutput":
        """Open folder ``out``; reads ``ktconvert.json`` unless ``manifest`` is given, walks the folder unless
        ``folder`` (its verification.folder.OutputFolder) is given."""
        return cls(out, load_manifest(out) if manifest is None else manifest, methods, folder)

    # ---- merged safetensors -------------------------------------------------------------------------------------

    def _index_merged(self, folder: OutputFolder) -> dict:
        """{key: TensorRef} of every *.safetensors under root, recursively (kt-kernel keys files by basename)."""
        if folder.duplicate_names:
            rel, first = folder.duplicate_names[0]
            raise VerifyError("two shards share a file name (kt-kernel keys shards by name)", file=rel,
                              found=f"also {first}")
        if folder.header_errors:
            rel, message = sorted(folder.header_errors.items())[0]
            raise InputError(message)
        return {key: ref for key, (_, ref) in folder.entries.items()}

    def _probe(self, fmt: str) -> int:
        i = 0
        while fmt.format(i) in self._index:
            i += 1
        return i

    def _read_merged(self, key: str, kind: str, proj: str) -> np.ndarray:
        ref = self._index.get(key)
        if ref is None:
            raise VerifyError("tensor missing", tensor=key)
        dtype = self.plan.specs[proj][kind][0]
        want, dtypes = self.plan.part_bytes[proj][kind], KT_LOADS.get(dtype, (dtype,))
        where = Path(ref.file).name
        if ref.dtype not in dtypes:
            raise VerifyError("tensor dtype cannot be loaded", file=where, tensor=key,
                              expected=" or ".join(dtypes), found=ref.dtype)
        if ref.nbytes != want:
            raise VerifyError(f"tensor size does not match {self.kt_method} with numa {self.numa}", file=where,
                              tensor=key, expected=f"{want} bytes", found=f"{ref.nbytes} bytes",
                              hint=_method_hint(self.methods, proj, ref.nbytes, self.hidden, self.intermediate, kind))
        return _pread(Path(ref.file), ref.offset, ref.nbytes, key)

    # ---- .kt tree -----------------------------------------------------------------------------------------------

    def _kt_dir(self, layer: int, t: int) -> Path:
        return self.root / f"_layer_{layer}" / f"_numa_{t}"

    def _read_kt(self, layer: int, t: int, proj: str, expert: int, kind: str) -> np.ndarray:
        want, rel = self.plan.part_bytes[proj][kind], self.plan.kt_file(layer, t, proj, expert, kind)
        path = self.root / rel
        if not os.path.lexists(path):
            raise self._kt_missing(layer, t, proj, expert, KT_PARTS[kind], rel, kind)
        size = check_regular(path, rel, error=VerifyError).st_size
        if size != want:
            raise VerifyError("file size differs from the byte count in its name (truncated?)", file=rel,
                              expected=f"{want} bytes", found=f"{size} bytes")
        return _pread(path, 0, want, rel)

    def _kt_missing(self, layer: int, t: int, proj: str, expert: int, part: str, rel: str, kind: str) -> VerifyError:
        """The error for an absent .kt file, naming what is there instead (another method's prefix or size)."""
        folder = self._kt_dir(layer, t)
        others = []
        if folder.is_dir():
            for p in sorted(folder.iterdir()):
                info = parse_kt_relpath(f"_layer_{layer}/_numa_{t}/{p.name}")
                if info and info["proj"] == proj and info["expert"] == expert and info["part"] == part:
                    others.append(info)
        if not others:
            return VerifyError("file missing", file=rel, hint=None if folder.is_dir() else f"no folder {folder.name}")
        o = others[0]
        hint = _method_hint(self.methods, proj, o["bytes"], self.hidden, self.intermediate, kind)
        return VerifyError(f"file missing; the folder holds {o['prefix']}_{proj}_{expert}_{o['bytes']}Byte_{part}_.kt",
                           file=rel, expected=f"{self.method.file_prefix} files for {self.kt_method} numa {self.numa}",
                           found=f"{o['prefix']}, {o['bytes']} bytes", hint=hint)

    # ---- public -------------------------------------------------------------------------------------------------

    def check_layer(self, layer: int) -> None:
        """VerifyError unless kt-kernel's discovery finds exactly the manifest's experts and NUMA parts."""
        if layer not in self.layers:
            raise VerifyError("layer is not a converted MoE layer", tensor=f"layer {layer}",
                              expected=f"one of {self.layers}")
        if self.mode == "safetensors":
            experts = self._probe(f"blk.{layer}.ffn_up_exps.{{}}.numa.0.weight")
            numa = self._probe(f"blk.{layer}.ffn_up_exps.0.numa.{{}}.weight")
            where = f"blk.{layer}"
        else:
            folder = self.root / f"_layer_{layer}"
            if not folder.is_dir():
                raise VerifyError("layer folder missing", file=f"_layer_{layer}")
            found = sorted(int(m.group(1)) for p in folder.iterdir() if (m := _NUMA_DIR.match(p.name)))
            numa = len(found) if found == list(range(len(found))) else -1
            experts, where = self.experts, f"_layer_{layer}"
            if numa < 0:
                raise VerifyError("NUMA folders are not _numa_0.._numa_{T-1}", file=where,
                                  found=", ".join(f"_numa_{t}" for t in found))
        if numa != self.numa:
            raise VerifyError(f"{'extra' if numa > self.numa else 'missing'} NUMA parts", tensor=where,
                              expected=f"numa {self.numa} (ktconvert.json, = --kt-threadpool-count)",
                              found=f"{numa} parts")
        if experts != self.experts:
            raise VerifyError(f"kt-kernel's probe finds {'more' if experts > self.experts else 'fewer'} experts",
                              tensor=where, expected=str(self.experts), found=str(experts))

    def read_expert(self, layer: int, expert: int) -> ExpertBlobs:
        """All NUMA parts of one expert, every blob size-checked, with the sha256 of each tensor's bytes."""
        if not 0 <= expert < self.experts:
            raise VerifyError("expert out of range", tensor=f"layer {layer} expert {expert}",
                              expected=f"0..{self.experts - 1}")
        blobs = ExpertBlobs(layer, expert)
        for t in range(self.numa):
            part = []
            for proj in PROJS:
                pair = []
                for kind in ("weight", "scale"):
                    key = merged_key(layer, proj, expert, t, kind)
                    data = self._read_merged(key, kind, proj) if self.mode == "safetensors" \
                        else self._read_kt(layer, t, proj, expert, kind)
                    blobs.sha256[key] = digest_like(self.manifest.get("tensors", {}).get(key), data)
                    pair.append(data if kind == "weight" else
                                data.view(NUMPY_DTYPES[self.plan.specs[proj]["scale"][0]]))
                part.append(tuple(pair))
            blobs.parts.append(tuple(part))
        return blobs


def _pread(path: Path, offset: int, nbytes: int, what: str) -> np.ndarray:
    """uint8 [nbytes] read from regular file `path` at offset; VerifyError if the file ends early or is not a regular
    file (a FIFO would block)."""
    out = np.empty(nbytes, np.uint8)
    with os.fdopen(open_regular(path, what, error=VerifyError), "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(out))
    if got != nbytes:
        raise VerifyError("file ends inside a tensor (truncated)", file=path.name, tensor=what,
                          expected=f"{nbytes} bytes at offset {offset}", found=f"{got} bytes")
    return out

"""Expert source for GGUF files (llama.cpp): one routed expert at a time, as BF16 bits in HF orientation.

Input: one ``.gguf`` file, one file of a split set (``NAME-00001-of-00003.gguf``: the whole set is opened), or a
directory holding one model's ``.gguf`` file(s). Headers are parsed and checked by ``formats.gguf_header``; only tensor infos and
scalar metadata are kept, and expert data is read by byte range (os.pread), so memory is one expert slice.

Tensors (ggml names): ``blk.L.ffn_{gate,up,down}_exps.weight`` (or a fused ``blk.L.ffn_gate_up_exps.weight``, gate
rows first). ggml stores them as ne = [cols, rows, E], i.e. numpy [E, rows, cols], contiguous per expert:
gate/up [E, I, H], down [E, H, I] -- already HF orientation, so expert e is the byte range e * slice_bytes.
Metadata (``general.architecture`` = arch): ``{arch}.block_count`` (MTP layers included), ``.expert_count``,
``.embedding_length``, ``.expert_feed_forward_length``, ``.expert_used_count``, ``.expert_shared_count``,
``.leading_dense_block_count``, ``.nextn_predict_layers``. The MoE layers are the blocks holding expert tensors.
Values: any ggml type gguf-py can dequantize (ktconvert.quant.ggml), rounded to BF16 (nearest even).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ktconvert.architectures.manifests import ModelInfo, gguf_architectures, load_manifests, manifest_for
from ktconvert.errors import InputError, ManifestError, ShapeError
from ktconvert.formats import gguf_dense
from ktconvert.formats.base import ExpertWeights, Source, TensorRef
from ktconvert.formats.gguf_header import read_header
from ktconvert.formats.out_manifest import source_fingerprint
from ktconvert.formats.stream import MatrixJob
from ktconvert.quant import ggml
from ktconvert.util.safe_read import open_regular

GGUF_MAGIC = b"GGUF"
SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
PROJ_TENSORS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
FUSED_GATE_UP = "ffn_gate_up_exps"
MAX_BLOCKS = 1 << 16   # block_count sanity bound: loops over the layers must stay short whatever the header says
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def gguf_files(path) -> list[Path]:
    """The GGUF file(s) of one model at `path` (file, split member, or directory), split parts in order."""
    p = Path(path)
    if p.is_dir():
        found = sorted(f for f in p.glob("*.gguf") if f.is_file())
        if not found:
            raise InputError("no .gguf file in the directory", file=p)
        groups = {(m.group("stem"), m.group("count")) if (m := SPLIT_RE.match(f.name)) else (f.name, "1")
                  for f in found}
        if len(groups) > 1:
            raise InputError("the directory holds several GGUF models", file=p,
                             found=", ".join(sorted(g[0] for g in groups)), hint="pass one .gguf file")
        return _split_set(found[0]) if SPLIT_RE.match(found[0].name) else found
    if not p.is_file():
        raise InputError("GGUF file not found", file=p)
    return _split_set(p) if SPLIT_RE.match(p.name) else [p]


def _split_set(member: Path) -> list[Path]:
    m = SPLIT_RE.match(member.name)
    count = int(m.group("count"))
    parts = [member.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise InputError(f"split GGUF set is incomplete ({len(missing)} of {count} parts missing)",
                         file=member.parent, expected=", ".join(q.name for q in parts), found="missing " +
                         ", ".join(missing))
    return parts


def _meta(meta: dict, key: str, file: str, default=None, required: bool = True):
    if key in meta:
        return meta[key]
    if required and default is None:
        raise InputError("GGUF metadata key missing", file=file, expected=key)
    return default


def _meta_int(meta: dict, key: str, file: str, default: int | None = None, minimum: int = 0,
              maximum: int | None = None) -> int:
    """Integer metadata `key` in [minimum, maximum] (`default` when absent; InputError when absent without a default,
    or when the value is not an integer in range: a string, a float, a bool)."""
    value = _meta(meta, key, file, default=default, required=default is None)
    if type(value) is not int or value < minimum or (maximum is not None and value > maximum):
        span = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
        raise InputError(f"GGUF metadata {key} is not usable", file=file, expected=span, found=repr(value))
    return value


def _block_ids(tensors: dict[str, TensorRef]) -> dict[int, str]:
    """{block index: first tensor name of that block} of the ``blk.L.*`` tensors."""
    blocks: dict[int, str] = {}
    for name in sorted(tensors):
        m = _BLOCK_RE.match(name)
        if m:
            blocks.setdefault(int(m.group(1)), name)
    return blocks


def _check_blocks(tensors: dict[str, TensorRef], n_blocks: int, n_layers: int, arch: str, file: str) -> None:
    """No tensor of a block past block_count (a smaller block_count would drop layers), and tensors in the last
    non-MTP block (a larger one would describe layers that are not there)."""
    blocks = _block_ids(tensors)
    outside = [b for b in blocks if b >= n_blocks]
    if outside:
        raise InputError(f"tensor of block {min(outside)}, outside the {n_blocks} blocks {arch}.block_count "
                         "describes", file=file, tensor=blocks[min(outside)])
    if n_layers - 1 not in blocks:
        raise InputError(f"block {n_layers - 1} has no tensors", file=file,
                         expected=f"tensors up to block {n_layers - 1} ({arch}.block_count = {n_blocks} less "
                                  f"{arch}.nextn_predict_layers)",
                         found=f"tensors up to block {max(blocks)}" if blocks else "no blk.* tensors")


def model_info(meta: dict, tensors: dict[str, TensorRef], file: str) -> ModelInfo:
    """ModelInfo (ktconvert.architectures.manifests) from GGUF metadata + tensor names; InputError naming the metadata
    key for a value that is not an integer in range or that contradicts the tensors."""
    arch = str(_meta(meta, "general.architecture", file))
    manifests = load_manifests()
    known = gguf_architectures(manifests)     # the manifests' gguf_architectures ("llama" with experts is Mixtral)
    model_type = known.get(arch)
    if model_type is None:
        raise ManifestError(f"GGUF architecture {arch!r} is not a supported MoE family", file=file,
                            expected="one of " + ", ".join(sorted(known)), found=arch)
    n_blocks = _meta_int(meta, f"{arch}.block_count", file, minimum=1, maximum=MAX_BLOCKS)
    n_experts = _meta_int(meta, f"{arch}.expert_count", file, default=0)
    if n_experts <= 0:
        raise InputError("GGUF model has no routed experts", file=file, expected=f"{arch}.expert_count > 0",
                         found=n_experts)
    n_mtp = _meta_int(meta, f"{arch}.nextn_predict_layers", file, default=0, maximum=n_blocks - 1)
    n_layers = n_blocks - n_mtp
    _check_blocks(tensors, n_blocks, n_layers, arch, file)
    moe = tuple(L for L in range(n_layers) if _has_experts(tensors, L))
    if not moe:
        raise InputError("no routed expert tensors found", file=file, tensor="blk.L.ffn_gate_exps.weight")
    hidden = _meta_int(meta, f"{arch}.embedding_length", file, minimum=1)
    inter = _meta_int(meta, f"{arch}.expert_feed_forward_length", file, default=0) or _expert_rows(tensors, moe[0])
    n_shared = _meta_int(meta, f"{arch}.expert_shared_count", file, default=0)
    shared_i = _meta_int(meta, f"{arch}.expert_shared_feed_forward_length", file, default=0)
    config = {"gguf_architecture": arch, **{k: v for k, v in meta.items() if k.startswith(arch + ".")}}
    manifest = manifest_for(model_type, manifests)
    return ModelInfo(
        family=manifest.family, model_type=model_type, n_layers=n_layers, moe_layers=moe,
        mtp_layers=tuple(range(n_layers, n_blocks)), n_experts=n_experts, hidden=hidden, intermediate=inter,
        experts_per_tok=_meta_int(meta, f"{arch}.expert_used_count", file, default=0, maximum=n_experts),
        n_shared=n_shared, shared_intermediate=shared_i or inter * n_shared, first_dense=moe[0], name_prefix="",
        manifest=manifest, config=config)


def _has_experts(tensors: dict, layer: int) -> bool:
    return any(f"blk.{layer}.{t}.weight" in tensors for t in (PROJ_TENSORS["gate"], FUSED_GATE_UP))


def _expert_rows(tensors: dict, layer: int) -> int:
    """I from the layer's gate (or fused gate_up) tensor [E, I (2I), H]; 0 when it is not 3-D (validate says so)."""
    ref = tensors.get(f"blk.{layer}.{PROJ_TENSORS['gate']}.weight")
    fused = ref is None
    ref = ref or tensors[f"blk.{layer}.{FUSED_GATE_UP}.weight"]
    if len(ref.shape) != 3:
        return 0
    return ref.shape[1] // 2 if fused else ref.shape[1]


class GGUFSource(Source):
    """A GGUF model (one file or a split set) read one expert slice at a time. input_format = "gguf"."""

    name, aliases = "gguf", ("llama.cpp",)
    input_format = "gguf"

    def __init__(self, paths: list[Path], meta: dict, tensors: dict[str, TensorRef]):
        self.paths = paths
        self.root = paths[0].parent
        self.meta = meta
        self.tensors = tensors
        self.info = model_info(meta, tensors, paths[0].name)

    # -- opening

    @classmethod
    def sniff(cls, path) -> bool:
        """A file starting with the GGUF magic, or a directory with .gguf files and no .safetensors."""
        p = Path(path)
        if p.is_dir():
            return any(p.glob("*.gguf")) and not any(p.glob("*.safetensors"))
        try:
            if not p.is_file():   # a FIFO would block open() until a writer comes
                return False
            with open(p, "rb") as f:
                return f.read(4) == GGUF_MAGIC
        except OSError:
            return False

    @classmethod
    def open(cls, path, expert_orientation: str | None = None) -> "GGUFSource":
        """Parse the header(s) of the model at `path`; metadata comes from the first split part. (ggml stores
        expert tensors [E, out, in] only: expert_orientation is not needed.)"""
        paths = gguf_files(path)
        meta: dict = {}
        tensors: dict[str, TensorRef] = {}
        for i, part in enumerate(paths):
            part_meta, part_tensors = read_header(part)
            if i == 0:
                meta = part_meta
            dup = sorted(set(part_tensors) & set(tensors))
            if dup:
                raise InputError("tensor stored in two split parts", file=part.name, tensor=dup[0])
            tensors.update(part_tensors)
        count = _meta_int(meta, "split.count", paths[0].name, default=1) or 1
        if count != len(paths):
            raise InputError("split part count disagrees with the files found", file=paths[0].name,
                             expected=f"split.count = {count} parts", found=f"{len(paths)} file(s)")
        return cls(paths, meta, tensors)

    def files(self) -> list[Path]:
        return list(self.paths)

    def fingerprint(self) -> dict:
        return source_fingerprint(self.root, self.files())

    def describe(self) -> dict:
        return describe(self)

    # -- layers and tensors

    def present_mtp_layers(self) -> tuple[int, ...]:
        return tuple(L for L in self.info.mtp_layers if _has_experts(self.tensors, L))

    def fused(self, layer: int) -> bool:
        return f"blk.{layer}.{FUSED_GATE_UP}.weight" in self.tensors

    def _layer_tensors(self, layer: int) -> list[tuple[str, tuple[str, ...]]]:
        """[(tensor name, projections it holds)] of one layer's routed experts."""
        if self.fused(layer):
            return [(f"blk.{layer}.{FUSED_GATE_UP}.weight", ("gate", "up")),
                    (f"blk.{layer}.{PROJ_TENSORS['down']}.weight", ("down",))]
        return [(f"blk.{layer}.{PROJ_TENSORS[p]}.weight", (p,)) for p in ("gate", "up", "down")]

    def _want_shape(self, projs: tuple[str, ...]) -> tuple[int, int, int]:
        E, H, I = self.info.n_experts, self.info.hidden, self.info.intermediate
        return (E, H, I) if projs == ("down",) else (E, I * len(projs), H)

    def ggml_types(self) -> dict[str, int]:
        """ggml type name -> number of routed-expert tensors of that type."""
        counts: dict[str, int] = {}
        for layer in self.all_layers():
            for name, _ in self._layer_tensors(layer):
                if name in self.tensors:
                    key = self.tensors[name].dtype
                    counts[key] = counts.get(key, 0) + 1
        return counts

    # -- validation

    def validate(self, include_mtp: bool = False) -> None:
        """Every expert tensor of every converted layer is present, has the metadata's [E, I, H] / [E, H, I] shape,
        a dequantizable ggml type and lies inside its file. Raises InputError / ShapeError naming file and tensor."""
        for layer in self.all_layers(include_mtp):
            for name, projs in self._layer_tensors(layer):
                self._check_tensor(name, projs)
            for proj, name in self._bias_names(layer).items():
                self._check_bias(name, proj)

    def _check_tensor(self, name: str, projs: tuple[str, ...]) -> TensorRef:
        ref = self.tensors.get(name)
        if ref is None:
            raise InputError("routed expert tensor missing", file=self.paths[0].name, tensor=name)
        want = self._want_shape(projs)
        if ref.shape != want:
            raise ShapeError("expert tensor shape disagrees with the GGUF metadata", file=ref.file.name, tensor=name,
                             expected=f"{list(want)} ({'[E, H, I]' if projs == ('down',) else '[E, I, H]'})",
                             found=str(list(ref.shape)))
        if not ggml.supported(ref.dtype):
            raise InputError("ggml type of an expert tensor is not supported", file=ref.file.name, tensor=name,
                             expected="one of " + ", ".join(sorted(ggml.DEQUANT_TYPES)), found=ref.dtype)
        try:
            nbytes = ggml.packed_bytes(ref.dtype, int(np.prod(ref.shape)), row=ref.shape[-1])
        except ShapeError as exc:
            raise ShapeError(exc.detail, file=ref.file.name, tensor=name, expected=exc.expected,
                             found=exc.found) from None
        if nbytes != ref.nbytes or ref.offset + nbytes > ref.file.stat().st_size:
            raise InputError("expert tensor data lies outside its file", file=ref.file.name, tensor=name,
                             expected=f"{nbytes} bytes at offset {ref.offset}",
                             found=f"file size {ref.file.stat().st_size}")
        return ref

    def _check_bias(self, name: str, proj: str) -> TensorRef:
        """An expert bias: [E, I] (gate, up) or [E, H] (down) of a dequantizable type (its span was checked with
        the header)."""
        ref = self.tensors[name]
        E, H, I = self.info.n_experts, self.info.hidden, self.info.intermediate
        want = (E, H if proj == "down" else I)
        if ref.shape != want or not ggml.supported(ref.dtype):
            raise ShapeError("expert bias disagrees with the GGUF metadata", file=ref.file.name, tensor=name,
                             expected=f"{list(want)} of a dequantizable type",
                             found=f"{list(ref.shape)} {ref.dtype}")
        return ref

    # -- reading

    def slice_range(self, name: str, expert: int) -> tuple[TensorRef, int, int]:
        """(tensor, absolute offset, bytes) of expert `expert`'s slice of fused tensor `name`."""
        ref = self.tensors[name]
        step = ref.nbytes // ref.shape[0]
        return ref, ref.offset + expert * step, step

    def _pread(self, path: Path, offset: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        fd = open_regular(path, "GGUF file")
        try:
            view, done = memoryview(buf), 0
            while done < nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise InputError("GGUF file truncated", file=path.name,
                                     expected=f"{nbytes} bytes at offset {offset}", found=f"{done} bytes")
                done += got
        finally:
            os.close(fd)
        return buf

    def _decode(self, name: str, projs: tuple[str, ...], raw: np.ndarray) -> dict[str, np.ndarray]:
        ref = self.tensors[name]
        rows, cols = ref.shape[1:]
        bits = ggml.dequantize_bf16(raw, ref.dtype, name=name).reshape(rows, cols)
        if len(projs) == 1:
            return {projs[0]: bits}
        half = rows // 2
        return {"gate": bits[:half], "up": bits[half:]}

    def read_expert(self, layer: int, expert: int) -> ExpertWeights:
        """Expert `expert` of `layer`: gate/up uint16 [I, H], down uint16 [H, I] (BF16 bits); biases float32."""
        if not 0 <= expert < self.info.n_experts:
            raise InputError(f"expert index out of range in layer {layer}",
                             expected=f"0..{self.info.n_experts - 1}", found=str(expert))
        mats: dict[str, np.ndarray] = {}
        for name, projs in self._layer_tensors(layer):
            self._check_tensor(name, projs)
            ref, offset, nbytes = self.slice_range(name, expert)
            mats.update(self._decode(name, projs, self._pread(ref.file, offset, nbytes)))
        biases = {f"{p}_bias": self._bias(layer, p, expert) for p in ("gate", "up", "down")}
        return ExpertWeights(mats["gate"], mats["up"], mats["down"], **biases)

    def dense_tensors(self):
        """(specs [(HF name, "F32" | "BF16", shape)], read) of every non-expert tensor under its HF name, for
        ``--include-dense`` (formats/gguf_dense.py; InputError naming a tensor that cannot be written)."""
        return gguf_dense.dense_tensors(self)

    # -- biases (gpt-oss)

    def _bias_names(self, layer: int) -> dict[str, str]:
        names = {p: f"blk.{layer}.{t}.bias" for p, t in PROJ_TENSORS.items()}
        return {p: n for p, n in names.items() if n in self.tensors}

    def _bias(self, layer: int, proj: str, expert: int | None = None) -> np.ndarray | None:
        name = self._bias_names(layer).get(proj)
        if name is None:
            return None
        ref = self._check_bias(name, proj)
        if expert is None:
            return ggml.dequantize(self._pread(ref.file, ref.offset, ref.nbytes), ref.dtype, name=name)
        _, offset, nbytes = self.slice_range(name, expert)
        return ggml.dequantize(self._pread(ref.file, offset, nbytes), ref.dtype, name=name)

    def has_expert_biases(self) -> bool:
        return any(self._bias_names(layer) for layer in self.all_layers())

    def nonzero_expert_biases(self, layers) -> list[str]:
        """Names of expert bias tensors (in `layers`) holding any non-zero value."""
        return [name for layer in layers for proj, name in self._bias_names(layer).items()
                if np.any(self._bias(layer, proj) != 0)]

    # -- streaming jobs (the runner reads each file front to back)

    def matrix_jobs(self, layers) -> list[MatrixJob]:
        """One MatrixJob per expert slice of each expert tensor; key = (tensor name, expert, projections)."""
        jobs = []
        for layer in layers:
            for name, projs in self._layer_tensors(layer):
                self._check_tensor(name, projs)
                for e in range(self.info.n_experts):
                    ref, offset, nbytes = self.slice_range(name, e)
                    jobs.append(MatrixJob(ref.file, offset, nbytes, layer, e, projs, name, e))
        return jobs

    def decode(self, job, raw: np.ndarray) -> dict[str, np.ndarray]:
        """Bytes of one MatrixJob -> {proj: uint16 BF16 bits in HF orientation}."""
        return self._decode(job.tensor, job.projs, raw)


def describe(source: GGUFSource) -> dict:
    """`ktconvert inspect` for an opened GGUF model: the keys ktconvert.run.inspection.render reads (headers only)."""
    info = source.info
    dtypes: dict[str, int] = {}
    components: dict[str, int] = {}
    for ref in source.tensors.values():
        key = ref.dtype
        dtypes[key] = dtypes.get(key, 0) + ref.nbytes
        cat = _component(ref.name, info.n_layers)
        components[cat] = components.get(cat, 0) + ref.nbytes
    dense = [layer for layer in range(info.n_layers) if layer not in set(info.moe_layers)]
    types = source.ggml_types()
    return {
        "path": str(source.paths[0] if len(source.paths) == 1 else source.root), "files": len(source.paths),
        "file_bytes": sum(p.stat().st_size for p in source.paths), "tensors": len(source.tensors),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: -kv[1])), "quantization": {"gguf_expert_types": types},
        "model_type": info.model_type, "components": dict(sorted(components.items(), key=lambda kv: -kv[1])),
        "family": info.family, "supported": True, "input_format": "gguf",
        "layers": {"total": info.n_layers, "dense": dense, "moe": list(info.moe_layers),
                   "mtp": list(source.present_mtp_layers()), "mtp_in_config": list(info.mtp_layers)},
        "experts": info.n_experts, "experts_per_tok": info.experts_per_tok, "shared_experts": info.n_shared,
        "hidden": info.hidden, "intermediate": info.intermediate,
        "expert_layout": _expert_layout(source),
    }


def _expert_layout(source: GGUFSource) -> dict:
    """The GGUF experts' layout in inspect's terms: separate (or gate_up-fused) 3-D tensors, always out-major."""
    layer = source.all_layers()[0]
    why = "ggml stores every matrix as rows = out_features (ne[1]) x cols = in_features (ne[0])"
    tensors = {("gate_up" if len(projs) == 2 else projs[0]): name.replace(f"blk.{layer}.", "blk.{L}.")
               for name, projs in source._layer_tensors(layer)}
    shapes = {"gate_up": "[E, 2I, H]", "gate": "[E, I, H]", "up": "[E, I, H]", "down": "[E, H, I]"}
    return {"form": "fused" if "gate_up" in tensors else "fused_separate",
            "family_usual": source.info.manifest.experts.form, "tensors": tensors,
            "biases": source.has_expert_biases(),
            "orientation": {role: {"stored": shapes[role], "orientation": "out", "why": why} for role in tensors}}


_COMPONENTS = (("routed_experts", re.compile(r"\.ffn_(gate|up|down|gate_up)_exps\.")),
               ("shared_experts", re.compile(r"\.ffn_(gate|up|down)_shexp\.|ffn_gate_inp_shexp")),
               ("router", re.compile(r"\.ffn_gate_inp\.|exp_probs_b")),
               ("attention", re.compile(r"\.attn_")), ("dense_mlp", re.compile(r"\.ffn_(gate|up|down)\.")),
               ("embeddings", re.compile(r"^(token_embd|output)\.")), ("norms", re.compile(r"norm")))


def _component(name: str, n_layers: int) -> str:
    m = re.match(r"blk\.(\d+)\.", name)
    if m and int(m.group(1)) >= n_layers:
        return "mtp"
    return next((cat for cat, rx in _COMPONENTS if rx.search(name)), "other")

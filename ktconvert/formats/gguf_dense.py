"""``--include-dense`` for GGUF sources: every non-expert tensor under its HF name, as the safetensors path writes
them; F32 tensors as stored, every other type dequantized to BF16 (gguf-py's dequantization: quant/ggml.py).

Names come from gguf-py's own tables (``gguf.get_tensor_name_map(arch, blocks)``, which llama.cpp's
convert_hf_to_gguf maps HF names with), read in reverse. One ggml name has many HF candidates, one per naming
convention; the family's is the one in its name vocabulary
(``ktconvert.architectures.family_tensors.family_vocabulary``: the tensors its manifests say a checkpoint holds),
with the name prefix of the family's checkpoints. Suffixes:
``.weight`` / ``.bias`` as stored; a ``.bias`` whose HF name ends ``_bias`` (``e_score_correction_bias``) maps back
to it.

Refused with the reason (InputError naming file and tensor, before anything is written):
* tensors llama.cpp transforms on the way in, so that no HF tensor holds their values: llama-architecture (Mixtral)
  ``attn_q`` / ``attn_k`` (rows permuted for its rotary layout), DeepSeek ``attn_k_b`` / ``attn_v_b`` (kv_b_proj
  split per head, k transposed), every tensor of ``qwen3next`` / ``qwen35moe`` (norm weights + 1, ``A_log`` stored as
  -exp, conv1d reshaped);
* a tensor none of whose candidates is in the family's vocabulary.
``rope_freqs`` (llama.cpp's precomputed rope scaling factors; no HF tensor holds them) is not written.
"""
from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from ktconvert.architectures.family_tensors import family_vocabulary
from ktconvert.errors import InputError, ShapeError
from ktconvert.quant import ggml

_TRANSFORMED = {
    "llama": (r"^blk\.\d+\.attn_[qk]\.weight$", "llama.cpp permutes the rows of llama-architecture q/k projections "
                                                "for its rotary layout; the HF row order is not restored"),
    "deepseek2": (r"^blk\.\d+\.attn_[kv]_b\.weight$", "this GGUF stores kv_b_proj split per head into attn_k_b "
                                                      "(transposed) and attn_v_b; only an unsplit attn_kv_b maps back"),
    "qwen3next": (r"", "llama.cpp rewrites Qwen3-Next tensors (norm weights + 1, A_log stored as -exp(A_log), conv1d "
                       "reshaped); they are not mapped back"),
    "qwen35moe": (r"", "llama.cpp rewrites Qwen3.5 tensors (norm weights + 1, A_log stored as -exp(A_log), conv1d "
                       "reshaped); they are not mapped back"),
}
_SKIPPED = ("rope_freqs.weight",)
_ROUTED = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.")
_LAYER = re.compile(r"(^|[.}])layers\.\d+\.")


@lru_cache(maxsize=8)
def _reverse_table(arch: str, n_blocks: int) -> dict[str, tuple[str, ...]]:
    """ggml base name ("blk.3.attn_q") -> HF base names gguf-py maps to it, in gguf-py's order."""
    import gguf

    model_arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if model_arch is None:
        return {}
    out: dict[str, list[str]] = {}
    for hf, (_, ggml_name) in gguf.get_tensor_name_map(model_arch, n_blocks).mapping.items():
        out.setdefault(ggml_name, []).append(hf)
    return {k: tuple(v) for k, v in out.items()}


def _split_suffix(name: str) -> tuple[str, tuple[str, ...]]:
    """("blk.1.exp_probs_b", (".bias", "_bias")): the base and the HF suffixes it may stand for."""
    for suffix, hf in ((".weight", (".weight",)), (".bias", (".bias", "_bias"))):
        if name.endswith(suffix):
            return name[: -len(suffix)], hf
    return name, ("",)


def _generic(hf: str) -> str:
    """HF name as in the vocabulary: "model." -> "{P}", layer numbers -> "{L}"."""
    if hf.startswith("model."):
        hf = "{P}" + hf[len("model."):]
    return _LAYER.sub(r"\1layers.{L}.", hf, count=1)


def hf_name(name: str, candidates: tuple[str, ...], vocabulary: frozenset[str], prefix: str) -> str | None:
    """The HF name of ggml tensor `name` among gguf-py's `candidates` (HF bases) that the family's `vocabulary`
    holds, written with the family's name `prefix`; None when none is."""
    _, suffixes = _split_suffix(name)
    for base in candidates:
        for suffix in suffixes:
            if _generic(base) + suffix in vocabulary:
                return (prefix + base[len("model."):] if base.startswith("model.") else base) + suffix
    return None


def dense_names(source) -> dict[str, str]:
    """{ggml name: HF name} of every non-expert tensor of GGUFSource `source`; InputError on the first refused."""
    arch = str(source.meta.get("general.architecture"))
    info = source.info
    table = _reverse_table(arch, info.n_layers + len(info.mtp_layers))
    vocabulary = family_vocabulary(info.family)
    prefix = info.manifest.name_prefixes[0]
    refused = _TRANSFORMED.get(arch)
    out = {}
    for name in sorted(source.tensors):
        if _ROUTED.match(name) or name in _SKIPPED:
            continue
        ref = source.tensors[name]
        if refused and re.search(refused[0], name):
            raise InputError(f"--include-dense: this {arch} tensor cannot be written under its HF name: "
                             f"{refused[1]}", file=ref.file.name, tensor=name)
        base, _ = _split_suffix(name)
        hf = hf_name(name, table.get(base, ()), vocabulary, prefix)
        if hf is None:
            raise InputError(f"--include-dense: no HF name of family {info.family} for this GGUF tensor",
                             file=ref.file.name, tensor=name,
                             found="gguf-py's candidates: " + (", ".join(table.get(base, ())[:6]) or "none"))
        out[name] = hf
    return out


def dense_tensors(source):
    """(specs [(HF name, "F32" | "BF16", shape)], read(HF name) -> float32 or uint16 BF16 bits) of GGUFSource
    `source`'s non-expert tensors, sorted by HF name; every byte range checked against its file first."""
    names = dense_names(source)
    by_hf = {hf: name for name, hf in names.items()}
    specs = []
    for hf in sorted(by_hf):
        ref = _checked(source, by_hf[hf])
        specs.append((hf, "F32" if ref.dtype == "F32" else "BF16", tuple(ref.shape)))

    def read(hf: str) -> np.ndarray:
        ref = source.tensors[by_hf[hf]]
        raw = source._pread(ref.file, ref.offset, ref.nbytes)
        if ref.dtype == "F32":
            return raw.view(np.float32).reshape(ref.shape)
        return ggml.dequantize_bf16(raw, ref.dtype, name=ref.name).reshape(ref.shape)

    return specs, read


def _checked(source, name: str):
    ref = source.tensors[name]
    if not ggml.supported(ref.dtype):
        raise InputError("--include-dense: ggml type of a tensor is not supported", file=ref.file.name, tensor=name,
                         expected="one of " + ", ".join(sorted(ggml.DEQUANT_TYPES)), found=ref.dtype)
    try:
        nbytes = ggml.packed_bytes(ref.dtype, int(np.prod(ref.shape)), row=ref.shape[-1] if ref.shape else 1)
    except ShapeError as exc:
        raise ShapeError(exc.detail, file=ref.file.name, tensor=name, expected=exc.expected, found=exc.found) from None
    if nbytes != ref.nbytes or ref.offset + nbytes > ref.file.stat().st_size:
        raise InputError("tensor data lies outside its file", file=ref.file.name, tensor=name,
                         expected=f"{nbytes} bytes at offset {ref.offset}", found=f"file size {ref.file.stat().st_size}")
    return ref

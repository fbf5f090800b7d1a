"""Seeded random checkpoints with the real hub layout of every family (tests, examples, benchmarks).

Which tensors and which config.json a family's checkpoint holds is ``ktconvert.architectures.family_tensors``;
this module makes the values and writes the files, with ktconvert's own safetensors writer: no torch, no
safetensors library.
A tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json) is written when the ``tokenizers``
package is installed (it comes with the ``[gpu]`` extra) and left out otherwise.

Values: Gaussian (scale 0.02) through a 65536-entry inverse-CDF table of BF16 bits indexed by raw PRNG bits, plus
heavy tails (0.75 % of entries at 6-15 sigma, a few rows x4 and columns x2), generated as BF16 bits. Deterministic per
(seed, tensor name), independent of generation order. Memory: one shard (<= SHARD_BYTES or one layer) at a time.

Output dtypes are writers in ``DTYPE_WRITERS`` (bf16, fp16, fp32 here). More (fp8 with weight_scale_inv, ct-int4,
mxfp4) register from ``ktconvert.examples.tiny_quantized`` (imported on first use if present):
``DTYPE_WRITERS.register("fp8")(writer)``. A writer gets float32 values (``encode``); one that defines
``encode_bits`` gets the BF16 bits instead (the fast path the plain bf16 writer uses).
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ktconvert.architectures.manifests import ModelInfo, manifest_for, resolve
from ktconvert.errors import OutputError
from ktconvert.formats.st_writer import StreamingSafetensorsWriter
from ktconvert.registry import Registry
from ktconvert.architectures.family_tensors import TensorSpec, build_config, model_specs
from ktconvert.examples.tiny_layout import plan_shards

WEIGHT_STD = 0.02
TAIL_FRACTION = 0.0075
PLAIN_ROLES = ("norm", "bias", "expert_bias", "other")   # no heavy tails
WRITER_PLUGIN_MODULE = "ktconvert.examples.tiny_quantized"
SHARD_METADATA = {"format": "pt"}   # what transformers' save_pretrained writes; its loaders check it


class DtypeWriter(Protocol):
    """Turns one generated tensor into the file's tensors. Optional fast path: ``encode_bits(spec, bits)`` with
    bits = uint16 BF16 bits of spec.shape, used instead of encode when the writer defines it."""

    torch_dtype: str  # config.json torch_dtype

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        """values: float32 of spec.shape (exactly BF16-representable).
        -> [(tensor name, array, safetensors dtype)]; BF16/F8 arrays are uint16/uint8 bit patterns."""
        ...

    def update_config(self, config: dict, info: ModelInfo) -> None:
        """Add e.g. quantization_config to config.json (in place)."""
        ...


DTYPE_WRITERS: Registry = Registry("tiny-model dtype")


class PlainWriter:
    """bf16 / fp16 / fp32: every tensor in one float dtype (keep_fp32 tensors stay F32)."""

    def __init__(self, st_dtype: str, torch_dtype: str):
        self.st_dtype = st_dtype
        self.torch_dtype = torch_dtype

    def encode_bits(self, spec: TensorSpec, bits: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        from ktconvert.quant.bf16 import bf16_bits_to_f32

        if self.st_dtype == "BF16" and not spec.keep_fp32:
            return [(spec.name, bits, "BF16")]
        return self.encode(spec, bf16_bits_to_f32(bits))

    def encode(self, spec: TensorSpec, values: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
        from ktconvert.quant.bf16 import f32_to_bf16_bits

        if self.st_dtype == "BF16" and not spec.keep_fp32:
            return [(spec.name, f32_to_bf16_bits(values), "BF16")]
        if spec.keep_fp32 or self.st_dtype == "F32":
            return [(spec.name, values, "F32")]
        return [(spec.name, values.astype(np.float16), "F16")]

    def update_config(self, config: dict, info: ModelInfo) -> None:
        return None


DTYPE_WRITERS.register("bf16", aliases=["bfloat16"])(PlainWriter("BF16", "bfloat16"))
DTYPE_WRITERS.register("fp16", aliases=["float16", "f16"])(PlainWriter("F16", "float16"))
DTYPE_WRITERS.register("fp32", aliases=["float32", "f32"])(PlainWriter("F32", "float32"))


def dtype_writer(name: str) -> DtypeWriter:
    """The registered writer for name (loads the optional plugin module first); UnknownNameError lists them."""
    try:
        __import__(WRITER_PLUGIN_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != WRITER_PLUGIN_MODULE:
            raise
    return DTYPE_WRITERS.get(name)


# ---------------------------------------------------------------- values

@lru_cache(maxsize=1)
def _unit_normal_table() -> np.ndarray:
    """float64 [65536]: standard normal quantiles at (i + 0.5) / 65536."""
    from statistics import NormalDist

    inv = NormalDist().inv_cdf
    return np.array([inv((i + 0.5) / 65536.0) for i in range(65536)], dtype=np.float64)


def _bf16(x) -> np.ndarray:
    """float values -> uint16 BF16 bits (RNE). For small arrays (tables, tail values)."""
    from ktconvert.quant.bf16 import f32_to_bf16_bits

    return f32_to_bf16_bits(np.asarray(x, dtype=np.float32))


@lru_cache(maxsize=8)
def _bits_table(mean: float, std: float) -> np.ndarray:
    """uint16 [65536]: BF16 bits of mean + std * (normal quantile i)."""
    return _bf16(mean + std * _unit_normal_table())


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def _uniform_u16(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]


TIMES4, TIMES2 = np.uint16(2 << 7), np.uint16(1 << 7)   # added to BF16 bits: exponent + 2 / + 1


def _add_heavy_tails(bits: np.ndarray, rng: np.random.Generator, std: float) -> None:
    """In place on BF16 bits (no zeros, exponents far from overflow): ~1/64 of rows x4, ~1/128 of columns x2,
    then 0.75 % of entries set to +-(6..15) sigma."""
    if bits.ndim > 1:
        rows = bits.reshape(-1, bits.shape[-1])
        n_rows, n_cols = rows.shape
        rows[np.unique(rng.integers(0, n_rows, max(1, n_rows // 64)))] += TIMES4
        rows[:, np.unique(rng.integers(0, n_cols, max(1, n_cols // 128)))] += TIMES2
    flat = bits.reshape(-1)
    k = max(1, int(flat.size * TAIL_FRACTION))
    where = rng.integers(0, flat.size, k)
    sign = np.where(rng.integers(0, 2, k) == 1, 1.0, -1.0)
    flat[where] = _bf16(sign * rng.uniform(6.0, 15.0, k) * std)


def generate_bits(spec: TensorSpec, seed: int) -> np.ndarray:
    """uint16 BF16 bits of spec.shape; deterministic in (seed, spec.name), independent of call order."""
    rng = _rng(seed, spec.name)
    table = _bits_table(1.0, 0.02) if spec.role == "norm" else _bits_table(0.0, WEIGHT_STD)
    bits = table[_uniform_u16(rng, spec.numel)].reshape(spec.shape)
    if spec.role not in PLAIN_ROLES:
        _add_heavy_tails(bits, rng, WEIGHT_STD)
    return bits


# ---------------------------------------------------------------- files

def _save_shard(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """tensors: {name: (array, safetensors dtype)}, BF16 / F8 as uint16 / uint8 bits. Bytes as safetensors'
    save_file writes them (StreamingSafetensorsWriter's contract)."""
    specs = [(name, dtype, array.shape) for name, (array, dtype) in tensors.items()]
    # The model folder is renamed into place when complete: no per-file fsync, no hashes.
    with StreamingSafetensorsWriter(path, specs, metadata=SHARD_METADATA, fsync_and_hash=False) as writer:
        for name, (array, _) in tensors.items():
            writer.write(name, array)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """WordLevel tokenizer: <unk>=0, <s>=1, </s>=2, <pad>=3, then tok4 .. tok{V-1}; nothing without `tokenizers`."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ModuleNotFoundError as exc:
        if exc.name != "tokenizers":
            raise
        return

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"tok{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    (out / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(out / "tokenizer_config.json", {**special, "tokenizer_class": "PreTrainedTokenizerFast",
                                                 "model_max_length": 4096, "clean_up_tokenization_spaces": False})


def _prepare_out(out: Path, force: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise OutputError("output exists and is not a directory", file=out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputError("output directory is not empty", file=out, hint="pass force=True / --force to replace it")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _finish_out(tmp: Path, out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _encode(writer: DtypeWriter, spec: TensorSpec, bits: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    if hasattr(writer, "encode_bits"):
        return writer.encode_bits(spec, bits)
    from ktconvert.quant.bf16 import bf16_bits_to_f32

    return writer.encode(spec, bf16_bits_to_f32(bits))


def _write_weights(tmp: Path, info: ModelInfo, tiny: dict, writer: DtypeWriter, seed: int) -> None:
    """Generate shard i+1 while a background thread writes shard i (at most two shards in memory)."""
    from concurrent.futures import ThreadPoolExecutor

    bytes_per_value = 4 if getattr(writer, "st_dtype", "") == "F32" else 2
    shards = plan_shards(model_specs(info, tiny), bytes_per_value)
    weight_map, total, pending = {}, 0, None
    with ThreadPoolExecutor(max_workers=1) as saver:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
            tensors = {}
            for spec in shard:
                for name, array, dtype in _encode(writer, spec, generate_bits(spec, seed)):
                    tensors[name] = (array, dtype)
                    weight_map[name] = fname
                    total += array.nbytes
            if pending is not None:
                pending.result()
            pending = saver.submit(_save_shard, tmp / fname, tensors)
            del tensors
        if pending is not None:
            pending.result()
    if len(shards) > 1:
        _write_json(tmp / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def make_tiny_model(out, arch: str, layers: int | None = None, experts: int | None = None,
                    hidden: int | None = None, intermediate: int | None = None, dtype: str = "bf16",
                    seed: int = 0, force: bool = False, mtp: int | None = None) -> Path:
    """Write a seeded random checkpoint of family/model_type `arch` into directory `out`; returns `out`.

    Files: config.json, generation_config.json, tokenizer.json + tokenizer_config.json + special_tokens_map.json
    (when `tokenizers` is installed), and the weights (one shard per layer, model.safetensors.index.json when there is more than one shard).
    Refuses a non-empty `out` unless force. Written to a temporary sibling directory, renamed when complete.
    mtp: MTP layers (None: the family's tiny default), for families whose checkpoints carry them.
    """
    writer = dtype_writer(dtype)
    config, tiny = build_config(arch, layers, experts, hidden, intermediate, mtp)
    config["torch_dtype"] = writer.torch_dtype
    info = resolve(config, [tiny.get("name_prefix", manifest_for(arch).name_prefixes[0]) + "layers.0."])
    writer.update_config(config, info)
    out = Path(out)
    tmp = _prepare_out(out, force)
    try:
        _write_weights(tmp, info, tiny, writer, seed)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
        _write_tokenizer(tmp, int(info.config["vocab_size"]))
        _finish_out(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

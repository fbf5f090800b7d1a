"""``--method llamafile --include-dense``: what makes the routed-expert GGUF a complete model llama.cpp loads, the
non-expert tensors under llama.cpp's names and the model metadata and tokenizer llama.cpp reads.

Names: gguf-py's own tables, ``gguf.get_tensor_name_map(arch, blocks)`` (the ``TensorNameMap`` llama.cpp's
convert_hf_to_gguf maps HF names with) for the HF name, and ``gguf.MODEL_TENSORS[arch]`` for what the architecture
holds: a tensor the map does not name, or names outside the architecture's tensors, is refused (InputError naming
file and tensor) before anything is written. Architectures: those whose metadata and tensors need no transform
llama.cpp applies on the way in (``ARCHITECTURES``: qwen3moe, the tiny model's, checked by loading the output in
llama.cpp). Any other family is refused with one line: llama-architecture models (Mixtral) because llama.cpp
permutes the rows of ``attn_q`` / ``attn_k`` for its rotary layout, DeepSeek because it splits ``kv_b_proj``
per head, the rest because their metadata is not mapped here.

Types: every 2-D tensor keeps the source's 16-bit type (BF16 or F16; an F32 tensor stays F32); 1-D tensors
(norms, biases) and the router ``ffn_gate_inp`` are F32, as convert_hf_to_gguf writes them (and as
llama-quantize leaves them). The dense tensors are not quantized: llama-quantize run on the output can do that
(``--ggml-type`` applies to the routed experts only, as kt-kernel's LLAMAFILE reads them).

Metadata (``write_metadata``): convert_hf_to_gguf's ``TextModel.set_gguf_parameters`` keys from config.json
(block count, context / embedding / feed-forward lengths, head counts, rope base, RMS epsilon, expert counts, key /
value length, expert feed-forward length), ``general.file_type`` (MOSTLY_BF16 / MOSTLY_F16 from the dense type)
and the tokenizer: ``gguf.vocab.BpeVocab`` reads a GPT-2 byte-level BPE tokenizer.json (Qwen's; any other
tokenizer is refused: llama.cpp's gpt2 vocabulary needs the merges), padded to the config's vocab_size with
``[PAD{i}]`` unused tokens as convert_hf_to_gguf does, tokenizer.ggml.pre the name convert_hf_to_gguf detects for
the family (``ARCHITECTURES``); ``gguf.SpecialVocab`` adds the merges, special token ids and chat template.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import gguf

from ktconvert.errors import InputError, UsageError

# llama.cpp architecture -> the pre-tokenizer name convert_hf_to_gguf detects for the family's tokenizer
ARCHITECTURES = {"qwen3moe": "qwen2"}
_F32_TENSORS = (gguf.MODEL_TENSOR.FFN_GATE_INP,)


def model_arch(arch: str) -> gguf.MODEL_ARCH:
    """gguf-py's MODEL_ARCH of llama.cpp architecture name `arch`; UsageError (one line) when --include-dense does
    not write it."""
    found = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if found is None or arch not in ARCHITECTURES:
        why = {"llama": "llama.cpp permutes the rows of llama-architecture attn_q / attn_k for its rotary layout",
               "deepseek2": "llama.cpp splits kv_b_proj per head into attn_k_b / attn_v_b"}.get(
            arch, "its llama.cpp metadata is not mapped")
        raise UsageError(f"--include-dense for --method llamafile cannot write architecture {arch}: {why}",
                         expected="a model of architecture " + " or ".join(sorted(ARCHITECTURES)), found=arch)
    return found


@lru_cache(maxsize=8)
def _name_map(arch: str, n_blocks: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(model_arch(arch), n_blocks)


def _kind(arch: str, name: str) -> gguf.MODEL_TENSOR | None:
    """The MODEL_TENSOR of llama.cpp tensor `name` ("blk.3.attn_q.weight") among the architecture's tensors."""
    base = name.rsplit(".", 1)[0]
    for kind in gguf.MODEL_TENSORS[model_arch(arch)]:
        pattern = gguf.TENSOR_NAMES[kind]
        if pattern == base or ("{bid}" in pattern and _matches(pattern, base)):
            return kind
    return None


def _matches(pattern: str, base: str) -> bool:
    head, _, tail = pattern.partition("{bid}")
    middle = base[len(head):len(base) - len(tail)] if base.startswith(head) and base.endswith(tail) else ""
    return middle.isdigit()


def dense_plan(arch: str, n_blocks: int, specs, file: str = "") -> list[tuple[str, str, str, tuple[int, ...]]]:
    """[(llama.cpp name, ggml type, HF name, numpy-order shape)] of the source's non-expert tensors `specs` [(HF
    name, dtype, shape)], in llama.cpp's order (token_embd, the blocks, then the rest). InputError naming the tensor
    for one gguf-py's map does not name, one outside the architecture's tensors, or a dtype not written."""
    table = _name_map(arch, n_blocks)
    out = []
    for hf, dtype, shape in specs:
        name = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None or _kind(arch, name) is None:
            raise InputError(f"--include-dense: gguf-py's {arch} tensor map has no llama.cpp name for this tensor",
                             file=file or None, tensor=hf)
        if dtype not in ("BF16", "F16", "F32"):
            raise InputError("--include-dense: a non-expert tensor of this dtype is not written to GGUF",
                             file=file or None, tensor=hf, expected="BF16, F16 or F32", found=dtype)
        kind = "F32" if len(shape) <= 1 or _kind(arch, name) in _F32_TENSORS else dtype
        out.append((name, kind, hf, tuple(int(x) for x in shape)))

    def order(item):
        parts = item[0].split(".")
        block = int(parts[1]) if parts[0] == "blk" else (-1 if parts[0] == "token_embd" else 1 << 30)
        return block, item[0]

    return sorted(out, key=order)


def _config_value(config: dict, *keys):
    return next((config[k] for k in keys if config.get(k) is not None), None)


def write_metadata(writer: gguf.GGUFWriter, info, dense_type: str, side_files: dict) -> None:
    """The model metadata and tokenizer of a complete llama.cpp GGUF into `writer` (its architecture set), from the
    source's config (info.config) and its tokenizer files (`side_files`: {name: path})."""
    c = info.config
    w = writer
    w.add_block_count(int(info.n_layers))
    pairs = [(w.add_context_length, ("max_position_embeddings", "n_ctx")), (w.add_embedding_length, ("hidden_size",)),
             (w.add_feed_forward_length, ("intermediate_size",)), (w.add_head_count, ("num_attention_heads",)),
             (w.add_head_count_kv, ("num_key_value_heads",)), (w.add_rope_freq_base, ("rope_theta",)),
             (w.add_layer_norm_rms_eps, ("rms_norm_eps",)),
             (w.add_expert_count, ("num_local_experts", "num_experts", "n_routed_experts")),
             (w.add_expert_used_count, ("num_experts_per_tok",)),
             (w.add_expert_feed_forward_length, ("moe_intermediate_size",)),
             (w.add_expert_shared_feed_forward_length, ("shared_expert_intermediate_size",))]
    for add, keys in pairs:
        value = _config_value(c, *keys)
        if value is not None:
            add(value)
    if c.get("head_dim") is not None:
        w.add_key_length(int(c["head_dim"]))
        w.add_value_length(int(c["head_dim"]))
    w.add_file_type({"BF16": gguf.LlamaFileType.MOSTLY_BF16, "F16": gguf.LlamaFileType.MOSTLY_F16}.get(
        dense_type, gguf.LlamaFileType.ALL_F32))
    _write_vocab(w, c, side_files)


def _write_vocab(w: gguf.GGUFWriter, config: dict, side_files: dict) -> None:
    tokenizer = side_files.get("tokenizer.json")
    if tokenizer is None:
        raise InputError("--include-dense: the source has no tokenizer.json (llama.cpp needs the vocabulary)",
                         expected="tokenizer.json beside config.json")
    folder = Path(tokenizer).parent
    n_vocab = int(config.get("vocab_size") or 0)
    try:
        vocab = gguf.vocab.BpeVocab(folder)
    except FileNotFoundError:
        raise InputError("--include-dense: tokenizer.json is not a GPT-2 byte-level BPE tokenizer (the vocabulary "
                         "llama.cpp reads as tokenizer model gpt2)", file=str(tokenizer)) from None
    except ValueError as exc:
        raise InputError(f"--include-dense: tokenizer.json cannot be read as llama.cpp's vocabulary ({exc})",
                         file=str(tokenizer)) from None
    tokens = [(text if isinstance(text, str) else text.decode("utf-8"), kind) for text, _, kind in
              vocab.all_tokens()]
    if len(tokens) > n_vocab:
        raise InputError("--include-dense: the tokenizer holds more tokens than config.json's vocab_size",
                         file=str(tokenizer), expected=f"<= {n_vocab}", found=str(len(tokens)))
    tokens += [(f"[PAD{i}]", gguf.TokenType.UNUSED) for i in range(len(tokens), n_vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(ARCHITECTURES.get(w.arch, "default"))
    w.add_token_list([t for t, _ in tokens])
    w.add_token_types([int(k) for _, k in tokens])
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab).add_to_gguf(w, quiet=True)


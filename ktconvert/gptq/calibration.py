"""``--calibration FILE``: calibration samples for GPTQ, tokenized with the checkpoint's own tokenizer.

FILE is JSON lines, one sample per line: ``{"text": "..."}`` (tokenized with the tokenizer files next to the
checkpoint's config.json, offline, special tokens added as the tokenizer does by default) or
``{"input_ids": [int, ...]}`` (used as is). Blank lines are skipped. Samples are truncated to `max_length`
tokens; the first `num_samples` in file order are kept. Nothing is downloaded.

The GPTQ loop calibrates them in ``oneshot_order``: longest first, as llmcompressor ``oneshot`` with
``shuffle_calibration_samples=False`` (its ``LengthAwareSampler``). The order changes the float32 summation order
of the Hessians, so bit-identity with oneshot needs it; oneshot's default (``True``) draws a random order from
torch's global generator, which no other run reproduces.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from ktconvert.errors import InputError, UsageError
from ktconvert.util.safe_read import parse_json

UNKNOWN_WARN, UNKNOWN_REFUSE = 0.05, 0.5     # share of the tokens that are the tokenizer's unknown token


class CalibrationWarning(UserWarning):
    """The calibration text is partly outside the tokenizer's vocabulary (a share of unknown tokens above
    UNKNOWN_WARN; above UNKNOWN_REFUSE it is refused)."""


MAX_LINE_BYTES = 16 << 20   # one calibration sample's JSON line (2048 tokens of text is ~10 KB): refused beyond


def read_jsonl(path, limit: int | None = None) -> list[dict]:
    """The file's records in order (the first `limit` when given: the rest is not read); InputError naming the
    file and line on anything else: a line over MAX_LINE_BYTES (refused before it is read whole), bytes that are
    not UTF-8, JSON that is not one sample."""
    path = Path(path)
    if not path.is_file():
        raise InputError("calibration file not found", file=str(path))
    records = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"calibration line {lineno} is longer than one sample can be", file=path.name,
                                 expected=f"at most {MAX_LINE_BYTES} bytes per line", found="more")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"calibration line {lineno} is not UTF-8 text", file=path.name,
                                 found=f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}") from None
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            rec = parse_json(line, what=f"calibration line {lineno}", file=path.name)
            if not isinstance(rec, dict) or not ("text" in rec or "input_ids" in rec):
                raise InputError(f"calibration line {lineno} has neither 'text' nor 'input_ids'", file=path.name,
                                 expected='{"text": "..."} or {"input_ids": [...]}',
                                 found=line.strip()[:80])
            records.append(rec)
    if not records:
        raise InputError("calibration file holds no samples", file=path.name)
    return records


# Files transformers' AutoTokenizer builds a tokenizer from without a download (fast, SentencePiece, BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir, calibration_file, sample: int):
    """The checkpoint's tokenizer (transformers AutoTokenizer, local files only) for text sample number `sample`
    of `calibration_file`. InputError naming both files and what is needed when `model_dir` holds none of
    TOKENIZER_FILES or they do not load."""
    from transformers import AutoTokenizer

    where = f"{Path(calibration_file).name} sample {sample}"
    need = (f"a tokenizer.json in {model_dir}, or samples written as {{\"input_ids\": [...]}} lines instead of "
            f"{{\"text\": ...}}")
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"{where} is text, and {model_dir} has no tokenizer to turn it into token ids",
                         expected=need, found=f"none of {', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{where} is text, and the tokenizer files of {model_dir} do not load ({reason})",
                         expected=need) from None


def load_samples(path, model_dir, max_length: int = 2048, num_samples: int | None = None,
                 vocab_size: int | None = None) -> list:
    """Calibration samples as 1-D torch int64 tensors (at most `num_samples`, each at most `max_length` tokens).

    Token ids outside [0, vocab_size) raise InputError naming the line; a max_length or num_samples below 1
    UsageError. Text the tokenizer reads mostly as its unknown token (more than UNKNOWN_REFUSE of all the tokens)
    is refused (InputError: the statistics would count one token's routing); above UNKNOWN_WARN a
    CalibrationWarning says how much."""
    import torch

    for name, value in (("--max-length", max_length), ("--num-samples", num_samples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"{name} must be a whole number of at least 1", expected=">= 1", found=repr(value))
    records = read_jsonl(path, num_samples)
    tokenizer = None
    samples, unknown = [], 0
    for i, rec in enumerate(records, 1):
        if "input_ids" in rec:
            ids = rec["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in ids):
                raise InputError(f"calibration sample {i}: input_ids must be a non-empty list of integers",
                                 file=Path(path).name, found=str(ids)[:80])
        else:
            if not isinstance(rec["text"], str) or not rec["text"]:
                raise InputError(f"calibration sample {i}: text must be a non-empty string", file=Path(path).name)
            tokenizer = tokenizer or load_tokenizer(model_dir, path, i)
            ids = tokenizer(rec["text"])["input_ids"]
            if not ids:
                raise InputError(f"calibration sample {i}: text tokenizes to nothing", file=Path(path).name)
            unk = getattr(tokenizer, "unk_token_id", None)
            unknown += 0 if unk is None else sum(t == unk for t in ids[:max_length])
        ids = ids[:max_length]
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            raise InputError(f"calibration sample {i}: token id outside the vocabulary", file=Path(path).name,
                             expected=f"0..{vocab_size - 1}", found=f"{min(ids)}..{max(ids)}")
        samples.append(torch.tensor(ids, dtype=torch.long))
    _check_unknown(path, model_dir, tokenizer, unknown, sum(len(s) for s in samples))
    return samples


def _check_unknown(path, model_dir, tokenizer, unknown: int, total: int) -> None:
    """InputError above UNKNOWN_REFUSE unknown tokens, a CalibrationWarning above UNKNOWN_WARN."""
    share = unknown / total if total else 0.0
    if share <= UNKNOWN_WARN:
        return
    what = (f"{unknown} of the {total} calibration tokens ({share:.0%}) are the tokenizer's unknown token "
            f"{getattr(tokenizer, 'unk_token', None)!r}: the text is mostly outside {Path(model_dir).name}'s "
            f"vocabulary")
    if share > UNKNOWN_REFUSE:
        raise InputError(what, file=Path(path).name, expected=f"at most {UNKNOWN_REFUSE:.0%} unknown tokens",
                         hint="use text in the model's language, or {\"input_ids\": [...]} samples (a tiny-model's "
                              "tokenizer reads only its words tok4, tok5, ...)")
    warnings.warn(what, CalibrationWarning, stacklevel=2)


def oneshot_permutation(samples: list) -> list[int]:
    """Indices of `samples` (1-D token tensors) in the order llmcompressor's LengthAwareSampler visits them:
    descending length, ties in the order ``torch.argsort(lengths, descending=True)`` gives on CPU."""
    import torch

    lengths = torch.tensor([len(s) for s in samples])
    return torch.argsort(lengths, descending=True).tolist()


def oneshot_order(samples: list) -> list:
    """`samples` reordered as oneshot(shuffle_calibration_samples=False) calibrates them (oneshot_permutation)."""
    return [samples[i] for i in oneshot_permutation(samples)]

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

from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.safe_read import parse_json


def read_jsonl(path) -> list[dict]:
    """The file's records in order; InputError naming the file and line on anything else."""
    path = Path(path)
    if not path.is_file():
        raise InputError("calibration file not found", file=str(path))
    records = []
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            rec = parse_json(line, what=f"calibration line {lineno}", file=path.name)
            if not isinstance(rec, dict) or not ("text" in rec or "input_ids" in rec):
                raise InputError(f"calibration line {lineno} has neither 'text' nor 'input_ids'", file=path.name,
                                 expected='{"text": "..."} or {"input_ids": [...]}',
                                 found=line.strip()[:80])
            records.append(rec)
    if not records:
        raise InputError("calibration file holds no samples", file=path.name)
    return records


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer (transformers AutoTokenizer, local files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"cannot load the checkpoint's tokenizer for text calibration samples ({exc})",
                         file=str(model_dir), hint='ship tokenizer files with the model, or give '
                                                   '{"input_ids": [...]} samples') from None


def load_samples(path, model_dir, max_length: int = 2048, num_samples: int | None = None,
                 vocab_size: int | None = None) -> list:
    """Calibration samples as 1-D torch int64 tensors (at most `num_samples`, each at most `max_length` tokens).

    Token ids outside [0, vocab_size) raise InputError naming the line."""
    import torch

    records = read_jsonl(path)[:num_samples]
    tokenizer = None
    samples = []
    for i, rec in enumerate(records, 1):
        if "input_ids" in rec:
            ids = rec["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise InputError(f"calibration sample {i}: input_ids must be a non-empty list of integers",
                                 file=Path(path).name, found=str(ids)[:80])
        else:
            if not isinstance(rec["text"], str) or not rec["text"]:
                raise InputError(f"calibration sample {i}: text must be a non-empty string", file=Path(path).name)
            tokenizer = tokenizer or load_tokenizer(model_dir)
            ids = tokenizer(rec["text"])["input_ids"]
            if not ids:
                raise InputError(f"calibration sample {i}: text tokenizes to nothing", file=Path(path).name)
        ids = ids[:max_length]
        if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
            raise InputError(f"calibration sample {i}: token id outside the vocabulary", file=Path(path).name,
                             expected=f"0..{vocab_size - 1}", found=f"{min(ids)}..{max(ids)}")
        samples.append(torch.tensor(ids, dtype=torch.long))
    return samples


def oneshot_permutation(samples: list) -> list[int]:
    """Indices of `samples` (1-D token tensors) in the order llmcompressor's LengthAwareSampler visits them:
    descending length, ties in the order ``torch.argsort(lengths, descending=True)`` gives on CPU."""
    import torch

    lengths = torch.tensor([len(s) for s in samples])
    return torch.argsort(lengths, descending=True).tolist()


def oneshot_order(samples: list) -> list:
    """`samples` reordered as oneshot(shuffle_calibration_samples=False) calibrates them (oneshot_permutation)."""
    return [samples[i] for i in oneshot_permutation(samples)]

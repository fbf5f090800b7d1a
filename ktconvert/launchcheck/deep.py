"""``ktconvert check --deep``: read and decode a sample of experts to catch what headers cannot show: corrupt or
truncated data, NaN / Inf scales; with a ktconvert.json also every file's and tensor's hash
(``verification.hashes``).

Sample: the first, middle and last MoE layer x the first, middle and last expert, every projection (and NUMA
part). Per format:

* AMX tiles: F32 scales finite and >= 0, codes kt-kernel computes correctly (INT4 nibbles in -7..7: a 0x8 nibble
  loads but the forward is garbage; INT8 bytes in -127..127), the blob decoded by the method's own dequantize
  (layouts/tiles) finite;
* HF tensors: BF16 / F16 / F32 values finite, F8_E4M3 bytes not NaN (0x7F / 0xFF), E8M0 scales not 0xFF, GPTQ
  qzeros those of a symmetric model (kt-kernel ignores qzeros: an asymmetric model is garbage);
* GGUF: the expert's ggml blocks decoded (quant.ggml) finite.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ktconvert.errors import KtConvertError
from ktconvert.launchcheck.findings import Finding
from ktconvert.launchcheck.readers import Reads
from ktconvert.layouts.naming import PROJS, kt_relpath, part_shape
from ktconvert.quant import ggml
from ktconvert.verification.hashes import verify_hashes

SYMMETRIC_QZEROS = {0x77777777, 0x88888888}      # GPTQ v1 (zero - 1 = 7) and v2 (8) packing of a symmetric model
MAX_PROBLEMS = 20


def sample(values: list[int]) -> list[int]:
    return sorted({values[0], values[len(values) // 2], values[-1]}) if values else []


def deep_check(identity, reads: Reads, manifest: dict | None) -> tuple[dict, list[Finding]]:
    kind = identity.source[0] if identity.source else None
    problems: list[str] = []
    before = reads.counts["data"]
    checked = {"merged": _tiles, "tree": _tiles, "hf": _hf, "gguf": _gguf}.get(kind, lambda *a: 0)(
        identity, reads, problems)
    report = {"matrices_checked": checked, "layers": sample(identity.layers),
              "experts": sample(list(range(identity.experts))), "bytes_read": reads.counts["data"] - before}
    findings = [Finding("files", None, p, "garbage") for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        findings.append(Finding("files", None, f"... and {len(problems) - MAX_PROBLEMS} more", severity="note"))
    if manifest is not None:
        hashes = verify_hashes(identity.folder, manifest)
        report["hashes"] = {k: hashes[k] for k in ("ok", "files_checked", "tensors_checked")}
        reads.counts["data"] += sum(int(e.get("bytes", 0)) for e in manifest["files"].values())
        findings += [Finding("files", None, f"ktconvert.json hashes: {p}", "garbage") for p in hashes["problems"]]
    return report, findings


def _tiles(identity, reads: Reads, problems: list[str]) -> int:
    method, numa = identity.registered, identity.numa
    if method is None:
        return 0
    n_checked = 0
    for layer in sample(identity.layers):
        for e in sample(list(range(identity.experts))):
            for t in range(numa):
                for proj in PROJS:
                    n, k = part_shape(proj, identity.hidden, identity.intermediate, numa)
                    where = f"layer {layer} expert {e} NUMA part {t} {proj}"
                    blob, scale = (_tile_part(identity, reads, layer, proj, e, t, part, n, k)
                                   for part in ("weight", "scale"))
                    problems += [f"{where}: {p}" for p in _tile_problems(method, blob, scale.view(np.float32), n, k)]
                    n_checked += 1
    return n_checked


def _tile_part(identity, reads: Reads, layer, proj, e, t, part, n, k) -> np.ndarray:
    kind = identity.source[0]
    if kind == "merged":
        ref = identity.source[1][layer][(proj, e, t, part)]
        return reads.data(ref.file, ref.offset, ref.nbytes).view(np.uint8)
    prefix, sizes = identity.source[1], identity.source[2]
    nbytes = sizes[layer][(proj, e, t, part)]
    rel = kt_relpath(layer, t, prefix, proj, e, nbytes, "quant" if part == "weight" else "scale")
    return reads.data(Path(identity.folder) / rel, 0, nbytes).view(np.uint8)


def _tile_problems(method, blob: np.ndarray, scale: np.ndarray, n: int, k: int) -> list[str]:
    out = []
    if not np.isfinite(scale).all():
        out.append(f"{int((~np.isfinite(scale)).sum())} NaN / Inf scales")
    elif (scale < 0).any():
        out.append(f"{int((scale < 0).sum())} negative scales")
    if method.bits == 4:
        bad = int(((blob & 0x0F) == 0x08).sum() + ((blob >> 4) == 0x08).sum())
        if bad:
            out.append(f"{bad} int4 codes -8 (kt-kernel computes codes -7..7 only)")
    elif int((blob.view(np.int8) == -128).sum()):
        out.append(f"{int((blob.view(np.int8) == -128).sum())} int8 codes -128 (kt-kernel computes -127..127 only)")
    if not out:
        with np.errstate(all="ignore"):
            weights = method.dequantize(blob, scale, n, k)
        if not np.isfinite(weights).all():
            out.append("decodes to NaN / Inf")
    return out


def _hf(identity, reads: Reads, problems: list[str]) -> int:
    per_matrix = identity.source[1]
    n_checked = 0
    for layer in sample(identity.layers):
        matrices = per_matrix.get(layer, {})
        for e in sample(list(range(identity.experts))):
            for proj in PROJS:
                for suffix, ref in sorted(matrices.get((e, proj), {}).items()):
                    raw = reads.data(ref.file, ref.offset, ref.nbytes, ref.dtype)
                    bad = _nonfinite(ref.dtype, raw, suffix)
                    if bad:
                        problems.append(f"{ref.name}: {bad}")
                n_checked += (e, proj) in matrices
    return n_checked


def _nonfinite(dtype: str, raw: np.ndarray, suffix: str) -> str:
    """Why the values of one tensor are unusable, or ""."""
    if suffix == "qzeros":
        values = set(np.unique(raw.view(np.uint32)).tolist())
        return "" if values <= SYMMETRIC_QZEROS else (f"qzeros {sorted(hex(v) for v in values)[:3]}: an "
                                                      "asymmetric model (kt-kernel ignores qzeros)")
    if suffix in ("g_idx", "weight_g_idx", "weight_shape") or dtype in ("I32", "I64", "I8", "I16", "BOOL"):
        return ""
    if dtype == "BF16":
        count = int(((raw.view(np.uint16) & 0x7F80) == 0x7F80).sum())
    elif dtype in ("F16", "F32", "F64"):
        count = int((~np.isfinite(raw)).sum())
    elif dtype == "F8_E4M3":
        count = int(((raw & 0x7F) == 0x7F).sum())
    elif dtype == "F8_E8M0" or (dtype == "U8" and "scale" in suffix):
        count = int((raw == 0xFF).sum())
    else:
        return ""
    return f"{count} NaN / Inf values" if count else ""


def _gguf(identity, reads: Reads, problems: list[str]) -> int:
    per_layer = identity.source[1]
    n_checked = 0
    for layer in sample(identity.layers):
        for proj in PROJS:
            ref = per_layer[layer].get(proj)
            if ref is None or not ggml.supported(ref.dtype):
                continue
            step = ref.nbytes // ref.shape[0]
            for e in sample(list(range(identity.experts))):
                raw = reads.data(ref.file, ref.offset + e * step, step)
                try:
                    with np.errstate(all="ignore"):
                        values = ggml.dequantize(raw, ref.dtype, name=ref.name)
                except KtConvertError as exc:
                    problems.append(f"{ref.name} expert {e}: {exc.detail}")
                    continue
                if not np.isfinite(values).all():
                    problems.append(f"{ref.name} expert {e}: {int((~np.isfinite(values)).sum())} NaN / Inf values")
                n_checked += 1
    return n_checked

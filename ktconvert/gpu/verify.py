"""``ktconvert verify OUT_GPU``: CPU-only validation of an SGLang-KT GPU checkpoint (gpu-format.md §6.5).

Checks: ``config`` (``linear_fp8_config`` a dict with the fields SGLang reads; the rest parsed by compressed-tensors'
``QuantizationConfig`` with the constraints of SGLang's WNA16 MoE scheme), ``index`` (every shard listed, every
tensor mapped), ``experts`` (every routed expert of every MoE layer has weight_packed / weight_scale / weight_shape
with the right dtypes and shapes; the first `experts` per layer decompressed by compressed-tensors, finite, and
with `source` compared with the source weights), ``linears`` (FP8 weights carry an F32 ``weight_scale_inv`` of
[ceil(N/bn), ceil(K/bk)], finite and > 0; with `source`, the FP8 linears of the first, middle and last layers
dequantized by torch's own float8_e4m3fn and compared with the source's; without linear_fp8_config every linear is
float) and ``ignore`` (every
non-expert linear ignored and no expert ignored, under compressed-tensors' matcher on HF names and SGLang's on
SGLang names). transformers is no validator for this layout (it drops weight_scale_inv silently).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ktconvert.architectures.manifests import resolve
from ktconvert.errors import InputError, KtConvertError
from ktconvert.formats.out_manifest import load_manifest
from ktconvert.formats.safetensors_reader import Checkpoint
from ktconvert.formats.sources import open_source
from ktconvert.gpu.config import ct_ignored, sglang_ignored
from ktconvert.gpu.experts import decompress_expert
from ktconvert.gpu.linears import FUSED_SHARDS, is_linear_base, sglang_names
from ktconvert.layouts.naming import INDEX_NAME
from ktconvert.quant.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from ktconvert.util.safe_read import read_json
from ktconvert.verification.folder import OutputFolder

ACTORDERS = (None, "static", "weight")
REL_ERR_LIMIT = {4: 0.35, 8: 0.03}     # relative L2 error per matrix, generous for heavy-tailed weights
FP8_LINEAR_LIMIT = 0.08     # relative L2 of one block-FP8 linear (E4M3, 3 mantissa bits: ~0.02-0.04 on real weights)


class _Check:
    def __init__(self, name: str):
        self.name, self.problems, self.count, self.detail = name, [], 0, ""

    def add(self, line: str) -> None:
        self.count += 1
        self.problems.append(line)      # every line: verify --json lists them all, the text rendering shortens

    def entry(self) -> dict:
        problems = list(self.problems)
        return {"name": self.name, "status": "failed" if problems else "ok", "detail": self.detail,
                "problems": problems}


def check_gpu_checkpoint(out, source=None, experts="all", folder: OutputFolder | None = None) -> dict:
    """Validate GPU checkpoint folder `out` (optionally against source checkpoint `source`).

    experts: "all" or how many experts per layer to decompress (structure is checked for all).
    folder: the folder's verification.folder.OutputFolder when already walked (its shard headers are reused).
    Returns {"ok", "problems": [str], "checks": [{name, status, detail, problems}], "errors": {...}}.
    """
    out = Path(out)
    checks, state = [], {}
    cfg_check = _check_config(out, state)
    checks.append(cfg_check)
    if "qc" in state:
        tensors = _check_index(folder or OutputFolder.scan(out), checks)
        info = _model_info(state["config"], tensors)
        layers = _moe_layers(info, tensors)
        src = _open_source(source, out)
        checks.append(_check_experts(out, state, info, layers, tensors, experts, src))
        checks.append(_check_linears(out, state, info, layers, tensors, src))
        checks.append(_check_ignore(state, info, layers, tensors))
    entries = [c.entry() for c in checks]
    problems = [p for e in entries for p in e["problems"]]
    return {"ok": not problems, "problems": problems, "checks": entries, "errors": state.get("errors", {})}


# ---------------------------------------------------------------------------------------------- config

def _check_config(out: Path, state: dict) -> _Check:
    check = _Check("config")
    try:
        config = read_json(out / "config.json")
    except InputError as exc:
        check.add(f"config.json: unreadable ({exc})")
        return check
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        check.add("config.json: no quantization_config object")
        return check
    qc = dict(qc)
    fp8 = _check_linear_fp8(qc, check)
    try:
        from compressed_tensors.quantization import QuantizationConfig

        parsed = QuantizationConfig.model_validate(qc)
    except Exception as exc:       # pydantic ValidationError and friends: report the first line
        first = str(exc).strip().splitlines()
        check.add("config.json: quantization_config rejected by compressed-tensors: " + " | ".join(first[:3]))
        return check
    group = _check_scheme(parsed, check)
    if group is None:
        return check
    w = group.weights
    state.update(config=config, qc=qc, parsed=parsed, group=group, bits=w.num_bits, group_size=w.group_size,
                 actorder=_actorder(w.actorder), fp8=fp8, ignore=list(parsed.ignore or []))
    check.detail = (f"int{w.num_bits} g{w.group_size} actorder {_actorder(w.actorder)}, "
                    f"linear_fp8_config {'present' if fp8 else 'absent'}, {len(parsed.ignore or [])} ignore entries")
    return check


def _actorder(value):
    return getattr(value, "value", value)


def _check_linear_fp8(qc: dict, check: _Check) -> dict | None:
    if "linear_fp8_config" not in qc:
        return None
    value = qc.pop("linear_fp8_config")
    where = "config.json: quantization_config.linear_fp8_config"
    if not isinstance(value, dict):
        check.add(f"{where} is {json.dumps(value)}, expected an object: SGLang calls .get() on it and crashes at "
                  "startup (sgl-project/sglang#37846); omit the key instead of null")
        return None
    if value.get("quant_method") != "fp8":
        check.add(f"{where}.quant_method is {value.get('quant_method')!r}, expected 'fp8' (else SGLang refuses "
                  "block quantization: not an fp8-serialized checkpoint)")
    if value.get("activation_scheme", "dynamic") != "dynamic":
        check.add(f"{where}.activation_scheme is {value.get('activation_scheme')!r}, expected 'dynamic'")
    block = value.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        check.add(f"{where}.weight_block_size is {block!r}, expected a list of 2 positive ints ([128, 128])")
        return None
    return value


def _check_scheme(parsed, check: _Check):
    where = "config.json: quantization_config"
    fmt = getattr(parsed.format, "value", parsed.format)
    if fmt != "pack-quantized":
        check.add(f"{where}.format is {fmt!r}, expected 'pack-quantized' (SGLang reads only the top-level format)")
    groups = [g for g in parsed.config_groups.values() if "Linear" in (g.targets or [])]
    if not groups:
        check.add(f"{where}: no config group targets 'Linear' (SGLang's WNA16 MoE scheme needs that key)")
        return None
    w = groups[0].weights
    rules = [(w is not None, "weights arguments present"), (w and w.symmetric, "symmetric: true"),
             (w and w.num_bits in (4, 8), "num_bits 4 or 8"), (w and _actorder(w.strategy) == "group",
                                                                 "strategy 'group'"),
             (w and w.group_size in (32, 64, 128), "group_size 32, 64 or 128 (Marlin)"),
             (w and _actorder(w.actorder) in ACTORDERS, "actorder null, 'static' or 'weight'"),
             (groups[0].input_activations is None, "no input activation quantization (W*A16)")]
    for ok, rule in rules:
        if not ok:
            check.add(f"{where}.config_groups: expected {rule}")
    return groups[0] if w is not None else None


# ---------------------------------------------------------------------------------------------- index / tensors

def _check_index(folder: OutputFolder, checks: list) -> dict:
    """{tensor: (shard, TensorRef)} from every top-level *.safetensors; appends the index check."""
    check = _Check("index")
    tensors = {}
    shards = folder.top_level_shards()
    for name in shards:
        if name in folder.header_errors:
            check.add(f"{name}: unreadable header ({folder.header_errors[name]})")
            continue
        for tname, ref in folder.shards[name].tensors.items():
            tensors[tname] = (name, ref)
    try:
        weight_map = read_json(folder.root / INDEX_NAME)["weight_map"]
    except (InputError, KeyError, TypeError) as exc:
        check.add(f"model.safetensors.index.json: missing or unreadable ({exc})")
        weight_map = {}
    else:
        for shard in sorted(set(shards) - set(weight_map.values())):
            check.add(f"{shard}: shard not listed in model.safetensors.index.json (SGLang would not load it)")
        wrong = sorted(t for t, (s, _) in tensors.items() if weight_map.get(t) != s)
        for t in wrong[:3]:
            check.add(f"model.safetensors.index.json: {t} mapped to {weight_map.get(t)}, found in {tensors[t][0]}")
        for t in sorted(set(weight_map) - set(tensors))[:3]:
            check.add(f"model.safetensors.index.json: {t} listed but in no shard")
    check.detail = f"{len(shards)} shards, {len(tensors)} tensors"
    checks.append(check)
    return tensors


def _model_info(config: dict, tensors: dict):
    return resolve(config, [n.replace(".weight_packed", ".weight") for n in tensors])


def _moe_layers(info, tensors: dict) -> list[int]:
    """MoE layers, plus MTP layers whose expert 0 is in the checkpoint."""
    mtp = [layer for layer in info.mtp_layers
           if any(n.startswith(_module(info.expert_names(layer, 0)["gate"])) for n in tensors)]
    return list(info.moe_layers) + mtp


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


# ---------------------------------------------------------------------------------------------- experts

def _check_experts(out: Path, state: dict, info, layers, tensors: dict, experts, src) -> _Check:
    """src: the opened source (_open_source), or None."""
    check = _Check("experts")
    bits, gs = state["bits"], state["group_size"]
    shapes = {"gate": (info.intermediate, info.hidden), "up": (info.intermediate, info.hidden),
              "down": (info.hidden, info.intermediate)}
    limit = info.n_experts if experts in (None, "all") else min(int(experts), info.n_experts)
    errors, decoded = [], 0
    for layer in layers:
        for e in range(info.n_experts):
            for proj, name in info.expert_names(layer, e).items():
                base = _module(name)
                if not _expert_structure(base, shapes[proj], bits, gs, tensors, check):
                    continue
                if e < limit:
                    err = _decompress(out, base, shapes[proj], state, tensors, src, layer, e, proj, check)
                    decoded += 1
                    if err is not None:
                        errors.append((layer, e, proj, err))
    if errors:
        state["errors"] = error_summary(errors, REL_ERR_LIMIT[bits])
    rel = [err for *_, err in errors]
    check.detail = (f"{len(layers)} MoE layers x {info.n_experts} experts x 3; {decoded} decompressed"
                    + (f"; rel L2 vs source mean {np.mean(rel):.4f} max {max(rel):.4f}" if rel else ""))
    return check


def error_summary(errors: list[tuple[int, int, str, float]], limit: float) -> dict:
    """The "errors" of a verified GPU checkpoint from (layer, expert, proj, relative L2 vs source) per decompressed
    matrix: max_rel_l2, mean_rel_l2, matrices, limit (per matrix), layers [{layer, gate, up, down: mean over the
    layer's decompressed experts}], experts [{layer, expert, rel_l2: its worst matrix}]."""
    rel = [err for *_, err in errors]
    by_layer: dict[int, dict[str, list[float]]] = {}
    by_expert: dict[tuple[int, int], float] = {}
    for layer, e, proj, err in errors:
        by_layer.setdefault(layer, {}).setdefault(proj, []).append(err)
        by_expert[layer, e] = max(err, by_expert.get((layer, e), 0.0))
    return {"max_rel_l2": max(rel), "mean_rel_l2": float(np.mean(rel)), "matrices": len(rel), "limit": limit,
            "layers": [{"layer": layer, **{proj: float(np.mean(v)) for proj, v in projs.items()}}
                       for layer, projs in sorted(by_layer.items())],
            "experts": [{"layer": layer, "expert": e, "rel_l2": err} for (layer, e), err in sorted(by_expert.items())]}


def _expert_structure(base: str, shape, bits: int, gs: int, tensors: dict, check: _Check) -> bool:
    n, k = shape
    want = {"weight_packed": (("I32",), (n, k * bits // 32)), "weight_scale": (("BF16", "F16", "F32"), (n, k // gs)),
            "weight_shape": (("I64", "I32"), (2,))}
    ok = True
    for suffix, (dtypes, wshape) in want.items():
        entry = tensors.get(f"{base}.{suffix}")
        if entry is None:
            check.add(f"{base}.{suffix}: missing (SGLang would serve this expert from uninitialized memory)")
            ok = False
        elif entry[1].dtype not in dtypes or tuple(entry[1].shape) != wshape:
            check.add(f"{entry[0]}: {base}.{suffix}: {entry[1].dtype} {list(entry[1].shape)}, expected "
                      f"{'/'.join(dtypes)} {list(wshape)}")
            ok = False
    for suffix in ("weight", "weight_zero_point", "weight_g_idx"):
        if f"{base}.{suffix}" in tensors:
            check.add(f"{tensors[f'{base}.{suffix}'][0]}: {base}.{suffix}: unexpected for symmetric pack-quantized "
                      "experts")
    return ok


def _read(out: Path, tensors: dict, name: str) -> np.ndarray:
    """Tensor `name` of the output, read through its already parsed header entry."""
    _shard, ref = tensors[name]
    return Checkpoint(root=out, config={}, tensors={name: ref}, shards=[]).read(name)


def _decompress(out, base, shape, state, tensors, src, layer, e, proj, check) -> float | None:
    packed = _read(out, tensors, base + ".weight_packed")
    scale = _read(out, tensors, base + ".weight_scale")
    wshape = _read(out, tensors, base + ".weight_shape")
    if [int(x) for x in wshape] != list(shape):
        check.add(f"{base}.weight_shape holds {wshape.tolist()}, expected {list(shape)}")
        return None
    if scale.dtype != np.uint16:
        scale = _to_bf16(scale)
    try:
        w = decompress_expert(packed, scale, shape, state["bits"], state["group_size"], state["actorder"])
    except Exception as exc:   # a torch / compressed-tensors failure is a verification finding, not a crash
        check.add(f"{base}: compressed-tensors cannot decompress it ({exc})")
        return None
    if not np.isfinite(w).all():
        check.add(f"{base}: decompressed weights hold NaN/Inf")
        return None
    if src is None:
        return None
    ref = bf16_bits_to_f32(getattr(src.read_expert(layer, e), proj))
    err = float(np.linalg.norm(w - ref) / max(np.linalg.norm(ref), 1e-30))
    if err > REL_ERR_LIMIT[state["bits"]]:
        check.add(f"{base}: relative L2 error {err:.4f} against the source exceeds {REL_ERR_LIMIT[state['bits']]}")
    return err


def _to_bf16(scale: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(scale.astype(np.float32))


def _open_source(source, out: Path):
    """The source checkpoint, opened as the conversion of `out` opened it (its recorded --expert-orientation)."""
    if source is None:
        return None
    try:
        recorded = (load_manifest(out).get("source") or {}).get("expert_orientation")
    except KtConvertError:
        recorded = None
    return open_source(source, recorded)


# ---------------------------------------------------------------------------------------------- linears

def _linear_modules(info, layers, tensors: dict) -> tuple[set[str], set[str]]:
    """(SGLang LinearBase HF modules, other non-expert 2-D linear modules) present in the checkpoint."""
    expert_modules = {_module(n) for layer in layers for e in range(info.n_experts)
                      for n in info.expert_names(layer, e).values()}
    base, other = set(), set()
    for name, (_, ref) in tensors.items():
        if not name.endswith(".weight") or len(ref.shape) != 2:
            continue
        module = _module(name)
        if module in expert_modules or module.endswith(("embed_tokens", "embeddings", "wte")):
            continue
        (base if is_linear_base(module, info.manifest) else other).add(module)
    return base, other


def _check_linears(out: Path, state: dict, info, layers, tensors: dict, src=None) -> _Check:
    check = _Check("linears")
    fp8 = state["fp8"]
    block = tuple(fp8["weight_block_size"]) if fp8 else (128, 128)
    base, _ = _linear_modules(info, layers, tensors)
    n_fp8 = 0
    for module in sorted(base):
        shard, ref = tensors[module + ".weight"]
        if fp8 is None and ref.dtype not in ("BF16", "F16", "F32"):
            check.add(f"{shard}: {module}.weight is {ref.dtype} but config.json has no linear_fp8_config: SGLang "
                      "loads linears as BF16 (and the ignore list leaves them unquantized)")
        elif fp8 is not None and ref.dtype != "F8_E4M3":
            check.add(f"{shard}: {module}.weight is {ref.dtype}, expected F8_E4M3: linear_fp8_config makes every "
                      "linear block FP8 (a BF16 tensor is cast without scaling: garbage, no error)")
    scaled = []
    for name, (shard, ref) in sorted(tensors.items()):
        if name.endswith(".weight") and ref.dtype == "F8_E4M3":
            n_fp8 += 1
            if _check_fp8_scale(out, tensors, _module(name), ref, block, check):
                scaled.append(_module(name))
    check.detail = f"{len(base)} SGLang linears, {n_fp8} FP8 weights"
    if src is not None and scaled:
        errors = _fp8_linear_errors(out, tensors, src, scaled, block, check)
        if errors:
            state.setdefault("errors", {})["linears"] = errors
            check.detail += (f"; {len(errors['modules'])} of the first, middle and last layers vs source: rel L2 "
                             f"max {errors['max_rel_l2']:.4f}")
    return check


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    return next((int(b) for a, b in zip(parts, parts[1:]) if a == "layers" and b.isdigit()), None)


def _fp8_linear_errors(out: Path, tensors: dict, src, modules: list[str], block, check: _Check) -> dict:
    """{"limit", "max_rel_l2", "modules": [{"module", "layer", "rel_l2"}]} of the FP8 `modules` of the first,
    middle and last decoder layers holding any (and those outside layers): W = e4m3 codes (torch's float8_e4m3fn
    cast) x the block's weight_scale_inv, against the source's weights."""
    import torch

    held = sorted({_layer_of(m) for m in modules} - {None})
    picked = {held[0], held[len(held) // 2], held[-1]} if held else set()
    rows = []
    for module in modules:
        layer = _layer_of(module)
        if layer is not None and layer not in picked:
            continue
        codes = torch.from_numpy(np.ascontiguousarray(_read(out, tensors, module + ".weight")).view(np.uint8))
        w = codes.view(torch.float8_e4m3fn).to(torch.float32)
        scale = torch.from_numpy(np.asarray(_read(out, tensors, module + ".weight_scale_inv"), np.float32))
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
        w = (w * full).numpy()
        try:
            ref = bf16_bits_to_f32(src.read_linear(module))
        except KtConvertError:
            continue        # a linear the source stores otherwise (the conversion decoded it): not compared here
        err = float(np.linalg.norm(w - ref) / max(float(np.linalg.norm(ref)), 1e-30))
        if err > FP8_LINEAR_LIMIT:
            check.add(f"{module}: FP8 weights' relative L2 error {err:.4f} against the source exceeds "
                      f"{FP8_LINEAR_LIMIT}")
        rows.append({"module": module, "layer": layer, "rel_l2": err})
    if not rows:
        return {}
    return {"limit": FP8_LINEAR_LIMIT, "max_rel_l2": max(r["rel_l2"] for r in rows), "modules": rows}


def _check_fp8_scale(out: Path, tensors: dict, module: str, ref, block, check: _Check) -> bool:
    """Whether `module`'s weight_scale_inv is there, of the right dtype and shape, finite and > 0 (else a problem
    line)."""
    n, k = ref.shape
    want = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    entry = tensors.get(module + ".weight_scale_inv")
    if entry is None:
        hint = (" (found weight_scale: SGLang's block FP8 path reads only weight_scale_inv and skips it, leaving "
                "garbage scales)") if module + ".weight_scale" in tensors else ""
        check.add(f"{tensors[module + '.weight'][0]}: {module}.weight_scale_inv missing{hint}")
        return False
    shard, sref = entry
    if sref.dtype != "F32" or tuple(sref.shape) != want:
        check.add(f"{shard}: {module}.weight_scale_inv is {sref.dtype} {list(sref.shape)}, expected F32 {list(want)}")
        return False
    scale = _read(out, tensors, module + ".weight_scale_inv")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        check.add(f"{shard}: {module}.weight_scale_inv has non-finite or non-positive values")
        return False
    return True


# ---------------------------------------------------------------------------------------------- ignore

def _check_ignore(state: dict, info, layers, tensors: dict) -> _Check:
    check = _Check("ignore")
    ignore = state["ignore"]
    base, other = _linear_modules(info, layers, tensors)
    fused = sglang_names(base)
    for module in sorted(base | other):
        if not ct_ignored(module, ignore):
            check.add(f"ignore list misses {module} under compressed-tensors' matcher (exact / re.match on HF names)")
    sgl = {}
    for module, name in fused.items():
        sgl.setdefault(name, set()).add(module)
    for name in sorted(set(sgl) | other):
        if not sglang_ignored(name, ignore):
            check.add(f"ignore list misses {name} under SGLang's matcher (re.match / substring on SGLang names): "
                      "SGLang would give it the W4A16 scheme")
    experts = set()
    for layer in layers:
        for e in range(info.n_experts):
            experts.update(_module(n) for n in info.expert_names(layer, e).values())
        gate = _module(info.expert_names(layer, 0)["gate"])
        moe = gate[: gate.index(".experts.") + len(".experts.")]
        experts.update(f"{moe}0.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    hit = sorted(m for m in experts if ct_ignored(m, ignore) or sglang_ignored(m, ignore))
    for m in hit[:3]:
        check.add(f"ignore list matches routed expert {m}: it would not be loaded as W{state['bits']}A16")
    check.detail = (f"{len(base | other)} non-expert linears ({len(set(sgl))} SGLang names, fused "
                    f"{sorted({n.rsplit('.', 1)[1] for n in sgl if n.rsplit('.', 1)[1] in FUSED_SHARDS.values()})}),"
                    f" {len(experts)} expert names")
    return check

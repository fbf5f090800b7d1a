"""The launch flags against the files, the model and the host: every mismatch kt-kernel 0.7.2 turns into garbage, a
crash or a refusal (kt-native-formats.md, kt-format.md §2.3, §4.1; measured where the docs say so).

* ``--kt-method`` must be the files' method (AMXINT4 files run as AMXINT8 or the reverse, per-channel FP8 or MXFP8
  run as FP8: garbage; any other method: its loader finds no experts and kt-kernel refuses to start);
* ``--kt-threadpool-count``: converted files (AMX) store T NUMA parts and need exactly T (fewer: garbage, more:
  segfault); in-place formats are split by kt-kernel in memory, so T must split I (whole groups / 128-blocks per
  part, GPTQ at least one group per part: the AVX2 backend returns zeros, the VNNI one refuses; LLAMAFILE I/256
  blocks of 256 rows at least one per part); ``--kt-numa-nodes`` must list T nodes;
* the model SGLang starts kt-kernel with (``--model-path``'s config.json): H must equal the files', I smaller than
  the files' is garbage and larger a segfault, more experts than the files a segfault, a MoE layer the files lack
  a refusal;
* the host's kt-kernel build and environment (``runtime.check_runtime``).

``launch_findings(...)`` -> (findings, the flags that work {option: value}, valid NUMA counts of in-place files).
"""
from __future__ import annotations

import os

from ktconvert.launchcheck.findings import Finding, option_fix
from ktconvert.methods import all_methods

# kt-kernel 0.7.2 experts.py INFERENCE_METHODS: those ktconvert registers (kt_methods()) and these
UNREGISTERED = ("SYCL_GPTQ_INT4", "MOE_INT4", "MOE_INT8")
GARBAGE_PAIRS = {("FP8_PERCHANNEL", "FP8"), ("MXFP8", "FP8")}      # (files, flag): loads, computes garbage
QK_K = 256


def kt_methods() -> set[str]:
    """Every --kt-method value kt-kernel 0.7.2 accepts."""
    return {m.kt_method for m in all_methods()} | set(UNREGISTERED)


def default_method() -> str:
    return next(m.kt_method for m in all_methods() if m.default)


def method_findings(identity, launch) -> list[Finding]:
    want = identity.method
    given = launch.value("kt-method")
    spelling = launch.spelling("kt-method")
    works, fix = option_fix("kt-method", want, spelling if given is not None else None)
    if given is None:
        default = default_method()
        if want == default:
            return [Finding("--kt-method", None, f"the files hold {want}, kt-kernel's default method", works=works,
                            severity="warning", fix=fix)]
        return [Finding("--kt-method", None, f"the files hold {want}; without the flag kt-kernel starts its default "
                        f"{default}", "refusal", works, fix=fix)]
    if given == want:
        return []
    if given.upper() == want:
        return [Finding(spelling, given, f"kt-kernel compares method names exactly; the files hold {want}",
                        "refusal", works, fix=fix)]
    converted = identity.numa is not None
    if given not in kt_methods():
        holds, effect = f"not a kt-kernel method; the files hold {want}", "refusal"
    elif given in identity.alternatives:
        holds, effect = (f"the files have {given}'s names and sizes too, but they are taken as {want}: no build of the "
                         f"kt-kernel wheel runs {given}"), "refusal"
    elif converted and given in _converted_names():
        effect = "garbage" if identity.layout.startswith("merged") else "refusal"
        holds = f"the files hold {want} tiles ({identity.facts.get('evidence', '')})"
    elif (want, given) in GARBAGE_PAIRS or (want, given) == ("FP8", "FP8_PERCHANNEL") and \
            identity.facts.get("scale_suffix") == "weight_scale":     # a 2-D block scale read per channel
        holds, effect = f"the files hold {want} ({identity.facts.get('evidence', '')})", "garbage"
    else:
        holds, effect = (f"the files hold {want} ({identity.facts.get('evidence', '')}); {given}'s loader finds no "
                         "experts in them"), "refusal"
    return [Finding(spelling, given, holds, effect, works, fix=fix)]


def _converted_names() -> set[str]:
    return {m.kt_method for m in all_methods() if m.needs_conversion}


def valid_numa(identity, backend: str = "") -> tuple[list[int], str]:
    """(the NUMA counts kt-kernel can split in-place files into, the rule), up to 64."""
    inter, gs = identity.intermediate, identity.group_size
    method, registered = identity.method, identity.registered
    if method == "LLAMAFILE":
        blocks = inter // QK_K if inter % QK_K == 0 else 0
        return list(range(1, min(blocks, 64) + 1)), f"at least one 256-row block per part, T <= I/256 = {blocks}"
    unit, rule = 1, "I % T == 0"
    if gs:
        unit, rule = gs, f"I/T a multiple of the group size {gs}"
    elif registered is not None and not registered.needs_conversion and registered.k_multiple > 1:
        unit, rule = registered.k_multiple, f"I/T a multiple of {registered.k_multiple} (whole blocks of down)"
    counts = [t for t in range(1, 65) if inter % t == 0 and (inter // t) % unit == 0 and inter // t >= unit]
    return counts, rule


def numa_findings(identity, launch, backend: str, manifest_flags: dict | None) -> tuple[list[Finding], int | None]:
    """(findings, the NUMA count that works)."""
    out = []
    t_run, bad = launch.int_value("kt-threadpool-count")
    spelling = launch.spelling("kt-threadpool-count")
    if bad is not None:
        out.append(Finding(spelling, bad, "not an integer (SGLang refuses it)", "refusal"))
    if identity.numa is not None:
        want = identity.numa
        works, fix = option_fix("kt-threadpool-count", want, spelling if t_run is not None else None)
        tree = identity.layout.startswith(".kt")
        how = f"the files hold {want} NUMA part{'s' if want > 1 else ''} (" + ("_numa_0.." if tree else "numa.0..") + \
            f"{want - 1} of every expert)"
        if t_run is None and bad is None:
            out.append(Finding("--kt-threadpool-count", None, how + "; kt-kernel must be started with exactly "
                               f"{want}", "garbage" if want > 1 else "", works, fix=fix,
                               severity="error" if want > 1 else "warning"))
        elif t_run is not None and t_run != want:
            effect = "refusal" if tree else "garbage" if t_run < want else "crash"   # .kt: files of other sizes
            out.append(Finding(spelling, str(t_run), how, effect, works, fix=fix))
        return out + _numa_nodes(launch, want), want
    counts, rule = valid_numa(identity, backend)
    if identity.method == "LLAMAFILE" and identity.intermediate % QK_K:
        out.append(Finding("files", f"I = {identity.intermediate}", "kt-kernel's LLAMAFILE needs the expert "
                           "intermediate size to be a multiple of 256 (ValueError)", "refusal"))
        return out, None
    recorded = (manifest_flags or {}).get("kt-threadpool-count")
    target = t_run if t_run in counts else recorded if recorded in counts else None
    if target is None and counts:
        below = [t for t in counts if t <= (t_run or 1)]
        target = below[-1] if below else counts[0]
    works, fix = option_fix("kt-threadpool-count", target, spelling if t_run is not None else None)
    if t_run is not None and t_run not in counts:
        zeros = identity.method == "GPTQ_INT4" and "AVX2" in backend and identity.group_size and \
            identity.intermediate % t_run == 0 and identity.intermediate // t_run < identity.group_size
        out.append(Finding(spelling, str(t_run), f"kt-kernel splits these {identity.method} files in memory and "
                           f"needs {rule} (I = {identity.intermediate}); valid: {_short(counts)}",
                           "zeros" if zeros else "refusal", works, fix=fix))
    elif t_run is None and bad is None:
        out.append(Finding("--kt-threadpool-count", None, f"SGLang-KT's default applies; these files split into T "
                           f"= {_short(counts)} ({rule})", works=works if target else None, severity="warning",
                           fix=fix))
    return out + _numa_nodes(launch, t_run or target), target


def _numa_nodes(launch, t: int | None) -> list[Finding]:
    nodes = launch.values("kt-numa-nodes")
    if nodes is None or t is None or len(nodes) == t:
        return []
    fixed = (nodes + [str(i) for i in range(len(nodes), t)])[:t]
    works, fix = option_fix("kt-numa-nodes", fixed)
    return [Finding("--kt-numa-nodes", " ".join(nodes), f"{len(nodes)} nodes for {t} NUMA parts: kt-kernel requires "
                    "one node per part (ValueError)", "refusal", works, fix=fix)]


def _short(counts: list[int]) -> str:
    return ", ".join(map(str, counts[:12])) + (", ..." if len(counts) > 12 else "") if counts else "none"


def model_findings(identity, dims, launch) -> list[Finding]:
    """The model's dimensions (config.json SGLang reads) against the files'."""
    if not dims.known:
        return []
    flag = launch.spelling("model-path") if launch.value("model-path") else "--model-path"
    given = launch.value("model-path")
    out = []

    def add(holds, effect, works, severity="error"):
        out.append(Finding(flag, given, f"{dims.source}: {holds}", effect, works, severity))

    right = "the model these experts were converted from"
    if dims.hidden is not None and dims.hidden != identity.hidden:
        add(f"hidden size {dims.hidden}, the files {identity.hidden}", "garbage", f"{right} (H = {identity.hidden})")
    if dims.intermediate is not None and dims.intermediate != identity.intermediate:
        effect = "garbage" if dims.intermediate < identity.intermediate else "crash"
        add(f"expert intermediate size {dims.intermediate} ({dims.how.get('intermediate', '')}), the files "
            f"{identity.intermediate}", effect, f"{right} (I = {identity.intermediate})")
    if dims.experts is not None and dims.experts != identity.experts:
        if dims.experts > identity.experts:
            add(f"{dims.experts} routed experts, the files hold {identity.experts}", "crash",
                f"{right} ({identity.experts} experts)")
        else:
            add(f"{dims.experts} routed experts, the files hold {identity.experts}: the others are never used", "",
                None, "warning")
    if dims.moe_layers is not None:
        missing = sorted(set(dims.moe_layers) - set(identity.layers))
        if missing:
            add(f"MoE layer {missing[0]} ({len(missing)} of {len(dims.moe_layers)}) has no experts in the files",
                "refusal", f"{right}, or a complete copy of the files")
    return out


def other_findings(identity, launch, weights) -> list[Finding]:
    """--kt-weight-path, --kt-num-gpu-experts and the parser's notes."""
    out = [Finding("command", None, note, severity="warning") for note in launch.notes]
    given = launch.value("kt-weight-path")
    spelling = launch.spelling("kt-weight-path")
    if given is None:
        works, fix = option_fix("kt-weight-path", str(weights))
        out.append(Finding("--kt-weight-path", None, "kt-kernel needs the folder of these files",
                           works=works, severity="warning" if launch.is_full_command() else "note", fix=fix))
    elif os.path.exists(given) and os.path.realpath(given) != os.path.realpath(weights):
        out.append(Finding(spelling, given, f"names another folder than the one checked ({weights})",
                           severity="warning"))
    n_gpu, bad = launch.int_value("kt-num-gpu-experts")
    if bad is not None:
        out.append(Finding(launch.spelling("kt-num-gpu-experts"), bad, "not an integer (SGLang refuses it)",
                           "refusal"))
    elif n_gpu is not None and n_gpu > identity.experts:
        out.append(Finding(launch.spelling("kt-num-gpu-experts"), str(n_gpu), f"more GPU experts than the "
                           f"{identity.experts} routed experts per layer", severity="warning",
                           works=f"at most {identity.experts}"))
    for name in ("kt-gpu-prefill-token-threshold", "tensor-parallel-size", "kt-cpuinfer"):
        value, bad = launch.int_value(name)
        if bad is not None:
            out.append(Finding(launch.spelling(name), bad, "not an integer (SGLang refuses it)", "refusal"))
    return out


def file_findings(identity) -> list[Finding]:
    """What the files themselves make kt-kernel refuse or misread, whatever the command (a problem is its text, or
    (text, effect); refusal unless it says)."""
    out = []
    for problem in identity.problems:
        text, effect = (problem, "refusal") if isinstance(problem, str) else problem
        out.append(Finding("files", None, text, effect, severity="error" if effect else "note"))
    return out

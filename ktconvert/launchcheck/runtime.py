"""Whether the kt-kernel 0.7.2 build that loads on a host runs the method (and group size, GGUF types) the files
hold, and which backend class it picks (kt_kernel/utils/amx.py ``_select_*_backend``; kt-native-formats.md
"Backend classes per wheel variant").

* the five AVX-512 builds (amx, avx512_*) have every AMX* class; the avx2 build has only the AVX2 / AVX-VNNI-256
  classes and llamafile: no AMXINT4 / AMXINT8, no FP8_PERCHANNEL, no BF16 GGUF;
* no build of the wheel runs MOE_INT4 / MOE_INT8 (AOCL-BLIS / KML source builds do);
* MXFP4: the AVX-512 kernel (preferred on AVX-512 builds) hard-codes 32-element groups, another group size is
  garbage; ``KT_MXFP4_BACKEND=avx2`` picks the AVX2 kernel, which runs any; NVFP4 (group 16) runs on the AVX2
  kernel only: refused on AVX-512 builds without that variable; MXFP8: group 32 only, the AMX kernel where the
  host has AMX; GPTQ_INT4: the packed AVX-VNNI-256 backend where the host has avx_vnni and the group is a multiple
  of 32 up to 2048, else AVX2;
* GGUF types: Q5_1 runs on no build (abort on decode, zeros on prefill), BF16 not on avx2; the types below were
  measured to run; others were not measured (a warning).

``check_runtime(identity, host, env, weight_quant)`` -> (backend, [Finding]).
"""
from __future__ import annotations

from ktconvert.launchcheck.findings import Finding
from ktconvert.launchcheck.hostcpu import Host

GGUF_RUNS = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")     # measured with kt-kernel 0.7.2's LLAMAFILE
GGUF_NEVER = {"Q5_1": "no kt-kernel build runs Q5_1"}
GGUF_NOT_AVX2 = {"BF16": "kt-kernel's avx2 build does not run BF16 GGUF"}
GENERAL = ("MOE_INT4", "MOE_INT8")
VNNI_PACKED_MAX, VNNI_MAX = 2048, 256


def _env_fix(var: str, value: str) -> tuple[str, dict]:
    return f"{var}={value} before the command", {var: value}


def check_runtime(identity, host: Host, env: dict, weight_quant: dict | None = None) -> tuple[str, list[Finding]]:
    """(the backend kt-kernel picks for the files' method on `host`, findings) (module doc)."""
    method = identity.method
    if method is None:
        return "", []
    if not host.known:
        return "", [Finding("host", None, "the CPU flags are unknown, so whether kt-kernel's build runs "
                            f"{method} is not checked (give --cpu-flags)", severity="note")]
    out: list[Finding] = []
    if host.refusal:
        out.append(Finding("KT_KERNEL_CPU_VARIANT", env.get("KT_KERNEL_CPU_VARIANT"), host.refusal, "refusal",
                           "no KT_KERNEL_CPU_VARIANT (let kt-kernel pick its build)", env={}))
    registered = identity.registered
    gs = identity.group_size
    if method in GENERAL:
        out.append(Finding("--kt-method", method, f"{method} runs on kt-kernel's AOCL-BLIS / KML source builds only; "
                           f"no build of the kt-kernel wheel has it (this host loads {host.build})", "refusal"))
        return "", out
    if registered is not None and not host.avx512 and (registered.needs_conversion or registered.needs_avx512):
        out.append(Finding("host", host.build, f"kt-kernel's avx2 build has no {method} backend (the AVX-512 "
                           "builds do)", "refusal", "an AVX-512 host for these files"))
        return "", out
    if registered is not None and method not in _SELECT:      # a _SELECT rule knows kt's backends and env for these
        for note in registered.runtime_notes(sorted(host.flags)):
            out.append(Finding("host", host.build, note, "garbage"))
        limits = getattr(registered, "group_sizes", ())
        if limits and gs is not None and gs not in limits:
            out.append(Finding("files", f"group size {gs}", registered.group_size_limit or
                               f"{method} runs group sizes {limits}", "garbage"))
    rule = _SELECT.get(method)
    if rule is None and registered is not None and getattr(registered, "group_sizes", ()):
        rule = _rawint4          # the registered grouped in-place method: compressed-tensors int4
    backend = (rule or _default)(identity, host, env, gs, out, weight_quant or {})
    return backend, out


def _default(identity, host, env, gs, out, weight_quant) -> str:
    block = identity.facts.get("block")
    if identity.method == "FP8" and block and list(block) != [128, 128]:
        out.append(Finding("files", f"{block[0]}x{block[1]} blocks", "kt-kernel's FP8 method hard-codes 128x128 "
                           "scale blocks", "garbage"))
    return f"{identity.method if host.avx512 else 'AVX2 ' + identity.method} backend ({host.build} build)"


def _mxfp4(identity, host, env, gs, out, weight_quant) -> str:
    forced = env.get("KT_MXFP4_BACKEND", "").strip().lower()
    if forced == "amx" and not host.avx512:
        works, env_fix = _env_fix("KT_MXFP4_BACKEND", "avx2")
        out.append(Finding("KT_MXFP4_BACKEND", forced, "the avx2 build has no AVX-512 FP4 kernel", "refusal",
                           works, env=env_fix))
        return ""
    avx512 = host.avx512 and forced != "avx2"
    if identity.method == "NVFP4":
        if gs != 16:
            out.append(Finding("files", f"group size {gs}", "kt-kernel's NVFP4 expects group size 16 "
                               "(RuntimeError)", "refusal"))
        if avx512:
            works, env_fix = _env_fix("KT_MXFP4_BACKEND", "avx2")
            out.append(Finding("KT_MXFP4_BACKEND", env.get("KT_MXFP4_BACKEND"), f"NVFP4 runs on the AVX2 FP4 "
                               f"kernel only; the {host.build} build picks the AVX-512 one", "refusal", works,
                               env=env_fix))
            return ""
        return f"AVX2 FP4 kernel ({host.build} build)"
    if avx512 and gs is not None and gs != 32:
        works, env_fix = _env_fix("KT_MXFP4_BACKEND", "avx2")
        out.append(Finding("KT_MXFP4_BACKEND", env.get("KT_MXFP4_BACKEND"), f"MXFP4 group size {gs}: the AVX-512 "
                           f"FP4 kernel ({host.build} build) hard-codes 32-element groups", "garbage", works,
                           env=env_fix))
    return f"{'AVX-512' if avx512 else 'AVX2'} FP4 kernel ({host.build} build)"


def _mxfp8(identity, host, env, gs, out, weight_quant) -> str:
    if gs != 32:
        out.append(Finding("files", f"group size {gs}", "kt-kernel's MXFP8 requires group size 32 (RuntimeError)",
                           "refusal"))
    forced = env.get("KT_MXFP8_BACKEND", "").strip().lower()
    amx_host = host.has("amx_tile") and host.has("amx_bf16")
    if forced == "amx" and not (host.avx512 and amx_host):
        out.append(Finding("KT_MXFP8_BACKEND", forced, "the AMX MXFP8 kernel needs an AVX-512 build on an AMX host",
                           "refusal", "no KT_MXFP8_BACKEND (kt-kernel then picks AVX2)"))
        return ""
    amx = forced != "avx2" and host.avx512 and amx_host
    return f"{'AMX' if amx else 'AVX2'} MXFP8 kernel ({host.build} build)"


def _gptq(identity, host, env, gs, out, weight_quant) -> str:
    qc = weight_quant.get("config") or {}
    where = weight_quant.get("file") or "config.json"
    if qc.get("quant_method") == "gptq":
        if qc.get("desc_act", False):
            out.append(Finding("files", "desc_act: true", f"{where}: kt-kernel's GPTQ_INT4 refuses act-order GPTQ "
                               "(NotImplementedError)", "refusal", "a GPTQ model quantized with desc_act=false"))
        if not qc.get("sym", True):
            out.append(Finding("files", "sym: false", f"{where}: kt-kernel's GPTQ_INT4 refuses asymmetric GPTQ "
                               "(NotImplementedError)", "refusal", "a symmetric GPTQ model"))
    elif not weight_quant.get("file"):
        out.append(Finding("files", None, "no config.json next to the weights: kt-kernel's GPTQ loader cannot check "
                           "sym / desc_act, and qzeros are ignored (an asymmetric model reads as garbage)",
                           severity="warning"))
    forced = env.get("KT_GPTQ_INT4_BACKEND", "").strip().lower()
    vnni = host.has("avx_vnni")
    ok = gs is not None and gs > 0 and gs % 32 == 0
    if forced in ("packed", "avxvnni-packed", "avxvnni256-packed", "avxvnni", "avxvnni256"):
        limit = VNNI_PACKED_MAX if "packed" in forced else VNNI_MAX
        if not vnni or not (ok and gs <= limit):
            out.append(Finding("KT_GPTQ_INT4_BACKEND", forced, "the AVX-VNNI-256 backend needs avx_vnni and a group "
                               f"size that is a multiple of 32 up to {limit}", "refusal", "no KT_GPTQ_INT4_BACKEND"))
            return ""
        return "AVX-VNNI-256 GPTQ backend"
    if forced != "avx2" and vnni and ok and gs <= VNNI_PACKED_MAX:
        return "AVX-VNNI-256 packed GPTQ backend"
    return "AVX2 GPTQ backend"


def _rawint4(identity, host, env, gs, out, weight_quant) -> str:
    forced = env.get("KT_RAWINT4_BACKEND", "").strip().lower()
    if forced in ("amx", "amx_blocked", "blocked") and not host.avx512:
        out.append(Finding("KT_RAWINT4_BACKEND", forced, "the avx2 build has no AMX int4 k-group backend", "refusal",
                           "no KT_RAWINT4_BACKEND"))
        return ""
    if host.avx512 and forced not in ("avxvnni", "avxvnni256", "avx2"):
        return f"AMX int4 k-group kernel ({host.build} build)"
    return f"{'AVX-VNNI-256' if host.has('avx_vnni') and forced != 'avx2' else 'AVX2'} int4 kernel"


def _llamafile(identity, host, env, gs, out, weight_quant) -> str:
    types = identity.facts.get("gguf_types", {})
    for name in sorted(types):
        if name in GGUF_NEVER or (name in GGUF_NOT_AVX2 and not host.avx512):
            why = GGUF_NEVER.get(name) or GGUF_NOT_AVX2[name]
            out.append(Finding("files", f"GGUF type {name}", f"{why} ({types[name]} expert tensors): the decode path "
                               "aborts, the prefill path returns zeros", "crash"))
        elif name not in GGUF_RUNS:
            out.append(Finding("files", f"GGUF type {name}", "not measured with kt-kernel 0.7.2's LLAMAFILE (F16, "
                               "BF16, Q8_0, Q4_0, Q4_K, Q6_K were)", severity="warning"))
    return f"llamafile ({host.build} build)"


_SELECT = {"MXFP4": _mxfp4, "NVFP4": _mxfp4, "MXFP8": _mxfp8, "GPTQ_INT4": _gptq, "LLAMAFILE": _llamafile}

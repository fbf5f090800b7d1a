"""Which of kt-kernel 0.7.2's six CPU builds loads on a host, from that host's CPU flags.

kt-kernel's wheel ships ``_kt_kernel_ext_{amx,avx512_bf16,avx512_vbmi,avx512_vnni,avx512_base,avx2}`` and picks
the first whose flags the host has (``kt_kernel/_cpu_detect.py``: a flag also matches without its underscores),
unless ``KT_KERNEL_CPU_VARIANT`` names one; a named build above what the host detects is refused at import. What a
build runs is ``launchcheck.runtime``.

``--cpu-flags`` describes another host: a comma- or space-separated flag list, a file holding a ``flags`` line
(/proc/cpuinfo) or a ``Flags:`` line (lscpu), or a build name (``amx``, ``avx512_vnni``, ...: exactly that build's
required flags).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ktconvert.errors import UsageError

# (build, flags it needs), best first: kt_kernel/_cpu_detect.py's variant_requirements
BUILDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("amx", ("amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi",
             "avx512_bf16")),
    ("avx512_bf16", ("avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi", "avx512_bf16")),
    ("avx512_vbmi", ("avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi")),
    ("avx512_vnni", ("avx512f", "avx512bw", "avx512_vnni")),
    ("avx512_base", ("avx512f", "avx512bw")),
    ("avx2", ("avx2",)),
)
LEVEL = {name: len(BUILDS) - 1 - i for i, (name, _) in enumerate(BUILDS)}     # avx2 0 ... amx 5
RELEVANT = sorted({f for _, flags in BUILDS for f in flags} | {"avx_vnni", "fma"})
CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class Host:
    """A CPU: its flags, where they came from, the kt-kernel build that loads there and why."""

    flags: frozenset
    source: str
    build: str
    why: str
    refusal: str = ""            # the import error kt-kernel raises (KT_KERNEL_CPU_VARIANT above the host)
    known: bool = True           # False: no flags could be read (the host checks are skipped)

    def has(self, *flags: str) -> bool:
        """Whether the host has every one of `flags` (with or without underscores, as kt-kernel matches)."""
        return all(has_flag(self.flags, f) for f in flags)

    @property
    def avx512(self) -> bool:
        """Whether the loaded build is one of the AVX-512 ones (amx included)."""
        return self.build != "avx2"

    def to_dict(self) -> dict:
        return {"flags": sorted(f for f in self.flags if f in RELEVANT or f.replace("_", "") in
                                {r.replace("_", "") for r in RELEVANT}),
                "flags_from": self.source, "build": self.build, "why": self.why,
                **({"refusal": self.refusal} if self.refusal else {}), "known": self.known}


def has_flag(flags, flag: str) -> bool:
    return flag in flags or flag.replace("_", "") in flags


def flags_line(text: str) -> set[str] | None:
    """The flags of the first ``flags`` / ``Flags:`` line of /proc/cpuinfo or lscpu text, or None."""
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if sep and key.strip().lower() == "flags":
            return set(rest.lower().split())
    return None


def this_host_flags() -> tuple[set[str], str]:
    """(flags, where from) of this machine; empty where /proc/cpuinfo cannot be read."""
    try:
        with open(CPUINFO, errors="replace") as fh:
            found = flags_line(fh.read())
    except OSError:
        found = None
    return (found or set()), ("this host (" + CPUINFO + ")" if found else "this host (flags unknown: no " +
                                                                             CPUINFO + ")")


def given_flags(value: str) -> tuple[set[str], str]:
    """(flags, where from) of a --cpu-flags value (module doc). UsageError for a value that gives no flag."""
    text = value.strip()
    lowered = text.lower()
    for name, needs in BUILDS:
        if lowered == name:
            return set(needs), f"--cpu-flags {name} (that build's required flags)"
    if os.path.isfile(text):
        with open(text, errors="replace") as fh:
            found = flags_line(fh.read(1 << 22))
        if not found:
            raise UsageError("--cpu-flags file holds no flags line", file=text,
                             expected="/proc/cpuinfo or lscpu output")
        return found, f"--cpu-flags {text}"
    found = {f for f in re.split(r"[,\s]+", lowered) if f}
    if not found:
        raise UsageError("--cpu-flags is empty", expected="flags (avx2,avx512f,...), a cpuinfo file or a build name")
    return found, "--cpu-flags"


def detect_build(flags) -> tuple[str, str]:
    """(build, why) kt-kernel's detection picks for these flags."""
    for name, needs in BUILDS:
        if all(has_flag(flags, f) for f in needs):
            return name, "has " + ", ".join(needs)
    return "avx2", "no AVX-512 build matches (kt-kernel falls back to avx2)"


def host(cpu_flags: str | None = None, env: dict | None = None) -> Host:
    """The Host of --cpu-flags (None: this machine), with the command's environment words (KT_KERNEL_CPU_VARIANT)."""
    flags, source = this_host_flags() if cpu_flags is None else given_flags(cpu_flags)
    if not flags:
        return Host(frozenset(), source, "unknown", "no CPU flags (give --cpu-flags)", known=False)
    build, why = detect_build(flags)
    forced = (env or {}).get("KT_KERNEL_CPU_VARIANT", "").strip().lower()
    if forced in LEVEL:
        if LEVEL[forced] > LEVEL[build]:
            refusal = (f"KT_KERNEL_CPU_VARIANT={forced} needs a newer CPU than this one ({build}): kt-kernel "
                       "refuses to import")
            return Host(frozenset(flags), source, forced, f"KT_KERNEL_CPU_VARIANT={forced}", refusal)
        return Host(frozenset(flags), source, forced, f"KT_KERNEL_CPU_VARIANT={forced} (the host would load "
                                                      f"{build})")
    return Host(frozenset(flags), source, build, why)

"""The base of every CPU output method (a kt-kernel ``--kt-method`` value) and the registry ``METHODS``.

A method is one class, the single source of truth for everything that depends on it: its sizes and alignment
rules (n/k multiples, the NUMA counts and group sizes that work), the sink it writes with, the checks it is
verified with and their thresholds, the kt-kernel / SGLang flags, the ``quantization_config`` of its output, what
kt-kernel needs at run time (``needs_amx``) and which inputs kt-kernel reads in place with it (``reads_as_is``).
A method's own options (llamafile's ``ggml_type``) are data it declares, ``method_options``: configured() applies
them (``with_options``) and refuses them with every other method. Classes register themselves when defined
(``__init_subclass__``, as gguf-py's quant classes do): a class that sets its own ``name`` is in ``METHODS`` under
that name and its ``aliases``. Everything else (plan, inspect,
verify, the command line, the sources and sinks) asks the registry and never names a method.

Sizes are per matrix in HF orientation [n, k] = [out, in]: gate/up [I, H], down [H, I]; a NUMA part t of T holds
gate/up rows [t*I/T, (t+1)*I/T) and down columns of the same range. A method declares the tensors one stored matrix
(part) becomes as data, ``tensor_specs(n, k) -> {suffix: (safetensors dtype, shape)}``; every byte count (the plan,
the sinks' file plans and headers, verify) is derived from that declaration and nowhere restated.
"""
from __future__ import annotations

from typing import ClassVar

from ktconvert.errors import ShapeError, UsageError
from ktconvert.formats.out_manifest import kt_flags
from ktconvert.formats.st_writer import tensor_nbytes
from ktconvert.layouts.naming import PROJS, part_shape
from ktconvert.registry import Registry

TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]   # {suffix: (safetensors dtype, shape)}


def check(name: str, ok: bool, detail: str) -> dict:
    """One alignment check as plan reports it: {"check", "ok", "detail"}."""
    return {"check": name, "ok": bool(ok), "detail": detail}


class CpuMethod:
    """Base of every CPU method: names and rules as class data, behaviour as classmethods (no instances)."""

    name: ClassVar[str] = ""                 # registry name ("" on abstract bases: not registered)
    aliases: ClassVar[tuple[str, ...]] = ()
    kt_method: ClassVar[str] = ""            # kt-kernel's method= / SGLang --kt-method value
    file_prefix: ClassVar[str] = ""          # .kt file name prefix ("INT4" -> INT4_gate_0_..Byte_quant_.kt)
    writable: ClassVar[bool] = True          # False: kt-kernel reads the source itself; ktconvert writes nothing
    default: ClassVar[bool] = False          # the method used where none is given (demo)
    needs_conversion: ClassVar[bool] = True  # False: the output is HF tensors kt-kernel reads in place
    needs_amx: ClassVar[bool] = False        # kt-kernel 0.7.2 runs this method only on CPUs with AMX
    needs_avx512: ClassVar[bool] = False     # kt-kernel 0.7.2 has no AVX2 kernel for it (amx / avx512_* builds only)
    n_multiple: ClassVar[int] = 1
    k_multiple: ClassVar[int] = 1
    layouts: ClassVar[tuple[str, ...]] = ("safetensors",)
    quants: ClassVar[tuple[str, ...]] = ("rtn",)  # the --quant values it applies ("rtn": plain conversion)
    group_sizes: ClassVar[tuple[int, ...]] = ()   # the --group-size values that work (empty: no groups)
    group_size: ClassVar[int | None] = None
    group_size_limit: ClassVar[str] = ""     # why group_sizes is what it is, said when another size is refused
    thresholds: ClassVar[dict] = {}          # verification limits against the source (relative L2, cosine)
    # the method's own options: {name: the values it takes}, each a CpuOptions field of that name (None there: not
    # given), applied by with_options and refused with every other method (configured)
    method_options: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            METHODS.register(cls.name, cls.aliases)(cls)

    # ---------------------------------------------------------------- options

    @classmethod
    def configured(cls, group_size: int | None = None, **options) -> type["CpuMethod"]:
        """This method with its options applied: a group size, where the method has groups (elsewhere it is
        ignored, so one set of batch defaults serves every method), and the method's own options (``options``:
        {name: value}, None = not given). UsageError for a method ktconvert cannot write, a group size the method
        does not have (listing those that work), or an option of another method."""
        if not cls.writable:
            raise UsageError(f"ktconvert does not write {cls.kt_method}: kt-kernel reads it from the source as is",
                             hint="choose one of " + ", ".join(writable_names()))
        given = {name: value for name, value in options.items() if value is not None}
        for name in given:
            if name not in cls.method_options:
                flag = "--" + name.replace("_", "-")
                owners = [m.name for m in all_methods() if name in m.method_options]
                raise UsageError(f"{flag} does not apply to --method {cls.name}", found=f"{flag} {given[name]}",
                                 hint=f"{flag} is an option of --method {' or '.join(owners)}" if owners else None)
        method = cls
        if group_size is not None and group_size != cls.group_size and cls.group_sizes:
            if group_size not in cls.group_sizes:
                raise UsageError(f"unsupported group size for {cls.kt_method}",
                                 expected=" or ".join(map(str, cls.group_sizes)), found=str(group_size),
                                 hint=cls.group_size_limit or None)
            method = type(f"{cls.__name__}G{group_size}", (cls,), {"group_size": group_size,
                                                                  "k_multiple": group_size})
        return method.with_options(**given) if given else method

    @classmethod
    def with_options(cls, **options) -> type["CpuMethod"]:
        """This method with its own options (names of ``method_options``, values given) applied; UsageError for a
        value it does not take. Only methods that declare options override it."""
        return cls

    @classmethod
    def from_manifest(cls, manifest: dict) -> type["CpuMethod"]:
        """The method a ``ktconvert.json`` records (with its group size and its own options, as manifest_fields
        wrote them under "extra"). A positive group size the method no longer writes is still read: the files are
        what they are, and verify says what kt-kernel makes of them (RAWINT4: verification.numeric_rawint4).
        Anything else configured() refuses is refused here too."""
        method = METHODS.get(manifest["method"])
        extra = manifest.get("extra") if isinstance(manifest.get("extra"), dict) else {}
        options = {name: manifest.get(name, extra.get(name)) for name in method.method_options}
        size = manifest.get("group_size")
        if method.writable and method.group_sizes and type(size) is int and size > 0 and size != method.group_size:
            method = type(f"{method.__name__}G{size}", (method,), {"group_size": size, "k_multiple": size})
            size = None
        return method.configured(size, **options)

    @classmethod
    def manifest_fields(cls) -> dict:
        """Method options recorded in ktconvert.json next to "method" (the group size of grouped methods)."""
        return {"group_size": int(cls.group_size)} if cls.group_sizes else {}

    # ---------------------------------------------------------------- shape rules

    @classmethod
    def check_shape(cls, n: int, k: int, where: str = "") -> None:
        """ShapeError unless n % n_multiple == 0 and k % k_multiple == 0 (and both positive)."""
        if n <= 0 or k <= 0 or n % cls.n_multiple or k % cls.k_multiple:
            raise ShapeError(f"matrix shape incompatible with {cls.kt_method or cls.name}", tensor=where or None,
                             expected=f"[n, k] with n % {cls.n_multiple} == 0 and k % {cls.k_multiple} == 0",
                             found=f"[{n}, {k}]")

    @classmethod
    def part_checks(cls, hidden: int, part: int) -> list[dict]:
        """Checks of one NUMA part's matrices: gate/up [n=I/T, k=H], down [n=H, k=I/T]."""
        out = []
        for label, (n, k), n_what, k_what in (("gate/up", (part, hidden), "I/T", "H"),
                                              ("down", (hidden, part), "H", "I/T")):
            if cls.n_multiple > 1:
                out.append(check(f"{label} part n % {cls.n_multiple} == 0", n % cls.n_multiple == 0,
                                 f"n = {n} ({n_what})"))
            if cls.k_multiple > 1:
                out.append(check(f"{label} part k % {cls.k_multiple} == 0", k % cls.k_multiple == 0,
                                 f"k = {k} ({k_what})"))
        return out

    @classmethod
    def alignment_checks(cls, hidden: int, inter: int, numa: int) -> list[dict]:
        """kt-kernel's rules for experts [I, H] / [H, I] split into `numa` parts (kt-format.md §2.0 item 5,
        §2.6, §2.7): one entry per rule, the first failing rule ends the list."""
        checks = [check("NUMA count T >= 1", numa >= 1, f"T = {numa}")]
        if numa < 1:
            return checks
        checks.append(check("I % T == 0", inter % numa == 0, f"{inter} % {numa} = {inter % numa}"))
        if inter % numa:
            return checks
        return checks + cls.part_checks(hidden, inter // numa)

    @classmethod
    def valid_numa(cls, hidden: int, inter: int) -> list[int]:
        """Every NUMA count T (ascending) for which alignment_checks passes."""
        return [t for t in range(1, inter + 1) if inter % t == 0
                and all(c["ok"] for c in cls.part_checks(hidden, inter // t))]

    @classmethod
    def check_numa(cls, hidden: int, inter: int, numa: int) -> list[dict]:
        """alignment_checks, raising ShapeError on the first failure with the NUMA counts that work."""
        checks = cls.alignment_checks(hidden, inter, numa)
        failed = [c for c in checks if not c["ok"]]
        if failed:
            good = cls.valid_numa(hidden, inter)
            if not good:    # the model's shape, not the NUMA count: say so, offer no --numa
                raise ShapeError(f"--method {cls.name} cannot store this model's experts (H={hidden}, I={inter}) "
                                 "with any --numa", expected=failed[0]["check"], found=failed[0]["detail"],
                                 hint="choose another --method (`ktconvert inspect SRC` lists what works)")
            raise ShapeError(f"--numa {numa} cannot work for --method {cls.name} (H={hidden}, I={inter})",
                             expected=failed[0]["check"], found=failed[0]["detail"],
                             hint=f"use --numa {' or '.join(map(str, good))}; valid NUMA counts: {good}")
        return checks

    # ---------------------------------------------------------------- sizes

    @classmethod
    def tensor_specs(cls, n: int, k: int) -> TensorSpecs:
        """{suffix: (safetensors dtype, shape)} of every tensor one stored [n, k] matrix (or NUMA part) becomes:
        the single declaration of the method's geometry."""
        raise NotImplementedError

    @classmethod
    def matrix_bytes(cls, n: int, k: int) -> dict[str, int]:
        """Bytes of one stored [n, k] matrix, per stored tensor (from tensor_specs)."""
        return {suffix: tensor_nbytes(dtype, shape) for suffix, (dtype, shape) in cls.tensor_specs(n, k).items()}

    @classmethod
    def expert_bytes(cls, hidden: int, inter: int, numa: int) -> int:
        """Output bytes of one expert: every NUMA part of converted tiles, or the whole HF matrices."""
        if cls.needs_conversion:
            return numa * sum(sum(cls.matrix_bytes(*part_shape(p, hidden, inter, numa)).values()) for p in PROJS)
        return sum(sum(cls.matrix_bytes(n, k).values()) for n, k in ((inter, hidden), (inter, hidden),
                                                                     (hidden, inter)))

    # ---------------------------------------------------------------- what kt-kernel / SGLang need

    @classmethod
    def flags(cls, numa: int) -> dict:
        """The kt-kernel / SGLang options an output needs; "." is the folder holding ktconvert.json."""
        return kt_flags(cls.kt_method, numa)

    @classmethod
    def quantization_config(cls) -> dict | None:
        """The output config.json's quantization_config (None: the output has no config.json of its own)."""
        return None

    @classmethod
    def runtime_notes(cls, cpu_flags: list[str]) -> list[str]:
        """What kt-kernel needs to run this method that this CPU (its /proc/cpuinfo flags) lacks."""
        if cls.needs_amx and not {"amx_tile", "amx_int8"} <= set(cpu_flags):
            return [f"kt-kernel 0.7.2's {cls.kt_method} backend needs AMX (amx_tile, amx_int8), which this CPU "
                    "lacks: without AMX its avx2 build crashes (SIGSEGV) and AVX-512 hosts returned NaN (measured); "
                    "run the output on an AMX CPU (Sapphire Rapids or later)"]
        if cls.needs_avx512 and "avx512f" not in set(cpu_flags):
            return [f"kt-kernel 0.7.2 has no AVX2 kernel for {cls.kt_method}: only its amx and avx512_* builds run "
                    "it (its avx2 build raises RuntimeError); run the output on a CPU with AVX-512"]
        return []

    @classmethod
    def reads_as_is(cls, source) -> str | None:
        """How kt-kernel reads `source` (an opened formats.base.Source) as is with this method, or None."""
        return None

    @classmethod
    def carry_over(cls, source, layers) -> str | None:
        """Why `source`'s routed experts of `layers` are already stored as this method's output tensors, so they are
        copied byte for byte instead of decoded and quantized again (and what it is); None where they are not."""
        return None

    @classmethod
    def inspect_line(cls, source) -> str:
        """inspect's verdict for `source`: "as is (...)", "convert: ..." or "no: ..."."""
        as_is = cls.reads_as_is(source)
        if as_is:
            return f"as is ({as_is})"
        if not cls.writable:
            return f"no: {cls.cannot_read(source)}"
        via = "" if source.input_format in ("bf16", "fp16", "fp32") else f" (decodes {source.input_format} " \
                                                                            "to BF16 first)"
        return f"convert: ktconvert cpu MODEL OUT --method {cls.name}{via}"

    @classmethod
    def cannot_read(cls, source) -> str:
        """Why kt-kernel cannot read `source` with this (read-only) method."""
        return "not readable"

    # ---------------------------------------------------------------- writing and checking

    @classmethod
    def open_sink(cls, out_dir, layers, info, numa: int, layout: str, include_dense: bool):
        """The sink writing this method's files for the MoE `layers` of model `info` (architecture.ModelInfo)."""
        raise NotImplementedError

    @classmethod
    def write_matrix(cls, writer, proj: str, expert: int, w_bf16, *, numa: int, quant: str, where: str) -> None:
        """Encode one expert matrix (uint16 BF16 bits, HF orientation) into one layer writer of open_sink's sink."""
        raise NotImplementedError

    @classmethod
    def check_structure(cls, folder, manifest: dict) -> tuple[list[str], str]:
        """(problems, detail) of an output folder (verification.folder.OutputFolder) against its manifest."""
        raise NotImplementedError

    @classmethod
    def check_numerics(cls, out, manifest: dict, source, tokens: int, layers, experts, threshold,
                       folder=None) -> dict:
        """The numeric verification of an output of this method: {"ok", "problems", "summary", ...}."""
        raise NotImplementedError

    @classmethod
    def expert_reader(cls, out, manifest: dict, folder=None):
        """A function (layer, expert) -> {"gate", "up": float32 [I, H], "down": float32 [H, I]}: an output's
        experts as kt-kernel computes with them (``verify --calibration``)."""
        raise NotImplementedError


METHODS: Registry = Registry("CPU method", base=CpuMethod)


def all_methods() -> list[type[CpuMethod]]:
    """Every registered method, by name."""
    return [cls for _, cls in METHODS.items()]


def method_option_values(name: str) -> list[str]:
    """Every value of the method option `name` that some method takes (the choices of its command-line option)."""
    return list(dict.fromkeys(v for cls in all_methods() for v in cls.method_options.get(name, ())))


def writable_names() -> list[str]:
    """The methods ktconvert writes (the choices of --method)."""
    return [cls.name for cls in all_methods() if cls.writable]

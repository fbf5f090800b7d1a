"""kt-kernel's LLAMAFILE method written by ktconvert: the routed experts as GGUF tensors, one GGUF file per MoE
layer or shards of at most ``--split-max-size`` (llama.cpp's split set, ``formats/gguf_sink.py``), quantized exactly
as llama.cpp's reference quantizer (``quant/ggml_quant.py``); with ``--include-dense`` also the non-expert tensors,
model metadata and tokenizer, a complete GGUF llama.cpp loads (``formats/gguf_model.py``).

``--ggml-type``: a type (Q4_K by default; Q5_K, Q6_K, Q8_0, Q4_0, BF16, F16: every expert tensor of that type, as
``llama-quantize --pure``) or a llama-quantize mix (Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S: the type llama.cpp's
``llama_tensor_get_type`` picks for each expert tensor without an importance matrix, ``expert_type``; the K mixes'
expert choices do not depend on one). ``--imatrix FILE``: llama-imatrix's GGUF or legacy .dat (``quant/imatrix.py``),
each expert quantized with its slice as llama-quantize does (Q4_K, Q5_K, Q6_K, Q4_0; Q8_0 / BF16 / F16 ignore it);
read when the options are, its entries checked against the model in open_sink (the plan), its sha256 in the manifest.
``--calibration FILE`` instead: the importance matrix computed from calibration tokens (``gptq.imatrix``: a float
forward of the source, llama-imatrix's sums), written into OUT and then used exactly as ``--imatrix`` of that file.

kt-kernel's rules, as data: its LLAMAFILE backend needs the expert intermediate size I to be a multiple of 256
(QK_K; a ValueError otherwise, whatever the type), splits I into NUMA parts of whole 256-row blocks (T <= I/256),
and reads rows of whole blocks (H a multiple of the type's block: 256 for K-quants, 32 for Q8_0 / Q4_0). Types its
0.7.2 builds do not run are said before anything is written (``runtime_notes``, from launchcheck.runtime's measured
table: BF16 not on the avx2 build; Q5_K not measured).

It is also the read-only verdict for a GGUF source: kt-kernel reads a GGUF checkpoint (I % 256 == 0) as is
(``reads_as_is``: inspect says "as is"). ``verification.gguf_output`` checks an output (structure from the sink's
plan, numerics through gguf-py's dequantization against the source).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import ClassVar

import numpy as np
from gguf import GGUFReader

from ktconvert.errors import NumericError, ShapeError, UsageError, VerifyError
from ktconvert.formats.gguf_sink import PROJ_TENSORS, GgufSink
from ktconvert.methods.base import CpuMethod, check
from ktconvert.quant import ggml, ggml_quant
from ktconvert.quant.bf16 import bf16_bits_to_f32
from ktconvert.quant.imatrix import Imatrix, load as load_imatrix
from ktconvert.verification import gguf_output

QK_K = 256
MIXES = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K"}   # llama_ftype -> its default type
TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]   # {suffix: (ggml type, [n, k])}
# verify's limit on the MoE output's rel L2 against the source, per ggml type (a mix: its default type's; its
# Q6_K / Q5_K down tensors only lower the error). Measured: the round trip of one matrix on Gaussian weights with
# outliers (tests/test_ggml_quant.py) Q8_0 0.0064, Q6_K 0.020, Q5_K 0.039, Q4_K 0.077, Q4_0 0.103; on the tiny
# heavy-tailed test model (H 256, I 512) per matrix 0.0088 / 0.026 / 0.046 / 0.091 / 0.139 and the MoE output
# (gate, up and down errors compound) 0.016 / 0.047 / 0.084 / 0.148 / 0.246. Each limit is about 1.7-2x the MoE
# figure.
# BF16 is the source's bits; F16 holds BF16's 8-bit mantissas exactly (measured 2e-8: values below F16's normal
# range lose bits)
MOE_REL_L2 = {"Q8_0": 0.03, "Q6_K": 0.08, "Q5_K": 0.15, "Q4_K": 0.25, "Q4_0": 0.4, "BF16": 0.0, "F16": 1e-4}


class Llamafile(CpuMethod):
    """Routed experts as GGUF ``blk.L.ffn_{gate,up,down}_exps.weight`` of one ggml type (--ggml-type)."""

    name, aliases, kt_method, file_prefix = "llamafile", ("gguf",), "LLAMAFILE", "LLAMAFILE"
    needs_conversion = False                       # whole matrices: kt-kernel splits the NUMA parts in memory
    layouts: ClassVar[tuple[str, ...]] = ("gguf",)
    ggml_types: ClassVar[tuple[str, ...]] = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "BF16", "F16", *MIXES)
    ggml_type: ClassVar[str] = "Q4_K"
    split_max_size: ClassVar[str | None] = None     # --split-max-size as given (None: one GGUF per MoE layer)
    split_bytes: ClassVar[int | None] = None        # ... in bytes
    imatrix: ClassVar[str | None] = None            # --imatrix FILE as given (None: quantized without one)
    importance: ClassVar[Imatrix | None] = None     # ... as read (quant.imatrix)
    method_options = {"ggml_type": ggml_types, "split_max_size": (), "imatrix": ()}     # () : any size / file
    thresholds = {"moe_rel_l2": MOE_REL_L2["Q4_K"]}

    # ---------------------------------------------------------------- options

    @classmethod
    def with_options(cls, ggml_type: str | None = None, split_max_size: str | None = None,
                     imatrix: str | None = None) -> type["Llamafile"]:
        """This method writing `ggml_type` (llama.cpp's spelling, case-insensitive; None: Q4_K), verified with that
        type's limit, in shards of at most `split_max_size` (split_bytes_of). UsageError for a type it does not
        write or a size it cannot read."""
        if imatrix is not None:        # llama-quantize --imatrix: read (and refused, UsageError) here, before OUT
            return cls.with_options(ggml_type, split_max_size).with_imatrix(imatrix)
        if split_max_size is not None:
            size = split_bytes_of(split_max_size)
            method = cls.with_options(ggml_type)
            return type(f"{method.__name__}Split", (method,), {"split_max_size": str(split_max_size).strip(),
                                                                "split_bytes": size})
        if ggml_type is None:
            return cls
        name = ggml_type.upper() if isinstance(ggml_type, str) else repr(ggml_type)
        if name == cls.ggml_type:
            return cls
        if name not in cls.ggml_types:
            raise UsageError(f"--ggml-type {ggml_type} is not written by {cls.kt_method}",
                             expected=" or ".join(cls.ggml_types), found=str(ggml_type))
        return type(f"{cls.__name__}{name}", (cls,), {"ggml_type": name,
                                                      "thresholds": {"moe_rel_l2": MOE_REL_L2[MIXES.get(name, name)]}})

    @classmethod
    def with_imatrix(cls, imatrix) -> type["Llamafile"]:
        """This method quantizing with the importance matrix in file `imatrix` (``quant.imatrix.load``: UsageError
        for a file it cannot read), as llama-quantize --imatrix does."""
        return type(f"{cls.__name__}Imatrix", (cls,), {"imatrix": str(imatrix), "importance": load_imatrix(imatrix)})

    @classmethod
    def check_calibration(cls, imatrix: str | None) -> None:
        """``--calibration FILE`` (the importance matrix computed from it, ktconvert.gptq.imatrix): UsageError with
        --imatrix too, or for a type whose quantizer ignores an importance matrix (ggml's Q8_0, BF16, F16)."""
        if imatrix is not None:
            raise UsageError("--calibration and --imatrix both give the importance matrix: pass one",
                             found=f"--imatrix {imatrix}")
        if cls.base_type() not in ggml_quant.IMATRIX_TYPES:
            raise UsageError(f"--calibration has no effect on --ggml-type {cls.ggml_type}: ggml quantizes it without "
                             "an importance matrix", expected="--ggml-type " + " or ".join(ggml_quant.IMATRIX_TYPES))

    @classmethod
    def manifest_fields(cls) -> dict:
        return {"ggml_type": cls.ggml_type, **({"split_max_size": cls.split_max_size} if cls.split_bytes else {}),
                **({"imatrix_file": Path(cls.imatrix).name, "imatrix_sha256": cls.importance.sha256}
                   if cls.importance else {})}

    # ---------------------------------------------------------------- shapes and sizes

    @classmethod
    def base_type(cls) -> str:
        """The ggml type of most expert tensors: the type itself, or a mix's default type."""
        return MIXES.get(cls.ggml_type, cls.ggml_type)

    @classmethod
    def expert_type(cls, proj: str, layer: int, n_layer: int) -> str:
        """The ggml type of ``blk.{layer}.ffn_{proj}_exps`` in a model of `n_layer` blocks (MTP blocks included, as
        llama.cpp counts them): llama-quantize's choice for the mixes (llama-quant.cpp llama_tensor_get_type_impl,
        FFN_DOWN, non-Falcon, no imatrix; gate / up keep the default type), the type itself otherwise."""
        if proj != "down" or cls.ggml_type not in MIXES:
            return cls.base_type()
        more_bits = layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2
        if cls.ggml_type in ("Q4_K_M", "Q5_K_M") and more_bits:
            return "Q6_K"
        if cls.ggml_type == "Q4_K_S" and layer < n_layer // 8:
            return "Q5_K"
        return cls.base_type()

    @classmethod
    def block(cls) -> int:
        """Values per block of the type along a row (1 for BF16 / F16; 256 for every type of a mix)."""
        return ggml_quant.BLOCKS[cls.base_type()][0]

    @classmethod
    def tensor_specs(cls, n: int, k: int, ggml_type: str | None = None) -> TensorSpecs:
        """One tensor per [n, k] matrix: ``weight`` of the ggml type (default: base_type; a mix's down tensors of
        some layers have another, expert_type), n rows of k values (stored as blocks)."""
        return {"weight": (ggml_type or cls.base_type(), (n, k))}

    @classmethod
    def matrix_bytes(cls, n: int, k: int, ggml_type: str | None = None) -> dict[str, int]:
        """Bytes of one [n, k] matrix of `ggml_type` (default: base_type: for a mix the plan's figure for most
        tensors; the GGUF sink sizes every tensor with its expert_type)."""
        return {"weight": n * ggml_quant.row_bytes(ggml_type or cls.base_type(), k)}

    @classmethod
    def check_shape(cls, n: int, k: int, where: str = "") -> None:
        if n <= 0 or k <= 0 or k % cls.block():
            raise ShapeError(f"matrix shape incompatible with {cls.kt_method} {cls.ggml_type}", tensor=where or None,
                             expected=f"[n, k] with k % {cls.block()} == 0", found=f"[{n}, {k}]")

    @classmethod
    def alignment_checks(cls, hidden: int, inter: int, numa: int) -> list[dict]:
        """kt-kernel's LLAMAFILE rules: I % 256 == 0, H whole blocks of the type, 1 <= T <= I/256 (each NUMA part
        at least one 256-row block; T need not divide I). The first failing rule ends the list."""
        rules = [check("I % 256 == 0 (kt-kernel's LLAMAFILE)", inter % QK_K == 0, f"I = {inter}")]
        if cls.block() > 1:
            rules.append(check(f"H % {cls.block()} == 0 (whole {cls.ggml_type} blocks along gate/up rows)",
                               hidden % cls.block() == 0, f"H = {hidden}"))
        rules.append(check("NUMA count T >= 1", numa >= 1, f"T = {numa}"))
        rules.append(check("T <= I/256 (a 256-row block per NUMA part)", numa <= inter // QK_K,
                           f"T = {numa}, I/256 = {inter // QK_K}"))
        out = []
        for rule in rules:
            out.append(rule)
            if not rule["ok"]:
                break
        return out

    @classmethod
    def valid_numa(cls, hidden: int, inter: int) -> list[int]:
        if not all(c["ok"] for c in cls.alignment_checks(hidden, inter, 1)):
            return []
        return list(range(1, inter // QK_K + 1))

    # ---------------------------------------------------------------- encoding and writing

    @classmethod
    def encode(cls, w_bf16: np.ndarray, where: str = "", ggml_type: str | None = None,
               imatrix: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """uint16 [n, k] BF16 bits -> {"weight": uint8 [n, row bytes]} of `ggml_type` (default: base_type): BF16 as
        given, the other types through ggml_quant (llama.cpp's reference quantizer of the BF16 values)."""
        ggml_type = ggml_type or cls.base_type()
        w_bf16 = np.asarray(w_bf16)
        cls.check_shape(*w_bf16.shape, where=where)
        w = bf16_bits_to_f32(np.ascontiguousarray(w_bf16, dtype=np.uint16))
        if ggml_type == "BF16":
            if not np.isfinite(w).all():
                raise NumericError("NaN or Inf in weights", tensor=where or None)
            return {"weight": np.ascontiguousarray(w_bf16, dtype=np.uint16).view(np.uint8)}
        return {"weight": ggml_quant.quantize(w, ggml_type, where=where, imatrix=imatrix)}

    @classmethod
    def decode(cls, raw: np.ndarray, n: int, k: int, ggml_type: str | None = None) -> np.ndarray:
        """uint8 [n, row bytes] -> float32 [n, k] (gguf-py's dequantize)."""
        return ggml_quant.dequantize(np.asarray(raw).reshape(n, -1), ggml_type or cls.base_type(), k)

    @staticmethod
    def importance_entries(layers, info) -> dict[str, tuple[int, int]]:
        """{expert tensor name: (n_expert, n_per_row)}: the importance matrix entries `layers` need."""
        return {f"blk.{L}.{PROJ_TENSORS[p]}.weight": (info.n_experts, info.intermediate if p == "down" else
                                                      info.hidden) for L in layers for p in PROJ_TENSORS}

    @classmethod
    def open_sink(cls, out_dir, layers, info, numa: int, layout: str, include_dense: bool) -> GgufSink:
        """The GGUF shards; include_dense: also the non-expert tensors, metadata and tokenizer (their specs come
        with planned_files, or start_run's source)."""
        if cls.importance is not None:     # every expert tensor has its entry (the plan runs this before OUT)
            cls.importance.check(cls.importance_entries(layers, info))
        return GgufSink(out_dir, cls, layers, info, numa=numa, dense=bool(include_dense))

    @classmethod
    def write_matrix(cls, writer, proj: str, expert: int, w_bf16, *, numa: int, quant: str, where: str) -> None:
        """Encoded whole: kt-kernel slices the NUMA parts in memory; with --imatrix, quantized with the expert's
        slice of the importance matrix."""
        if cls.importance is None:
            writer.put_matrix(proj, expert, w_bf16)
            return
        name = writer.names[proj]
        qw = cls.importance.expert(name, expert, np.shape(w_bf16)[-1])
        writer.put_stored(proj, expert, cls.encode(w_bf16, where=f"{name}[{expert}]", imatrix=qw,
                                                   ggml_type=writer.sink.tensor_type(writer.layer, proj)))

    @classmethod
    def expert_reader(cls, out, manifest: dict, folder=None):
        """(layer, expert) -> {"gate", "up": float32 [I, H], "down": float32 [H, I]}: the expert as the output's
        GGUF tensors hold it (gguf-py's reader, ktconvert.quant.ggml's dequantization); every tensor read must hash
        as ``ktconvert.json`` records it (VerifyError naming file and tensor otherwise; checked once per tensor)."""
        return gguf_reader(out, manifest, lambda raw, t, name: ggml.dequantize(raw, int(t.tensor_type), name=name))

    @classmethod
    def check_structure(cls, folder, manifest: dict) -> tuple[list[str], str]:
        return gguf_output.check_structure(folder.root, manifest, cls)

    @classmethod
    def check_numerics(cls, out, manifest: dict, source, tokens: int, layers, experts, threshold,
                       folder=None) -> dict:
        def open_reader():
            return gguf_reader(out, manifest, lambda raw, t, name: gguf_output.dequantize(raw, t.tensor_type))

        return gguf_output.check_numerics(manifest, open_reader, source, tokens, layers, experts, threshold,
                                          method=cls)

    # ---------------------------------------------------------------- what kt-kernel needs

    @classmethod
    def runtime_notes(cls, cpu_flags: list[str]) -> list[str]:
        from ktconvert.launchcheck.runtime import GGUF_NOT_AVX2, GGUF_RUNS   # launchcheck imports the methods

        notes = []
        types = [cls.base_type()] + (["Q6_K"] if cls.ggml_type.endswith("_M") else []) + \
            (["Q5_K"] if cls.ggml_type == "Q4_K_S" else [])
        for name in types:
            if name in GGUF_NOT_AVX2 and "avx512f" not in set(cpu_flags):
                notes.append(GGUF_NOT_AVX2[name] + ", which this CPU (no AVX-512) loads: choose another "
                             "--ggml-type or run the output on a CPU with AVX-512")
            if name not in GGUF_RUNS:
                notes.append(f"GGUF type {name} was not measured with kt-kernel 0.7.2's LLAMAFILE (" +
                             ", ".join(GGUF_RUNS) + " were)")
        return notes

    @classmethod
    def inspect_line(cls, source) -> str:
        """"as is" for a GGUF kt-kernel reads; "no: needs ..." (the first of kt-kernel's rules the model's shape
        fails) where no NUMA count works; "convert: ..." otherwise."""
        info = source.info
        failed = [c for c in cls.alignment_checks(info.hidden, info.intermediate, 1) if not c["ok"]]
        if failed and not cls.reads_as_is(source):
            return f"no: needs {failed[0]['check']}, found {failed[0]['detail']}"
        return super().inspect_line(source)

    @classmethod
    def reads_as_is(cls, source) -> str | None:
        if source.input_format == "gguf" and source.info.intermediate % QK_K == 0:
            return "kt-kernel reads the GGUF"
        return None


def split_bytes_of(text) -> int:
    """A --split-max-size as convert_hf_to_gguf.py reads it: a whole number of bytes, or with K / M / G (10^3, 10^6,
    10^9 bytes; llama.cpp's gguf-split takes M and G alike). UsageError otherwise."""
    spelled = str(text).strip()
    units = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    number, unit = (spelled[:-1], units[spelled[-1].upper()]) if spelled[-1:].upper() in units else (spelled, 1)
    if not number.isdigit() or int(number) <= 0:
        raise UsageError("--split-max-size is not a size", expected="a positive whole number of bytes, or with K, "
                         "M or G (e.g. 500M, 2G)", found=spelled)
    return int(number) * unit


def gguf_reader(out, manifest: dict, decode):
    """(layer, expert) -> {proj: float32 matrix in HF orientation} of the GGUF files in `out`, each expert's blocks
    decoded by decode(raw uint8 blocks, gguf-py ReaderTensor, tensor name) -> float32; every tensor read must hash
    as ``ktconvert.json`` records it (VerifyError naming file and tensor otherwise; checked once per tensor)."""
    tensors = {t.name: (path, t) for path in sorted(Path(out).glob("*.gguf")) for t in GGUFReader(path).tensors}
    checked: set[str] = set()

    def read(layer: int, expert: int) -> dict:
        mats = {}
        for proj, stem in PROJ_TENSORS.items():
            name = f"blk.{layer}.{stem}.weight"
            if name not in tensors:
                raise VerifyError("expert tensor missing from the output", tensor=name)
            path, t = tensors[name]
            raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1)   # [E, row bytes * rows]
            if name not in checked:
                want = manifest.get("tensors", {}).get(name)
                if want is not None and hashlib.sha256(raw.tobytes()).hexdigest() != want:
                    raise VerifyError(f"{path.name}: {name}: sha256 differs from ktconvert.json", tensor=name)
                checked.add(name)
            cols, rows = int(t.shape[0]), int(t.shape[1])
            mats[proj] = np.asarray(decode(raw[expert], t, name), dtype=np.float32).reshape(rows, cols)
        return mats

    return read

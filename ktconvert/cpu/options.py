"""CpuOptions: what a CPU (kt-kernel) output is, one frozen set of options. Its fields' metadata
(``run.options.option``) is what the command line's options, the ``--targets`` TOML fields and the batch job schema
are generated from. Light: the registries its checks ask (methods, quantizers, GPTQ's defaults) are imported when
options are made.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ktconvert.errors import UsageError
from ktconvert.gptq.holdout import SelectionOptions
from ktconvert.run.options import SAMPLING_DEFAULTS, Options, option

GPTQ_MIN_TOKENS = SelectionOptions.min_tokens


def gptq_dampening() -> float:
    """GPTQ's relative Hessian dampening by default (gptq.loop.GptqOptions.dampening)."""
    from ktconvert.gptq.loop import GptqOptions

    return GptqOptions.dampening


@dataclass(frozen=True)
class CpuOptions(Options):
    """What a CPU output is: method (a registered CPU method: amxint4, amxint8, bf16, fp8, llamafile, rawint4, ...),
    numa (T, = SGLang's --kt-threadpool-count), layout ("safetensors" merged shards, the "kt" tree, "gguf"; None:
    the method's first layout, set by check), ggml_type (llamafile's GGUF type; None: its default), quant (the per-row
    quantizer: "rtn", "mse", or "gptq" with calibration, a JSON-lines file; with llamafile, calibration gives its
    importance matrix), group_size (a grouped method's; None =
    the method's default, e.g. rawint4's 32, the only size kt-kernel 0.7.2 runs), include_dense (also the
    non-expert tensors), include_mtp (also the MTP layers' experts), allow_drop_bias (convert although non-zero
    expert biases are dropped); with gptq: dampening (GPTQ's relative Hessian dampening) and min_tokens (routed
    calibration tokens an expert needs before GPTQ is tried; ktconvert.gptq.holdout)."""

    method: str = option(help="kt-kernel method (`ktconvert methods`)", choices="method",
                         command_help="kt-kernel method of the CPU output (`ktconvert methods` describes them)")
    numa: int = option(1, help="NUMA parts T = SGLang's --kt-threadpool-count", minimum=1,
                       command_help="NUMA parts T; must equal SGLang's --kt-threadpool-count at run time")
    layout: str | None = option(None, help="safetensors: one merged shard per MoE layer; kt: the .kt tree; gguf: "
                                           "llamafile's GGUF per layer (default: the method's first)",
                                choices=("safetensors", "kt", "gguf"),
                                command_help="safetensors: one merged shard per MoE layer; kt: the _layer_L/_numa_t/"
                                             "*.kt tree; gguf: one GGUF per MoE layer (llamafile). Default: the "
                                             "method's first layout (`ktconvert methods`)")
    quant: str = option("rtn", help="rtn (byte-identical to kt-kernel's converter) or mse; GPTQ writes one output "
                                    "at a time: use `cpu`", choices="cpu-quant",
                        command_help="rtn: byte-identical to kt-kernel's converter; mse: each row's scale searched for "
                                     "the least error (same files, kt-kernel runs them unchanged); gptq: calibrated, "
                                     "needs --calibration")
    group_size: int | None = option(None, help="group size of a grouped method (`ktconvert methods`)", minimum=1,
                                    command_help="Group size of a grouped method (`ktconvert methods` lists each "
                                                 "method's: those kt-kernel 0.7.2 runs)")
    ggml_type: str | None = option(None, help="GGUF type of --method llamafile's experts (default Q4_K)",
                                   choices="ggml-type",
                                   command_help="GGUF type of --method llamafile's experts: a ggml type or a "
                                                "llama-quantize mix (default Q4_K)")
    split_max_size: str | None = option(None, help="--method llamafile: GGUF shards of at most this size (2G)",
                                        metavar="SIZE",
                                        command_help="--method llamafile: GGUF shards of at most this size, as "
                                                     "llama.cpp's gguf-split (e.g. 500M, 2G; default one per layer)")
    imatrix: str | None = option(None, help="--method llamafile: llama.cpp importance matrix (GGUF or .dat)",
                                 metavar="FILE",
                                 command_help="--method llamafile: quantize with this llama.cpp importance matrix "
                                              "(llama-imatrix's GGUF or legacy .dat), as llama-quantize --imatrix")
    include_dense: bool = option(False, help="Also write the non-expert tensors (blk.-renamed)",
                                 command_help="Also write non-expert tensors (blk.-renamed) into OUT; --method "
                                              "llamafile: with metadata and tokenizer, a GGUF llama.cpp loads")
    include_mtp: bool = option(False, help="Also the MTP (next-n) layers' experts",
                               command_help="Also convert MTP (next-n) layers' experts")
    allow_drop_bias: bool = option(False, help="Convert even though non-zero expert biases are dropped")
    calibration: str | None = option(None, target=False)
    dampening: float = option(target=False, default_factory=gptq_dampening)
    min_tokens: int = option(GPTQ_MIN_TOKENS, target=False)
    max_length: int = option(SAMPLING_DEFAULTS["max_length"], target=False)
    num_samples: int | None = option(SAMPLING_DEFAULTS["num_samples"], target=False)

    kind, lowercase = "CPU", ("method", "layout", "quant")

    def check(self) -> None:
        """UsageError for a method, group size, layout or quantizer that cannot work together."""
        method = self.method_class()
        if self.group_size is not None and not method.group_sizes:
            raise UsageError(f"--group-size does not apply to --method {method.name}: it has no groups",
                             found=f"--group-size {self.group_size}",
                             hint="leave --group-size out (`ktconvert methods` lists each method's group sizes)")
        row_quant = _registries()[1]
        if self.quant in row_quant.names() + ["gptq"] and self.quant not in method.quants:
            raise UsageError(f"--quant {self.quant} does not apply to --method {method.name}",
                             expected=" or ".join(method.quants), found=self.quant,
                             hint=f"{method.kt_method} is written without a quantizer choice" if method.quants ==
                             ("rtn",) else None)
        self._check_quant(row_quant)

    def method_class(self):
        """The registered method (methods.CpuMethod) with this group size and its own options (ggml_type: UsageError
        with a method that has no such option); UsageError for a layout it does not have. A layout left out becomes
        the method's first, a method option its canonical spelling (left out: the method's default)."""
        method = _registries()[0].get(self.method).configured(self.group_size, ggml_type=self.ggml_type,
                                                                    split_max_size=self.split_max_size,
                                                                    imatrix=self.imatrix)
        if self.layout is None:
            object.__setattr__(self, "layout", method.layouts[0])     # frozen: resolved once, before any use
        for name in method.method_options:      # as the method spells it, its default where not given
            object.__setattr__(self, name, getattr(method, name))
        if self.layout not in method.layouts:
            raise UsageError(f"--layout {self.layout} does not exist for {method.kt_method}",
                             expected=" or ".join(method.layouts))
        if self.include_dense and self.layout != "gguf" and \
                (not method.needs_conversion or self.layout != "safetensors"):
            raise UsageError("--include-dense needs the merged safetensors layout of a converted method",
                             found=f"--method {method.name} --layout {self.layout}")
        return method

    def _check_quant(self, row_quant) -> None:
        if self.quant != "gptq" and self.quant not in row_quant:
            raise UsageError("unknown --quant", expected=" or ".join(row_quant.names() + ["gptq"]),
                             found=self.quant)
        if self.quant == "gptq" and self.calibration is None:
            raise UsageError("--quant gptq needs calibration data", expected="--calibration FILE (JSON lines)")
        if self.quant != "gptq" and self.calibration is not None:   # llamafile: an importance matrix from it
            check = getattr(self.method_class(), "check_calibration", None)
            if check is None:
                raise UsageError("--calibration is only used with --quant gptq or --method llamafile",
                                 found=f"--quant {self.quant}")
            check(self.imatrix)
        if self.quant == "gptq" and self.include_dense:
            raise UsageError("not available with --quant gptq", found="--include-dense")
        if not (0 <= self.dampening < float("inf")) or self.min_tokens < 0:
            raise UsageError("GPTQ options out of range", expected="dampening >= 0, min_tokens >= 0",
                             found=f"dampening {self.dampening}, min_tokens {self.min_tokens}")
        self.check_sampling()
        if self.quant != "gptq" and (self.dampening, self.min_tokens) != (gptq_dampening(), GPTQ_MIN_TOKENS):
            raise UsageError("--dampening and --min-tokens are only used with --quant gptq",
                             found=f"--quant {self.quant}")

    def journalled(self) -> dict:
        """As Options.journalled, without ggml_type where the method has none (the journals of other methods' runs
        stay as they were); --imatrix as its file's sha256, so a resume with other contents at the same path is
        refused like any other option change."""
        data = super().journalled()
        for name in ("ggml_type", "split_max_size", "imatrix"):
            if data.get(name) is None:
                data.pop(name, None)
        if "imatrix" in data:         # the sha256 taken when the method read the file (quant.imatrix: once a version)
            data["imatrix"] = "sha256:" + self.method_class().importance.sha256
        if data.get("calibration") is not None and self.quant != "gptq":   # llamafile's computed importance matrix
            with open(self.calibration, "rb") as fh:
                data["calibration"] = "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()
        return data


def _registries():
    """(METHODS, ROW_QUANT): the registries the checks ask (the words of the command line, ``vocabulary``)."""
    from ktconvert.vocabulary import METHODS, ROW_QUANT

    return METHODS, ROW_QUANT

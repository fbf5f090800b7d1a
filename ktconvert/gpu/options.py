"""GpuOptions: what the SGLang-KT GPU checkpoint is, one frozen set of options. Its fields' metadata
(``run.options.option``) is what the command line's options and the ``--targets`` TOML fields are generated from.
Light: the scheme, group size and linears tables its checks read are imported when options are made.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ktconvert.errors import UsageError
from ktconvert.run.options import SAMPLING_DEFAULTS, Options, option

QUANTS = ("rtn", "gptq")


@dataclass(frozen=True)
class GpuOptions(Options):
    """What the GPU checkpoint is: experts (compressed-tensors scheme of the routed experts: w4a16 | w8a16),
    group_size (32 | 64 | 128, SGLang's Marlin MoE kernels), quant ("rtn": bytes equal llmcompressor's
    model_free_ptq; "gptq": calibrated, needs calibration), linears ("fp8": 128x128 block FP8 + linear_fp8_config,
    "bf16", "keep"), include_mtp (also the MTP layers), calibration (JSON lines of texts or token ids), ignore
    (llm-compressor's ignore entries, appended to config.json's ``ignore``: ``re:`` + a regex matched from the
    start of the module name, else the exact name; gpu.plan refuses one that would leave a routed expert or an
    FP8 linear unquantized)."""

    experts: str = option("w4a16", help="compressed-tensors scheme of the routed experts", choices="experts",
                          command_help="compressed-tensors scheme of the GPU checkpoint's routed experts")
    group_size: int = option(128, help="the experts' group size: 32, 64 or 128", minimum=1,
                             command_help="GPU expert quantization group size: 32, 64 or 128")
    quant: str = option("rtn", help="rtn (bytes equal model_free_ptq); GPTQ writes one output at a time: use `gpu`",
                        choices="gpu-quant", command_help="rtn: bytes equal llmcompressor's model_free_ptq; gptq: "
                                                          "calibrated, needs --calibration")
    linears: str = option("fp8", help="the attention / dense / shared-expert linears: fp8 = 128x128 block FP8 + "
                                      "linear_fp8_config, bf16 = BF16 (for transformers / vLLM), keep = as stored",
                          choices=("fp8", "bf16", "keep"))
    include_mtp: bool = option(False, help="Also the MTP (next-n) layers' experts",
                               command_help="Also convert MTP (next-n) layers (else they are left out)")
    calibration: str | None = option(None, target=False)
    max_length: int = option(SAMPLING_DEFAULTS["max_length"], target=False)
    num_samples: int | None = option(SAMPLING_DEFAULTS["num_samples"], target=False)
    ignore: tuple[str, ...] = option((), target=False)

    kind, lowercase = "GPU", ("experts", "quant", "linears")

    def __post_init__(self):
        ignore = (self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore or ())
        object.__setattr__(self, "ignore", ignore)

    @property
    def bits(self) -> int:
        return _tables()[0].bits_of(self.experts)

    def check(self) -> None:
        """UsageError for an expert scheme, group size, linears mode or quant that does not exist."""
        experts, linears = _tables()
        self.bits  # noqa: B018  (validates the scheme name)
        for name, value, allowed in (("--group-size", self.group_size, experts.GROUP_SIZES),
                                     ("--linears", self.linears, linears.LINEAR_MODES),
                                     ("--quant", self.quant, QUANTS)):
            if value not in allowed:
                raise UsageError(f"unsupported {name} for the GPU checkpoint", expected=" or ".join(map(str, allowed)),
                                 found=str(value))
        if self.quant == "gptq" and self.calibration is None:
            raise UsageError("--quant gptq needs calibration data", expected="--calibration FILE (JSON lines)")
        if self.quant != "gptq" and self.calibration is not None:
            raise UsageError("--calibration is only used with --quant gptq", found=f"--quant {self.quant}")
        self.check_sampling()
        for pattern in self.ignore:
            check_ignore_pattern(pattern)

    def journalled(self) -> dict:
        """As Options.journalled, ignore only when given (the journals of runs without it stay as they were)."""
        data = super().journalled()
        if data.pop("ignore", ()):
            data["ignore"] = list(self.ignore)
        return data


def check_ignore_pattern(pattern) -> None:
    """UsageError for an --ignore entry that is not a module name or ``re:`` + a regular expression."""
    if not isinstance(pattern, str) or not pattern.strip() or pattern == "re:":
        raise UsageError("--ignore needs a module name or re:REGEX", found=repr(pattern))
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise UsageError(f"--ignore pattern is not a regular expression ({exc})", found=pattern,
                             expected="re: followed by a Python regular expression") from None


def _tables():
    """(gpu.experts, gpu.linears): the expert schemes, group sizes and linears modes (they bring numpy)."""
    from ktconvert.gpu import experts, linears

    return experts, linears

"""One exception hierarchy. Library code raises these with structured fields; only cli.py prints and exits.

Every message names where (file, tensor), what was expected and what was found, on one line, e.g.::

    model-00002-of-00003.safetensors: model.layers.1.mlp.experts.7.down_proj.weight: expected shape [256, 128], found [256, 64]
"""
from __future__ import annotations

import re

# Documented exit codes (README "Exit codes").
EXIT_OK = 0
EXIT_ERROR = 1          # any other KtConvertError
EXIT_USAGE = 2          # bad command line (click's own)
EXIT_INPUT = 3          # unreadable / malformed / unsupported input
EXIT_VERIFY = 4         # verification found a difference or an error above threshold
EXIT_REMOTE = 5         # hub / network failure
EXIT_INTERRUPTED = 130  # SIGINT

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class KtConvertError(Exception):
    """Base class. Fields: file, tensor, expected, found, hint (all optional strings)."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str = "", *, file=None, tensor=None, expected=None, found=None, hint=None):
        self.file = None if file is None else str(file)
        self.tensor = tensor
        self.expected = expected
        self.found = found
        self.hint = hint
        self.detail = message
        super().__init__(self._format())

    def within(self, where: str) -> "KtConvertError":
        """This error with `where` (e.g. which of several outputs) put before its message; returns it."""
        self.detail = f"{where}: {self.detail}" if self.detail else where
        self.args = (self._format(),)
        return self

    def add_hint(self, text: str) -> None:
        """Append `text` to the hint (what to do next, known only where the error is caught) and re-format."""
        self.hint = f"{self.hint}; {text}" if self.hint else text
        self.args = (self._format(),)

    def _format(self) -> str:
        parts = [p for p in (self.file, self.tensor) if p]
        text = self.detail
        if self.expected is not None:
            text += ("; " if text else "") + f"expected {self.expected}"
        if self.found is not None:
            text += (", " if text else "") + f"found {self.found}"
        if self.hint:
            text += f" (hint: {self.hint})"
        message = ": ".join(parts + [text]) if text else ": ".join(parts)
        return _CONTROL.sub(lambda m: repr(m.group())[1:-1], message)   # one line, whatever names a file held


class InputError(KtConvertError):
    """Missing shard, index/shard mismatch, bad header, unsupported dtype or quantization."""

    exit_code = EXIT_INPUT


class ManifestError(InputError):
    """Unknown model_type, config key missing (lists the keys tried), bad manifest file."""


class ShapeError(InputError, ValueError):
    """A tensor or dimension incompatible with the method, layout or NUMA count."""


class UsageError(KtConvertError, ValueError):
    """An option value that cannot work (the message lists the values that do): exit code 2, like click's own."""

    exit_code = EXIT_USAGE


class ResumeMismatchError(UsageError):
    """``--resume`` with options (or a source, or a kind of output) other than those OUT was written with: the
    message names each differing option with OUT's value and the requested one. Exit code 2."""


class UnknownNameError(UsageError, LookupError):
    """Registry miss; the message lists the known names."""


class NumericError(InputError):
    """NaN/Inf in a weight (names layer, expert and projection)."""


class NativeError(KtConvertError):
    """Non-zero status from the native library."""


class OutputError(KtConvertError):
    """Output exists, is unwritable, disk full, or an interrupted/incoherent output directory."""


class VerifyError(KtConvertError):
    """Verification failed: hash mismatch, missing or extra file, structural or numeric check."""

    exit_code = EXIT_VERIFY


class RemoteError(KtConvertError):
    """Hub API / transfer failure."""

    exit_code = EXIT_REMOTE


class MissingExtraError(KtConvertError):
    """A feature needs an optional dependency group (extra) that is not installed (ktconvert.util.extras.require)."""

    exit_code = EXIT_USAGE

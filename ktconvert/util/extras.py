"""Optional dependency groups ("extras") and the one-line error when one is missing.

The base install (``pip install ktconvert``) converts for the CPU (every method and input format with RTN or mse),
verifies CPU outputs, bundles and publishes, without torch. ``[gpu]`` adds what the GPU checkpoint, GPTQ and the
reference checks import. A command that needs an extra calls ``require(extra, feature)`` before it writes anything:
the user gets one line naming the extra and the missing modules (exit code 2) instead of a ModuleNotFoundError
half-way through a conversion.
"""
from __future__ import annotations

import importlib.util

from ktconvert.errors import MissingExtraError

# extra -> the top-level modules it provides (what `pip install 'ktconvert[extra]'` brings; pyproject.toml).
EXTRAS: dict[str, tuple[str, ...]] = {
    "gpu": ("torch", "compressed_tensors", "llmcompressor", "transformers"),
    "ray": ("ray",),
}


def _importable(module: str) -> bool:
    """True when `module` can be found, without importing it (torch alone takes seconds to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here, in EXTRAS order ([] when the extra is installed)."""
    return [module for module in EXTRAS[extra] if not _importable(module)]


def require(extra: str, feature: str) -> None:
    """Raise MissingExtraError (exit 2) naming the missing modules when `extra` is not fully installed.

    feature: what the user asked for, as they wrote it ("ktconvert gpu", "--quant gptq"); starts the message::

        ktconvert gpu needs the [gpu] extra: pip install 'ktconvert[gpu]' (missing module: torch)
    """
    missing = missing_modules(extra)
    if missing:
        noun = "module" if len(missing) == 1 else "modules"
        raise MissingExtraError(f"{feature} needs the [{extra}] extra: pip install 'ktconvert[{extra}]' "
                                f"(missing {noun}: {', '.join(missing)})")

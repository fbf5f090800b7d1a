"""``ktconvert check``: the launch flags that make kt-kernel return garbage, crash or refuse, for any weights folder.

``run.check(weights, command, model=, flags_from=, cpu_flags=, deep=)`` -> ``run.CheckResult``. The modules:
``command`` (the SGLang launch command), ``readers`` (header-only reads, counted), ``identify`` with
``identify_kt`` / ``identify_hf`` / ``identify_gguf`` (what the files hold and how that was inferred), ``model``
(the model's dimensions), ``hostcpu`` / ``runtime`` (the kt-kernel build of a CPU and what it runs), ``rules`` and
``findings`` (the mismatches), ``deep`` (a sampled decode and the hashes).
"""
from ktconvert.launchcheck.run import CheckResult, check

__all__ = ["CheckResult", "check"]

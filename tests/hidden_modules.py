"""Run the ktconvert CLI in a subprocess in which some installed modules cannot be imported, as if they were not
installed: a finder first on ``sys.meta_path`` refuses them (``import torch`` raises ModuleNotFoundError and
``importlib.util.find_spec("torch")`` fails the same way)."""
from __future__ import annotations

import os
import subprocess
import sys

# What the base install must work without: the [gpu] extra's modules and the test-only ones.
NOT_IN_BASE = ("torch", "compressed_tensors", "llmcompressor", "transformers", "safetensors", "tokenizers")

HIDE_AND_RUN = """
import sys

class HiddenModules:
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HiddenModules(sys.argv[1].split(",")))
sys.argv = ["ktconvert"] + sys.argv[2:]
from ktconvert.cli.main import main
main()
"""


def run_cli_without(hidden, args, python=sys.executable, cwd=None, env=None) -> subprocess.CompletedProcess:
    """`ktconvert ARGS` run by `python` with the modules `hidden` made unimportable; output captured as text."""
    env = dict(os.environ if env is None else env)
    env.pop("KTCONVERT_DEBUG", None)
    return subprocess.run([python, "-c", HIDE_AND_RUN, ",".join(hidden), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)

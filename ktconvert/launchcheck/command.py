"""The SGLang-KT launch command ``ktconvert check`` reads: the whole ``python -m sglang.launch_server ...`` line, or
just its ``--kt-*`` flags, with ``VAR=value`` words before it (or ``export VAR=value``) for the environment.

``parse_command(words)`` -> Launch: the options as SGLang's argparse would see them (``--flag value``,
``--flag=value``, several values for ``--kt-numa-nodes``, the last of a repeated option wins), the old spellings
``--kt-amx-method`` / ``--kt-amx-weight-path`` read as ``--kt-method`` / ``--kt-weight-path`` (and noted), the
environment words, and the words before the first option (the program). ``Launch.fixed(values, env)`` is the same
command with some values replaced (or added) and environment words set, as one shell line (``--fix``).

Pure standard library: the command line imports nothing heavy for it.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ktconvert.errors import UsageError
from ktconvert.util.safe_read import check_regular

ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# canonical option name -> the spellings SGLang (old and new releases) accepts for it
SPELLINGS = {
    "kt-method": ("--kt-method", "--kt-amx-method"),
    "kt-weight-path": ("--kt-weight-path", "--kt-amx-weight-path"),
    "kt-threadpool-count": ("--kt-threadpool-count",),
    "kt-numa-nodes": ("--kt-numa-nodes",),
    "kt-num-gpu-experts": ("--kt-num-gpu-experts",),
    "kt-gpu-prefill-token-threshold": ("--kt-gpu-prefill-token-threshold",),
    "kt-cpuinfer": ("--kt-cpuinfer",),
    "model-path": ("--model-path", "--model"),
    "tensor-parallel-size": ("--tensor-parallel-size", "--tp-size", "--tp"),
}
OLD_SPELLINGS = {"--kt-amx-method": "--kt-method", "--kt-amx-weight-path": "--kt-weight-path"}
_CANONICAL = {spelling: name for name, spellings in SPELLINGS.items() for spelling in spellings}
# environment variables kt-kernel 0.7.2 reads (and AMX_METHOD, an old way to name the method)
KT_ENV = ("KT_MXFP4_BACKEND", "KT_MXFP8_BACKEND", "KT_GPTQ_INT4_BACKEND", "KT_RAWINT4_BACKEND",
          "KT_KERNEL_CPU_VARIANT", "AMX_METHOD")
MAX_FLAGS_FILE = 1 << 20


@dataclass
class Option:
    """One option as given: position of its word, the spelling used, its values, whether written ``--x=v``."""

    index: int
    spelling: str
    values: list[str]
    inline: bool = False

    @property
    def value(self) -> str | None:
        return self.values[-1] if self.values else None


@dataclass
class Launch:
    """The parsed command. options: canonical name -> the last occurrence; others: the other options by spelling;
    env: the VAR=value words; program: the words before the first option (``python -m sglang.launch_server``);
    notes: what the parsing noticed (old spellings, repeated options)."""

    words: list[str]
    options: dict[str, Option] = field(default_factory=dict)
    others: dict[str, Option] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    env_index: dict[str, int] = field(default_factory=dict)
    program: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def value(self, name: str) -> str | None:
        option = self.options.get(name)
        return None if option is None else option.value

    def values(self, name: str) -> list[str] | None:
        option = self.options.get(name)
        return None if option is None else list(option.values)

    def spelling(self, name: str) -> str:
        """How the command writes option `name` (its canonical spelling when it does not give it)."""
        option = self.options.get(name)
        return option.spelling if option is not None else "--" + name

    def int_value(self, name: str) -> tuple[int | None, str | None]:
        """(the option's value as an int, None) or (None, the value that is not one) or (None, None) if absent."""
        text = self.value(name)
        if text is None:
            return None, None
        try:
            return int(text), None
        except ValueError:
            return None, text

    def is_full_command(self) -> bool:
        """Whether the words are a whole launch command (a program or --model-path), not only --kt-* flags."""
        return bool(self.program) or "model-path" in self.options

    def to_dict(self) -> dict:
        return {"options": {name: (o.values if name == "kt-numa-nodes" else o.value)
                            for name, o in sorted(self.options.items())},
                "spellings": {name: o.spelling for name, o in sorted(self.options.items())},
                "env": dict(sorted(self.env.items())), "program": " ".join(self.program), "notes": list(self.notes)}

    def fixed(self, values: dict[str, list[str]], env: dict[str, str]) -> str:
        """This command with option `name`'s values replaced by values[name] (added at the end when absent) and
        env[VAR] set (a word before the program when absent), as one shell-quoted line."""
        words = list(self.words)
        edits: dict[int, list[str]] = {}
        drop: set[int] = set()
        tail: list[str] = []
        for name, new in values.items():
            option = self.options.get(name)
            if option is None or option.spelling not in _CANONICAL:     # absent, or named by AMX_METHOD only
                tail += [f"--{name}", *new]
            elif option.inline:
                edits[option.index] = [f"{option.spelling}={new[0]}", *new[1:]]
            else:
                edits[option.index] = [option.spelling, *new]
                drop.update(range(option.index + 1, option.index + 1 + len(option.values)))
        head = []
        for var, value in env.items():
            if var in self.env_index:
                edits[self.env_index[var]] = [f"{var}={value}"]
            else:
                head.append(f"{var}={value}")
        out = list(head)
        for i, word in enumerate(words):
            if i in drop:
                continue
            out += edits.get(i, [word])
        return shlex.join(out + tail)


def split_words(words) -> list[str]:
    """The command's words: a single word holding spaces (the command given as one quoted string) is split as a
    shell would."""
    words = [str(w) for w in words]
    if len(words) == 1 and any(c.isspace() for c in words[0]):
        return split_text(words[0])
    return words


def split_text(text: str) -> list[str]:
    """Shell words of a command text (a launch script): backslash-newline joins lines, # starts a comment, ``;``
    and ``&&`` separate commands (their words are kept: ``export VAR=value; python ...``)."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:
        raise UsageError(f"the launch command cannot be split into words ({exc})") from None
    out = []
    for word in words:
        out += [w for w in re.split(r"(?:;|&&)", word) if w] if word not in (";", "&&") else []
    return out


def read_flags_file(path) -> list[str]:
    """The words of --flags-from FILE (a launch script or a file of flags)."""
    size = check_regular(path, "--flags-from file").st_size
    if size > MAX_FLAGS_FILE:
        raise UsageError("--flags-from file is too large for a launch command", expected=f"<= {MAX_FLAGS_FILE} bytes",
                         found=f"{size} bytes")
    return split_text(Path(path).read_text(errors="replace"))


def parse_command(words) -> Launch:
    """Parse the launch command words (see the module doc)."""
    words = split_words(words)
    launch = Launch(words=words)
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("export", "env") and i + 1 < len(words) and ENV_WORD.match(words[i + 1]):
            i += 1
            continue
        if ENV_WORD.match(word) and not word.startswith("-"):
            var, _, value = word.partition("=")
            launch.env[var], launch.env_index[var] = value, i
            i += 1
            continue
        if not word.startswith("--") or word == "--":
            if not launch.options and not launch.others:
                launch.program.append(word)
            i += 1
            continue
        spelling, eq, inline = word.partition("=")
        values = [inline] if eq else []
        j = i + 1
        while not eq and j < len(words) and not words[j].startswith("--") and not _is_env(words, j):
            values.append(words[j])
            j += 1
        _add(launch, Option(i, spelling, values if spelling == "--kt-numa-nodes" or eq else values[:1], bool(eq)))
        i = j if spelling == "--kt-numa-nodes" or eq else i + 1 + min(1, len(values))
    if "kt-method" not in launch.options and "AMX_METHOD" in launch.env:
        launch.notes.append("no --kt-method: the method is taken from AMX_METHOD (an old way to name it; current "
                            "SGLang-KT reads --kt-method)")
        launch.options["kt-method"] = Option(launch.env_index["AMX_METHOD"], "AMX_METHOD",
                                             [launch.env["AMX_METHOD"]])
    return launch


def _is_env(words: list[str], j: int) -> bool:
    """Whether words[j] is an environment word of a following command (``... ; KT_X=1 python ...``) rather than
    an option value: a VAR=value word whose VAR kt-kernel reads."""
    return bool(ENV_WORD.match(words[j])) and words[j].partition("=")[0] in KT_ENV


def _add(launch: Launch, option: Option) -> None:
    name = _CANONICAL.get(option.spelling)
    if name is None:
        launch.others[option.spelling] = option
        return
    if option.spelling in OLD_SPELLINGS:
        launch.notes.append(f"{option.spelling} is the old spelling of {OLD_SPELLINGS[option.spelling]}: read as "
                            "that (current SGLang-KT rejects it as an unrecognized argument)")
    if name in launch.options:
        launch.notes.append(f"--{name} is given more than once: the last value ({option.value}) counts, as "
                            "argparse does")
    launch.options[name] = option

"""Typed TOML files (a `batch` job file, a `convert --targets` file): reading them safely and checking each table's
keys against a schema of ``Field``s, so that an unknown key or a value of the wrong type is a one-line error naming
the table and the key, never a traceback or a silently ignored setting."""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.util.safe_read import open_regular

MAX_TOML_BYTES = 16 << 20


@dataclass(frozen=True)
class Field:
    """One key of a table: its TOML type (str, int or bool: a bool is never an int), and for ints the least
    value, for strings the allowed values (empty: any)."""

    kind: type
    minimum: int | None = None
    choices: tuple[str, ...] = ()

    def problem(self, value) -> str | None:
        """Why `value` does not fit, or None."""
        if type(value) is not self.kind:
            return f"must be {_KIND[self.kind]}, found {_KIND.get(type(value), type(value).__name__)} {value!r}"[:200]
        if self.minimum is not None and value < self.minimum:
            return f"must be an integer >= {self.minimum}, found {value!r}"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}, found {value!r}"
        return None


_KIND = {str: "a string", int: "an integer", bool: "a boolean (true / false)", float: "a float", list: "an array",
         dict: "a table"}


def read_toml(path: Path, what: str, error: type = InputError) -> dict:
    """The TOML of `path` (a regular UTF-8 file of at most MAX_TOML_BYTES); `error` (naming `what`) otherwise."""
    fd = open_regular(path, what, error)
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_TOML_BYTES + 1)
        if len(raw) > MAX_TOML_BYTES:
            raise error(f"{what} is larger than {MAX_TOML_BYTES} bytes", file=str(path))
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})", file=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} is not valid TOML ({exc})", file=str(path)) from None
    except RecursionError:
        raise error(f"{what} is nested too deeply", file=str(path)) from None


def check_table(table: dict, fields: dict[str, Field], other: set, path, where: str, error: type = InputError) -> None:
    """Unknown keys (neither in `fields` nor in `other`) and values of the wrong type are `error`s naming `where`
    and the key (`path`: the file, None for a table that came from Python)."""
    allowed = set(fields) | other
    unknown = sorted(set(table) - allowed, key=str)
    file = None if path is None else str(path)
    if unknown:
        raise error(f"{where}: unknown key {unknown[0]!r}", file=file, expected=", ".join(sorted(allowed)))
    for key, spec in fields.items():
        if key in table and (problem := spec.problem(table[key])):
            raise error(f"{where}: {key!r} {problem}", file=file)

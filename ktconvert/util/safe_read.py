"""Reading files that someone else wrote: regular files only, JSON bounded in size and depth, plain relative names.

* `check_regular(path, what)` / `open_regular(path, what)`: a FIFO, socket or device named like one of our inputs is
  refused before it is opened (opening a FIFO for reading blocks until some writer appears; a device can be
  endless). Symlinks are followed: HF's cache links every snapshot file to a blob.
* `parse_json(data, what=...)` / `read_json(path, what=...)`: JSON no larger than `max_bytes` and nested no deeper
  than `max_depth` (Python's parser recurses, so a header nested 200 000 levels deep would be a RecursionError).
  The depth is measured before parsing; every failure is one error of class `error` (InputError by default).
* `unsafe_name(name)`: why a relative path written by someone else (an index entry, a hub file, a bundle member) could
  leave the folder it is meant for, or None when it is a plain relative name.

Pure stdlib; imports nothing heavy, so every reader (and the CLI's helpers) can use it.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from ktconvert.errors import InputError

MAX_DEPTH = 64                  # real configs, headers and manifests nest 2-6 levels
MAX_JSON_BYTES = 64 << 20       # config.json / index / hub answers; manifests pass their own limit
# ktconvert.json / resume journal / a bundle's manifest, checked before a byte is read: a digest per tensor is ~16 MB
# per NUMA node for Kimi-K2 (~127 MB at NUMA 8; "blake3:" digests add ~10%: ~140 MB); parsing holds ~5x the file
# (140 MB: 0.7 GB), so 256 MiB at most
MAX_MANIFEST_BYTES = 256 << 20
MAX_NAME_BYTES = 255            # one path component (Linux NAME_MAX)
MAX_PATH_BYTES = 4096           # a whole relative path (Linux PATH_MAX)

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
# a JSON string (with escapes); removed before counting brackets so that "[[[" inside a string does not count
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path, what: str = "file", error: type = InputError) -> os.stat_result:
    """stat() of `path` (symlinks followed); `error` if it is missing or anything but a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} not found", file=str(path)) from None
    except OSError as exc:
        raise error(f"cannot stat {what} ({exc.strerror})", file=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} is not a regular file ({_kind(st.st_mode)})", file=str(path),
                    hint="ktconvert reads only regular files (symlinks to them are fine)")
    return st


def open_regular(path, what: str = "file", error: type = InputError) -> int:
    """A read-only descriptor of regular file `path`. Checked before opening and again on the open descriptor
    (O_NONBLOCK: should the path have become a FIFO in between, open() returns instead of waiting for a writer)."""
    check_regular(path, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"cannot open {what} ({exc.strerror})", file=str(path)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{what} is not a regular file ({_kind(mode)})", file=str(path))
    os.set_blocking(fd, True)
    return fd


def json_depth(data: bytes, limit: int) -> int:
    """Nesting depth of JSON text `data` ([] and {} count one level each), counting at most to limit + 1.

    Strings are removed first; then each pass deletes the innermost bracket pairs, so the number of passes is the
    depth. Unbalanced text stops early; json.loads reports it."""
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    brackets = brackets.replace(b"{", b"[").replace(b"}", b"]")
    depth = 0
    while brackets and depth <= limit:
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets, depth = shorter, depth + 1
    return depth


def parse_json(data: bytes | str, *, what: str, file=None, max_bytes: int = MAX_JSON_BYTES,
               max_depth: int = MAX_DEPTH, error: type = InputError, object_pairs_hook=None) -> Any:
    """json.loads with a size and depth limit: `error` (one line naming `file` and `what`) instead of MemoryError,
    RecursionError, UnicodeDecodeError or ValueError. `object_pairs_hook` is passed to json.loads."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    where = {"file": None if file is None else str(file)}
    if len(raw) > max_bytes:
        raise error(f"{what} is larger than {max_bytes} bytes", **where, found=f"{len(raw)} bytes")
    if json_depth(raw, max_depth) > max_depth:
        raise error(f"{what} is nested deeper than {max_depth} levels", **where)
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})", **where) from None
    except RecursionError:
        raise error(f"{what} is nested too deeply", **where) from None
    except ValueError as exc:
        raise error(f"{what} is not valid JSON ({exc})", **where) from None


def read_json(path, *, what: str | None = None, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH,
              error: type = InputError) -> Any:
    """parse_json of regular file `path`; its size is checked before a byte is read."""
    what = what or Path(path).name
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise error(f"{what} is larger than {max_bytes} bytes", file=str(path), found=f"{size} bytes")
        with os.fdopen(os.dup(fd), "rb") as fh:
            raw = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    return parse_json(raw, what=what, file=path, max_bytes=max_bytes, max_depth=max_depth, error=error)


def unsafe_name(name: str) -> str | None:
    """Why relative posix path `name` could leave (or confuse) the folder it is joined to; None if it is plain.

    Refused: empty, absolute, a drive ("C:"), a backslash, NUL or another control character, an empty, "." or ".."
    component, a component over 255 bytes, a path over 4096 bytes."""
    if not isinstance(name, str) or not name:
        return "empty name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "control character (NUL, newline, ...) in the name"
    if "\\" in name:
        return "backslash in the name"
    if name.startswith("/") or PurePosixPath(name).is_absolute() or re.match(r"^[A-Za-z]:", name):
        return "absolute path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "'..', '.' or empty path component"
    encoded = name.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_PATH_BYTES:
        return f"path longer than {MAX_PATH_BYTES} bytes"
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for p in parts):
        return f"path component longer than {MAX_NAME_BYTES} bytes"
    return None

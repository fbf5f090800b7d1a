"""What ktconvert accepts from and sends to a hub before any request: repo ids, tokens, and the file names a repo
lists.

* `check_repo_id(repo, hub)`: Hugging Face's own rule (huggingface_hub `validate_repo_id`: "name" or "org/name", 1-96
  characters of [A-Za-z0-9._-], no "--" or "..", no leading/trailing "-" or "."), for ModelScope the same characters
  as "owner/name". InputError (exit 3) naming the id, instead of a traceback from the client.
* `check_token(token, source)`: a token must be printable ASCII without spaces (it travels in an HTTP header; other
  characters made the HTTP client raise UnicodeEncodeError). InputError naming where it came from, never its value.
* `check_remote_names(names, where)`: every file a repo lists must be a plain relative name (`safe_read.unsafe_name`):
  no absolute path, "..", backslash, NUL, ... A hub that lists `../../x.json` would otherwise have the client write
  outside its cache. RemoteError (exit 5) naming the file; checked before any file is downloaded.
"""
from __future__ import annotations

import os
import re
from typing import Iterable

from ktconvert.errors import InputError, RemoteError
from ktconvert.util.safe_read import unsafe_name

# ModelScope: owner/name with the characters Hugging Face allows (its server's exact rule is not documented)
_MS_REPO = re.compile(r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?")
_TOKEN = re.compile(r"[\x21-\x7e]+")
TOKEN_ENV = {"hf": ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"), "modelscope": ("MODELSCOPE_API_TOKEN",)}


def check_repo_id(repo: str, hub: str = "hf") -> str:
    """`repo` if it is a valid repo id of `hub` ("hf" / "modelscope"); InputError otherwise."""
    if hub == "hf":
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo)
            return repo
        except HFValidationError as exc:
            reason = str(exc).split(":")[0]
    else:
        if isinstance(repo, str) and _MS_REPO.fullmatch(repo) and ".." not in repo and "--" not in repo:
            return repo
        reason = "expected owner/name of letters, digits, '-', '_', '.'"
    raise InputError(f"invalid {hub} repo id ({reason})", file=repr(repo)[1:-1],
                     expected="ORG/NAME, e.g. my-org/Qwen3-30B-A3B-kt")


def check_token(token: str | None, source: str) -> None:
    """InputError naming `source` (an environment variable or "--token") if `token` cannot be sent in a header."""
    if token is None or token == "":
        return
    if not _TOKEN.fullmatch(token):
        bad = "non-ASCII" if not token.isascii() else "space or control"
        raise InputError(f"the hub token has {bad} characters; a token is printable ASCII without spaces",
                         file=source, hint="copy the token again from the hub's settings page")


def check_env_tokens(hub: str, token: str | None = None) -> None:
    """check_token on an explicit token and on every environment variable the hub's client reads."""
    check_token(token, "token")
    for var in TOKEN_ENV.get(hub, ()):
        check_token(os.environ.get(var), var)


def check_remote_names(names: Iterable[str], where: str) -> None:
    """RemoteError (exit 5) naming the first file of a repo listing that is not a plain relative name."""
    for name in names:
        reason = unsafe_name(name)
        if reason:
            raise RemoteError(f"the repo lists an unsafe file name ({reason}); refusing the whole repo",
                              file=where, tensor=repr(name)[1:-1])

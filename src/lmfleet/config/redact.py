"""Secrets never echo: every message, log line, admin answer and listing that shows config values passes them here.

What counts as a secret:

* a URL's password (``scheme://USER:PASSWORD@host``) and the values of query parameters named like a secret
  (``?api_key=…``, ``&token=…``, ``&sig=…``), anywhere in a string;
* the value of a key whose name says it holds one (:func:`is_secret_name`: ``HF_TOKEN`` in ``engine.env``,
  ``hf_token`` in ``engine.extra_args``, ``PGPASSWORD``, ``x-api-key``…); keys ending in ``_env``, ``_file``,
  ``_path`` or ``_dir`` name where a secret lives and stay visible;
* in free text (``cluster.setup_commands``, error messages): ``NAME=VALUE`` and ``--flag VALUE`` for such names,
  and ``Authorization: Bearer …``;
* the values of the environment variables the fleet names for secrets (``api_key_env``, ``admin_key_env``,
  ``api_keys_env``, ``password_env``: :func:`env_secrets`) — their values, never the variable names.

Redaction replaces the secret with :data:`MASK` and keeps the rest (the user name, the host, the key name), so a
message still says which value is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MASK", "env_secrets", "is_secret_name", "redact", "redact_text", "redact_url", "secret_values"]

MASK = "***"

MIN_SECRET_LEN = 4
"""Literal values shorter than this are not searched for in free text (they would mask ordinary words); they are
still masked where their key or URL shows them."""

_REFERENCE = re.compile(r"_(env|file|path|dir)$")
_SECRET_ANYWHERE = re.compile(r"passw(or)?d|secret")
_SECRET_SUFFIX = re.compile(r"(^|_)(pwd|token|key|keys|apikey|credentials?|signature|sig|auth|authorization)$")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# scheme://USER:PASSWORD@ — the password runs to the last '@' of the word: an unencoded '@' or '/' in it must not
# leave a tail behind
_URL_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/?#'\"]*:)(?P<secret>[^\s'\"]*)(?P<tail>@)")
_QUERY_PARAM = re.compile(r"(?P<head>[?&;](?P<name>[^=&#\s'\"]+)=)(?P<secret>[^&#\s'\"]*)")
_QUOTED = r"'[^']*'|\"[^\"]*\""
_ASSIGNMENT = re.compile(rf"(?P<head>(?<![\w./-])(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)(?P<secret>{_QUOTED}|[^\s'\"&;]+)")
_FLAG = re.compile(rf"(?P<head>(?<!\S)--?(?P<name>[A-Za-z][\w-]*)(=|\s+))(?P<secret>{_QUOTED}|[^\s'\"-][^\s'\"]*)")
_AUTH_HEADER = re.compile(r"(?P<head>\b(?P<name>authorization|proxy-authorization|x-api-key|api-key)\s*:\s*"
                          r"(?:(?:bearer|basic|token)\s+)?)(?P<secret>[^\s'\"]+)", re.I)


def is_secret_name(name: str) -> bool:
    """Whether a key, variable, query parameter or flag of this name holds a secret value.

    ``HF_TOKEN``, ``hf_token``, ``apiKey``, ``x-api-key``, ``PGPASSWORD``, ``client_secret``: yes.
    ``api_key_env``, ``auth_token_path``, ``max_num_batched_tokens``, ``first_token_s``: no.
    """
    norm = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower().replace("-", "_").replace(".", "_")
    if _REFERENCE.search(norm):
        return False
    return bool(_SECRET_ANYWHERE.search(norm) or _SECRET_SUFFIX.search(norm))


def _mask_named(m: re.Match[str]) -> str:
    return m.group("head") + MASK if is_secret_name(m.group("name")) else m.group(0)


def redact_url(url: str) -> str:
    """``url`` with its password and its secret query parameters masked; the user and the host stay."""
    url = _URL_USERINFO.sub(lambda m: m.group("head") + MASK + m.group("tail"), url)
    return _QUERY_PARAM.sub(_mask_named, url)


def redact_text(text: str, values: Iterable[str] = ()) -> str:
    """Free text (a message, a shell command, a log line) with every secret it shows masked: URL passwords, secret
    query parameters, ``NAME=VALUE`` and ``--flag VALUE`` for secret names, authorization headers, and each of
    ``values`` (known secrets, e.g. :func:`secret_values` or :func:`env_secrets`) wherever it appears."""
    for value in sorted({v for v in values if len(v) >= MIN_SECRET_LEN}, key=len, reverse=True):
        text = text.replace(value, MASK)
    text = redact_url(text)
    text = _AUTH_HEADER.sub(lambda m: m.group("head") + MASK, text)
    text = _ASSIGNMENT.sub(_mask_named, text)
    return _FLAG.sub(_mask_named, text)


def redact(data: Any, name: str | None = None) -> Any:
    """A copy of plain data (``model_dump(mode="json")``, parsed YAML) with secrets masked: the value of every key
    named like a secret (null and empty values stay as they are: they say nothing), and secrets inside strings."""
    if name is not None and is_secret_name(name) and data not in (None, "", [], {}):
        return MASK
    if isinstance(data, Mapping):
        return {k: redact(v, str(k)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact(v) for v in data]
    if isinstance(data, str):
        return redact_text(data)
    return data


def secret_values(data: Any, name: str | None = None) -> set[str]:
    """The literal secrets written in plain data (a fleet file as parsed), to mask wherever a message quotes them:
    values of secret-named keys, URL passwords, secret query and ``NAME=VALUE`` values, and the value of an
    ``*_env`` key that is not a variable name (most likely the secret itself, written where its variable belongs)."""
    out: set[str] = set()
    if isinstance(data, Mapping):
        for k, v in data.items():
            out |= secret_values(v, str(k))
        return out
    if isinstance(data, (list, tuple)):
        for v in data:
            out |= secret_values(v)
        return out
    if data is None or isinstance(data, bool):
        return out
    text = str(data)
    if name is not None and (is_secret_name(name) or (name.endswith("_env") and not _ENV_NAME.fullmatch(text))):
        out.add(text)
    for pattern in (_URL_USERINFO, _QUERY_PARAM, _ASSIGNMENT, _FLAG, _AUTH_HEADER):
        for m in pattern.finditer(text):
            if "name" not in m.groupdict() or is_secret_name(m.group("name")):
                out.add(m.group("secret").strip("'\""))
    for m in _URL_USERINFO.finditer(text):
        # a URL parser cuts an unencoded password at '/', '@', '?' or '#' and may quote a piece ("port 'abc'")
        out.update(re.split(r"[/@?#]", m.group("secret")))
    return out


def env_secrets(data: Any, environ: Mapping[str, str]) -> set[str]:
    """The values of the environment variables that ``data`` (a fleet's ``model_dump()``) names in its ``*_env``
    keys (provider, admin and client keys, the database password): each value, and each comma-separated key of a
    key list."""
    out: set[str] = set()
    if isinstance(data, Mapping):
        for k, v in data.items():
            if str(k).endswith("_env") and isinstance(v, str) and environ.get(v):
                value = environ[v]
                out.add(value)
                out.update(part.strip() for part in value.split(",") if part.strip())
            else:
                out |= env_secrets(v, environ)
    elif isinstance(data, (list, tuple)):
        for v in data:
            out |= env_secrets(v, environ)
    return out

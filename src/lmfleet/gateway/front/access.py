"""Who may call what, and what the gateway reads from a client before any work: keys, Host, the body.

    GatewayConfigError   a setting that would leave the gateway open by accident (``lmfleet serve`` exits 2)
    check_exposure()     refuse a non-loopback listen address without client keys (unless explicitly allowed)
    allowed_hosts()      the trusted Host names for a listen address; host_allowed() matches one
    read_json()          Content-Type, size and time limits, then parse (415 / 413 / 408 / 400)

Everything here fails closed: a key set that loads empty is an error, not "no auth".
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request

from lmfleet.errors import LmfleetError
from lmfleet.gateway.front.errors import GatewayError
from lmfleet.gateway.front.validation import parse_json
from lmfleet.tenants import TenantDirectory

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


class GatewayConfigError(LmfleetError, ValueError):
    """The gateway's settings would leave it open or cannot be honoured; the message says which key and how to fix."""


def is_loopback(host: str) -> bool:
    h = host.strip("[]").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, keys: frozenset[str] | bool, allow_unauthenticated: bool) -> None:
    """Refuse to listen on a non-loopback address with no client key, unless the operator said so. ``keys``: the
    client keys, or whether any is configured (flat gateway keys or any tenant's: ``not directory.is_open``)."""
    if not keys and not allow_unauthenticated and not is_loopback(host):
        raise GatewayConfigError(
            f"refusing to listen on {host} without client API keys: anyone who reaches it could use your engines "
            "and providers. Set gateway.api_keys_env or gateway.api_keys_file (or give tenants keys), listen on "
            "127.0.0.1, or set gateway.allow_unauthenticated: true.")


def allowed_hosts(host: str, extra: Iterable[str] | None) -> frozenset[str] | None:
    """Trusted Host names for a gateway listening on ``host``; None: any (a wildcard listen address with no
    ``gateway.allowed_hosts``, or ``*`` in it)."""
    extra = [h.strip().lower() for h in extra] if extra is not None else None
    if extra is not None and "*" in extra:
        return None
    if extra is None and host.strip().lower() in WILDCARD_HOSTS:
        return None
    return frozenset({*LOOPBACK_NAMES, host.strip("[]").lower(), *(extra or ())})


def host_allowed(header: str | None, allowed: frozenset[str] | None) -> bool:
    """Does a Host header (``name``, ``name:port``, ``[v6]:port``) name this gateway? A missing header passes
    (HTTP/1.0 clients; browsers always send one)."""
    if allowed is None or header is None:
        return True
    h = header.strip().lower()
    if h.startswith("["):
        h = h[1:h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    h = h.rstrip(".")
    if h in allowed:
        return True
    return any(p.startswith("*.") and h.endswith(p[1:]) for p in allowed)


def bearer(headers: Headers) -> str | None:
    h = headers.get("authorization", "")
    if h[:7].lower() == "bearer ":
        return h[7:].strip()
    return None


def key_ok(given: str | None, keys: Iterable[str]) -> bool:
    if not given:
        return False
    g = given.encode("utf-8", "surrogateescape")
    return any(hmac.compare_digest(g, k.encode("utf-8", "surrogateescape")) for k in keys)


def operator_may_see(headers: Headers, api_keys: Iterable[str] | TenantDirectory, admin_key: str | None) -> bool:
    """May this caller see operational detail (/ready's per-model texts, /metrics)? The admin key or a client
    key (any tenant's, when ``api_keys`` is the gateway's :class:`TenantDirectory`), whenever any key is
    configured; anyone when none is (a loopback-only or explicitly open gateway)."""
    given = bearer(headers)
    if isinstance(api_keys, TenantDirectory):
        if api_keys.is_open:
            return not admin_key or key_ok(given, (admin_key,))
        return api_keys.resolve(given) is not None or (admin_key is not None and key_ok(given, (admin_key,)))
    keys = {*api_keys, *([admin_key] if admin_key else [])}
    return not keys or key_ok(given, keys)


def load_keys_from(env_name: str | None, file: str | None, environ: Mapping[str, str]) -> frozenset[str]:
    """Client keys from an env var (comma-separated) and/or a file (one a line, # comments). Raises
    :class:`GatewayConfigError` when a configured source yields none: auth must never turn off silently."""
    keys: set[str] = set()
    if env_name:
        from_env = {k.strip() for k in environ.get(env_name, "").split(",") if k.strip()}
        if not from_env:
            raise GatewayConfigError(
                f"gateway.api_keys_env names {env_name}, but that variable is unset or empty, so no client key "
                f"would load and /v1 would be open. Export {env_name}=key1,key2 or remove gateway.api_keys_env.")
        keys |= from_env
    if file:
        path = Path(file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise GatewayConfigError(f"gateway.api_keys_file {str(path)!r} cannot be read: {e.strerror or e}") from None
        from_file = {ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")}
        if not from_file:
            raise GatewayConfigError(
                f"gateway.api_keys_file {str(path)!r} holds no key (only blank or # lines), so /v1 would be open. "
                "Put one key per line, or remove gateway.api_keys_file.")
        keys |= from_file
    return frozenset(keys)


JSON_TYPES = frozenset({"application/json"})


async def read_json(request: Request, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The request's JSON object, after the checks that cost nothing: media type (415), declared and actual
    size (413, counted while reading, never buffering more than ``max_bytes``), time to send it (408)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in JSON_TYPES:
        raise GatewayError(415, f"Content-Type must be application/json, got {media or 'none'!r}.",
                           code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise GatewayError(400, f"Content-Length {declared[:40]!r} is not a number.", code="invalid_request")
        if int(declared) > max_bytes:
            raise GatewayError(413, f"Request body of {int(declared)} bytes is over the {max_bytes}-byte limit.",
                               code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise GatewayError(413, f"Request body is over the {max_bytes}-byte limit.",
                                       code="request_too_large")
                chunks.append(chunk)
    except ClientDisconnect:
        raise GatewayError(499, "The client went away while sending the body.", code="client_closed") from None
    except TimeoutError:
        raise GatewayError(408, f"The request body did not arrive within {timeout_s:g} s.",
                           code="request_timeout") from None
    return parse_json(b"".join(chunks))

"""Provider dialects: what each OpenAI-compatible provider does differently, as one table (:data:`DIALECTS`).

A provider's dialect is ``providers[].dialect`` or, when that is not set, detected from its base URL's host
(:func:`detect`); anything unknown speaks :data:`GENERIC` (vLLM and other OpenAI-compatible servers). The
gateway resolves it once per provider (:func:`resolve`) and every quirk is read from the entry:

- the auth header (:meth:`Dialect.auth_headers`: ``Authorization: Bearer`` or Azure's ``api-key``);
- where a stream's usage comes (:attr:`Dialect.stream_usage`) and whether ``stream_options.include_usage`` is
  sent (:meth:`Dialect.stream_body`);
- the keys its reasoning text comes under (:attr:`Dialect.reasoning_keys`);
- the rate-limit headers its answers carry (:class:`RateLimitHeaders`);
- error codes that are the client's request (Azure's content filter) or the provider's (an account out of
  quota), whatever the HTTP status says (:meth:`Dialect.fault`).

The fake provider (:mod:`lmfleet.testing.fake_provider`) answers from the same entries. Adding a dialect is one
entry here and one row in ``tests/unit/test_gateway_dialects.py``. Pure data and functions; imports nothing of
lmfleet, so configuration, the gateway and the test servers can all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = ["DIALECTS", "GENERIC", "ONLY_RETRY_AFTER", "REASONING_KEYS", "USAGE_PATHS", "Dialect", "RateLimitHeaders",
           "detect", "resolve", "unknown_dialect_message"]

StreamUsage = Literal["chunk", "last", "x_groq"]
Fault = Literal["client", "provider"]


@dataclass(frozen=True)
class RateLimitHeaders:
    """The headers a provider's answers carry about its limits (None: it does not send that one), read in this
    order of precision for how long a 429 asks to wait: ``retry_after_ms``, ``retry_after`` (seconds or an HTTP
    date), then the reset (a duration: ``"1.5s"``, ``"6m0s"``) of a window whose remaining count is ``0``."""

    retry_after_ms: str | None = "retry-after-ms"
    retry_after: str | None = "retry-after"
    remaining_requests: str | None = "x-ratelimit-remaining-requests"
    reset_requests: str | None = "x-ratelimit-reset-requests"
    remaining_tokens: str | None = "x-ratelimit-remaining-tokens"
    reset_tokens: str | None = "x-ratelimit-reset-tokens"

    def windows(self) -> tuple[tuple[str | None, str], ...]:
        """(remaining header, reset header) per limit window whose reset the provider sends."""
        pairs = ((self.remaining_requests, self.reset_requests), (self.remaining_tokens, self.reset_tokens))
        return tuple((rem, reset) for rem, reset in pairs if reset is not None)


ONLY_RETRY_AFTER = RateLimitHeaders(retry_after_ms=None, remaining_requests=None, reset_requests=None,
                                    remaining_tokens=None, reset_tokens=None)
"""A provider that says how long to wait only in the standard ``retry-after`` (if at all)."""


@dataclass(frozen=True)
class Dialect:
    """How one provider differs from the plain OpenAI API."""

    name: str
    hosts: tuple[str, ...] = ()
    """Base-URL hosts (or their parent domains) that speak this dialect: how it is detected."""
    auth_header: str = "authorization"
    auth_prefix: str = "Bearer "
    """Put before the key in ``auth_header`` ("": the bare key, as Azure's ``api-key``)."""
    stream_usage: StreamUsage = "chunk"
    """Where a stream's usage comes: "chunk" (a chunk of its own with empty ``choices``, only when asked with
    ``stream_options.include_usage``), "last" (in the last content chunk, always) or "x_groq" (under
    ``x_groq.usage`` in the last chunk, always)."""
    stream_options: bool = True
    """The provider accepts ``stream_options`` (False: it is left out of what is sent)."""
    reasoning_keys: tuple[str, ...] = ()
    """Keys of a message or delta that carry reasoning text (billed as completion tokens)."""
    rate_limits: RateLimitHeaders = field(default_factory=RateLimitHeaders)
    client_error_codes: frozenset[str] = frozenset()
    """``error.code`` values that mean the client's request was refused (relayed, no other backend tried)."""
    provider_error_codes: frozenset[str] = frozenset()
    """``error.code`` values that mean the provider or the fleet's account with it cannot serve (never the
    client's: another backend is tried)."""
    provider_error_statuses: frozenset[int] = frozenset()
    """HTTP statuses that mean the same whatever the body says."""

    def auth_headers(self, api_key: str | None) -> dict[str, str]:
        """The request headers that carry ``api_key`` ({} without one)."""
        return {self.auth_header: f"{self.auth_prefix}{api_key}"} if api_key else {}

    @cached_property
    def usage_path(self) -> tuple[str, ...]:
        """Where a stream's usage object sits in its chunk."""
        return ("x_groq", "usage") if self.stream_usage == "x_groq" else ("usage",)

    @cached_property
    def usage_marker(self) -> bytes:
        """Bytes every event that carries this dialect's usage contains: a relay's cheap test for the one event
        of a stream it must parse."""
        return b'"%s":' % self.usage_path[-1].encode()

    @cached_property
    def asks_usage(self) -> bool:
        """The gateway sends ``stream_options.include_usage``: the provider's usage comes only when asked."""
        return self.stream_usage == "chunk" and self.stream_options

    def stream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (a copy where it changes) as a streamed request to this provider is sent: with
        ``stream_options.include_usage`` where usage must be asked for (the ledger needs the counts; the relay
        takes the usage out again if the client did not ask), without ``stream_options`` where it is refused."""
        if not self.stream_options:
            return {k: v for k, v in body.items() if k != "stream_options"} if "stream_options" in body else body
        if not self.asks_usage:
            return body
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            return body
        return {**body, "stream_options": {**(opts if isinstance(opts, dict) else {}), "include_usage": True}}

    def fault(self, status: int, code: Any) -> Fault | None:
        """Whose fault an error answer is when its status or ``error.code`` says so for this provider (None:
        the status alone decides)."""
        code = str(code) if code is not None else None
        if code in self.client_error_codes:
            return "client"
        if code in self.provider_error_codes or status in self.provider_error_statuses:
            return "provider"
        return None


GENERIC = Dialect("openai-compatible", reasoning_keys=("reasoning_content", "reasoning"))
"""Any other OpenAI-compatible server (vLLM, SGLang, a proxy): usage after ``include_usage``, every rate-limit
header read, reasoning under either key vLLM has used."""

DIALECTS: dict[str, Dialect] = {d.name: d for d in (
    GENERIC,
    Dialect("openai", hosts=("api.openai.com",), provider_error_codes=frozenset({"insufficient_quota"})),
    Dialect("azure", hosts=("openai.azure.com", "cognitiveservices.azure.com", "services.ai.azure.com"),
            auth_header="api-key", auth_prefix="",
            # no reset headers: only how many requests and tokens are left
            rate_limits=RateLimitHeaders(reset_requests=None, reset_tokens=None),
            client_error_codes=frozenset({"content_filter"})),
    Dialect("deepseek", hosts=("api.deepseek.com",), reasoning_keys=("reasoning_content",),
            rate_limits=ONLY_RETRY_AFTER, provider_error_statuses=frozenset({402})),  # 402: balance exhausted
    # its X-RateLimit-Reset is an epoch time in ms, not a wait: not read
    Dialect("openrouter", hosts=("openrouter.ai",), reasoning_keys=("reasoning",), rate_limits=ONLY_RETRY_AFTER,
            provider_error_statuses=frozenset({402})),  # 402: credits exhausted
    Dialect("together", hosts=("api.together.xyz", "api.together.ai"), stream_usage="last",
            rate_limits=ONLY_RETRY_AFTER),
    Dialect("fireworks", hosts=("api.fireworks.ai",), stream_usage="last",
            rate_limits=RateLimitHeaders(retry_after_ms=None)),
    Dialect("groq", hosts=("api.groq.com",), stream_usage="x_groq", reasoning_keys=("reasoning",),
            rate_limits=RateLimitHeaders(retry_after_ms=None)),
)}
"""Every dialect the gateway knows, by name."""

USAGE_PATHS: tuple[tuple[str, ...], ...] = tuple(dict.fromkeys(d.usage_path for d in DIALECTS.values()))
"""Everywhere any dialect puts usage, plain ``usage`` first (for code that reads an answer of any provider)."""

REASONING_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for d in DIALECTS.values() for k in d.reasoning_keys))
"""Every key any dialect's reasoning text comes under."""


def _host_matches(host: str, pattern: str) -> bool:
    return host == pattern or host.endswith("." + pattern)


def detect(base_url: str) -> Dialect:
    """The dialect a base URL's host speaks (:data:`GENERIC` for a host no entry names)."""
    host = (urlsplit(base_url).hostname or "").lower()
    for d in DIALECTS.values():
        if any(_host_matches(host, h) for h in d.hosts):
            return d
    return GENERIC


def resolve(name: str | None, base_url: str) -> Dialect:
    """The dialect named (configuration validated it), else the one :func:`detect` finds."""
    return DIALECTS[name] if name else detect(base_url)


def unknown_dialect_message(name: str) -> str:
    """What configuration says of a dialect name not in the table."""
    return (f"unknown dialect {name!r}; known: {', '.join(sorted(DIALECTS))} "
            "(or leave it out: it is detected from base_url)")


def _names(*names: str | None) -> str:
    return ", ".join(f"`{n}`" for n in names if n) or "–"


def markdown_table() -> str:
    """The table as docs/providers.md shows it (``python -m lmfleet.dialects``)."""
    rows = ["| Dialect | Detected from host | Auth header | Stream usage | Sends `include_usage` | Reasoning keys "
            "| Rate-limit headers read | Client's errors | Provider's errors |",
            "|---|---|---|---|---|---|---|---|---|"]
    where = {"chunk": "own last chunk", "last": "last content chunk", "x_groq": "`x_groq.usage`"}
    for d in DIALECTS.values():
        r = d.rate_limits
        provider = _names(*sorted(d.provider_error_codes))
        if d.provider_error_statuses:
            statuses = ", ".join(f"HTTP {s}" for s in sorted(d.provider_error_statuses))
            provider = statuses if provider == "–" else f"{provider}, {statuses}"
        usage_asked = "yes" if d.asks_usage else "no" if d.stream_options else "no (`stream_options` left out)"
        rows.append(" | ".join([
            f"| `{d.name}`", _names(*d.hosts) if d.hosts else "any other", f"`{d.auth_header}: {d.auth_prefix}KEY`",
            where[d.stream_usage], usage_asked, _names(*d.reasoning_keys),
            _names(r.retry_after_ms, r.retry_after, r.remaining_requests, r.reset_requests, r.remaining_tokens,
                   r.reset_tokens),
            _names(*sorted(d.client_error_codes)), provider]) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

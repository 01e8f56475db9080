"""The errors every layer of the gateway raises, and the body they are answered with.

Exception tree::

    GatewayError                      -> an HTTP answer (status, message, type, param, code)
    UpstreamError                     -> a backend (local deployment or provider) failed; ``retryable``
        UpstreamTimeout                  no answer (or first token) in time: busy, not necessarily broken
        UpstreamUnreachable              connect error, reset, broken stream before the first byte
        UpstreamRateLimited              429, with the backend's Retry-After when it sent one
        UpstreamServerError              5xx (and a local 404 while Serve redeploys the app)
        UpstreamMisconfigured            a provider refused our key or model (401/403/404): our fault, not the client's
        UpstreamRejected                 4xx: the backend says the request itself is wrong (not retryable)

All derive from :class:`lmfleet.errors.LmfleetError`. Upstream failures are classified once, in
:mod:`lmfleet.gateway.relay.upstream`; :func:`lmfleet.gateway.front.errors.error_response` is the one place an
error becomes an HTTP response. This module imports nothing of the gateway, so every layer may raise these.
"""

from __future__ import annotations

from typing import Any

from lmfleet.errors import LmfleetError, openai_error_body

__all__ = ["GatewayError", "UpstreamError", "UpstreamMisconfigured", "UpstreamRateLimited", "UpstreamRejected",
           "UpstreamServerError", "UpstreamTimeout", "UpstreamUnreachable", "bad_request", "error_body"]


class GatewayError(LmfleetError):
    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class UpstreamError(LmfleetError):
    """A backend failed. ``status`` is the upstream HTTP status, or None when no answer came."""

    retryable = True
    """Another attempt (the same backend later, or another one) may succeed."""

    def __init__(self, message: str, *, status: int | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s


class UpstreamTimeout(UpstreamError):
    """No answer, or no first token, in time."""


class UpstreamUnreachable(UpstreamError):
    """No HTTP answer: connect error, connection reset, a stream that broke before its first event."""


class UpstreamRateLimited(UpstreamError):
    """HTTP 429; ``retry_after_s`` from the backend's Retry-After header when it sent one."""


class UpstreamServerError(UpstreamError):
    """HTTP 5xx, a body that is not what the API promises, or a local 404 while Serve redeploys the app."""


class UpstreamMisconfigured(UpstreamError):
    """A provider answered 401/403/404, or an error its dialect names as the provider's (quota or balance spent):
    an expired key, a removed model, an account out of credit. Never the client's fault, so never relayed to it;
    another backend may serve."""


class UpstreamRejected(UpstreamError):
    """HTTP 4xx other than 429: the request itself is wrong; no other backend would take it either."""

    retryable = False


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


error_body = openai_error_body
"""OpenAI's error body (:func:`lmfleet.errors.openai_error_body`, under the name the gateway has always used)."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)

"""Errors the gateway answers with, all in OpenAI's error-body shape.

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
:mod:`lmfleet.gateway.relay.upstream`; :func:`error_response` is the one place an error becomes an HTTP response
(the OpenAI routes, the auth layer and FastAPI's exception handlers all call it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from lmfleet.errors import LmfleetError

log = logging.getLogger("lmfleet.gateway")


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
    """A provider answered 401/403/404: an expired key or a removed model. Never the client's fault, so never
    relayed to it; another backend may serve."""


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


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def error_response(e: BaseException, *, method: str = "", path: str = "",
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The HTTP answer to any error, in OpenAI's shape: a :class:`GatewayError` as it says (``headers`` first,
    its own over them), a framework HTTP error (404/405 of an unknown route) with its status, a request the
    framework could not parse as 400, anything else as a logged 500. ``method``/``path``: the request's."""
    if isinstance(e, GatewayError):
        return JSONResponse(e.body(), status_code=e.status, headers={**headers, **e.headers} if headers else e.headers)
    if isinstance(e, HTTPException):
        msg = "Not found." if e.status_code == 404 else str(e.detail)
        if e.status_code == 405:
            msg = f"Method {method} is not allowed on {path}."
        return JSONResponse(error_body(msg, "invalid_request_error" if e.status_code < 500 else "server_error"),
                            status_code=e.status_code)
    if isinstance(e, RequestValidationError):
        return JSONResponse(error_body(str(e.errors()[:3])), status_code=400)
    log.error("unexpected error on %s", path, exc_info=e)
    return JSONResponse(error_body("Internal gateway error.", "server_error"), status_code=500)

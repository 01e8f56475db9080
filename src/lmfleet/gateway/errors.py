"""Errors the gateway answers with, all in OpenAI's error-body shape.

Exception tree::

    GatewayError                      -> an HTTP answer (status, message, type, param, code)
    UpstreamError                     -> a backend (local deployment or provider) failed
        retryable=True                   connect error, timeout, 5xx, 429: another target may serve
        retryable=False                  the backend said the request itself is wrong (4xx)

Only ``gateway.app`` turns these into HTTP responses.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
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


class UpstreamError(Exception):
    """A backend failed. ``status`` is the upstream HTTP status, or None when no answer came."""

    def __init__(self, message: str, *, retryable: bool, status: int | None = None,
                 retry_after_s: float | None = None, timeout: bool = False):
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.status = status
        self.retry_after_s = retry_after_s
        self.timeout = timeout
        """No answer in time: a busy backend, not necessarily a broken one."""


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

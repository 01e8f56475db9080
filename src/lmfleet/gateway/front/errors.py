"""Where an error becomes HTTP: :func:`error_response`, in OpenAI's error-body shape.

The exception tree itself (:class:`GatewayError`, the ``Upstream*`` errors) and its body builder live at the
bottom of the gateway, in :mod:`lmfleet.gateway.core.errors`, so that every layer may raise them; they are
re-exported here for the front door's callers. The OpenAI routes, the auth layer and FastAPI's exception
handlers all answer errors through :func:`error_response`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from lmfleet.gateway.core.errors import (
    GatewayError,
    UpstreamError,
    UpstreamMisconfigured,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamServerError,
    UpstreamTimeout,
    UpstreamUnreachable,
    bad_request,
    error_body,
)

__all__ = ["GatewayError", "UpstreamError", "UpstreamMisconfigured", "UpstreamRateLimited", "UpstreamRejected",
           "UpstreamServerError", "UpstreamTimeout", "UpstreamUnreachable", "bad_request", "error_body",
           "error_response"]

log = logging.getLogger("lmfleet.gateway")


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

"""error_response(): the one place an error becomes an HTTP answer, as a table of (error, status, body, headers)."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from lmfleet.errors import LmfleetError
from lmfleet.gateway.front.errors import GatewayError, UpstreamError, error_response


@pytest.mark.parametrize("error, kw, status, etype, code, headers", [
    (GatewayError(429, "slow down", code="rate_limited", headers={"retry-after": "1"}), {}, 429, "rate_limit_error",
     "rate_limited", {"retry-after": "1"}),
    (GatewayError(401, "who?", code="invalid_api_key"), {}, 401, "authentication_error", "invalid_api_key", {}),
    (GatewayError(429, "full", headers={"retry-after": "1"}), {"headers": {"x-lmfleet-priority": "batch"}}, 429,
     "rate_limit_error", None, {"retry-after": "1", "x-lmfleet-priority": "batch"}),
    (HTTPException(404), {}, 404, "invalid_request_error", None, {}),
    (HTTPException(405), {"method": "GET", "path": "/v1/completions"}, 405, "invalid_request_error", None, {}),
    (RequestValidationError([{"loc": ["query", "since"], "msg": "bad"}]), {}, 400, "invalid_request_error", None, {}),
    (RuntimeError("boom"), {"path": "/admin/state"}, 500, "server_error", None, {}),
])
def test_error_response(error, kw, status, etype, code, headers):
    r = error_response(error, **kw)
    body = json.loads(r.body)["error"]
    assert r.status_code == status and body["type"] == etype and body["code"] == code
    for k, v in headers.items():
        assert r.headers[k] == v
    if status == 405:
        assert body["message"] == "Method GET is not allowed on /v1/completions."
    if status == 500:
        assert "boom" not in body["message"]  # an internal error's text is logged, never sent


def test_gateway_errors_are_lmfleet_errors():
    assert issubclass(GatewayError, LmfleetError) and issubclass(UpstreamError, LmfleetError)


def test_one_error_body_builder():
    """The gateway's errors and the tenants' refusals share lmfleet.errors.openai_error_body (one shape)."""
    from lmfleet.config.tenants import TenantLimits, default_priority_classes
    from lmfleet.errors import openai_error_body
    from lmfleet.gateway.core import errors as core_errors
    from lmfleet.gateway.front import errors as front_errors
    from lmfleet.tenants import Tenant, model_refusal

    assert front_errors.error_body is core_errors.error_body is openai_error_body
    assert openai_error_body("m", "t", "p", "c") == {"error": {"message": "m", "type": "t", "param": "p", "code": "c"}}
    assert GatewayError(404, "gone", param="model").body() == openai_error_body("gone", "not_found_error", "model")
    interactive = default_priority_classes()[0]
    refusal = model_refusal(Tenant("t", TenantLimits(), interactive, interactive, frozenset({"a"})), "b")
    assert refusal is not None and set(refusal["error"]) == {"message", "type", "param", "code"}

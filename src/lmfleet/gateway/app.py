"""The gateway's HTTP surface: the OpenAI routes, authentication and the one place errors become HTTP.

A request, top-down::

    route handler  ->  validate (400/404)  ->  router.route (ordered backends)  ->  RequestRun (tries them,
    relays, records the outcome)  ->  backend (HTTP to Serve or a provider)

Operator routes (/health, /ready, /metrics, /admin/*) live in :mod:`lmfleet.gateway.ops`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.access import bearer, host_allowed, key_ok, operator_may_see, read_json
from lmfleet.gateway.errors import GatewayError, error_body
from lmfleet.gateway.ops import ops_routes
from lmfleet.gateway.run import CANCELLED, RequestRun
from lmfleet.gateway.service import Gateway
from lmfleet.gateway.validation import Kind, check_content_parts, check_prompt_count, check_size, validate_request

log = logging.getLogger("lmfleet.gateway")


def _auth_error(message: str, status: int, type: str, code: str | None = None, **headers: str) -> JSONResponse:
    return JSONResponse(error_body(message, type, code=code), status_code=status, headers=headers or None)


class AuthMiddleware:
    """The trusted Host names on every route but /health; client keys on /v1/*, the admin key on /admin/*, a
    key on /metrics (unless ``gateway.metrics_public``). Plain ASGI: Starlette's ``BaseHTTPMiddleware`` would
    re-wrap every streamed chunk of every answer."""

    def __init__(self, app: ASGIApp, gw: Gateway, trusted_hosts: frozenset[str] | None = None,
                 metrics_public: bool = False):
        self.app = app
        self.gw = gw
        self.trusted_hosts = trusted_hosts
        self.metrics_public = metrics_public

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        path: str = scope["path"]
        gw = self.gw
        headers = Headers(scope=scope)
        if path != "/health" and not host_allowed(headers.get("host"), self.trusted_hosts):
            return _auth_error("Invalid Host header: this gateway does not answer to that name (see "
                               "gateway.allowed_hosts).", 400, "invalid_request_error", "invalid_host")
        if path.startswith("/v1/") and gw.api_keys and not key_ok(bearer(headers), gw.api_keys):
            return _auth_error("Invalid or missing API key. Send `Authorization: Bearer <key>`.", 401,
                               "authentication_error", "invalid_api_key", **{"www-authenticate": "Bearer"})
        if path.startswith("/admin/"):
            if not gw.admin_key:
                return _auth_error("The admin API is disabled: set the admin key environment variable "
                                   "(gateway.admin_key_env) and restart.", 403, "permission_error")
            if not key_ok(bearer(headers), {gw.admin_key}):
                return _auth_error("Invalid or missing admin key.", 401, "authentication_error", "invalid_api_key")
        if path == "/metrics" and not self.metrics_public and not operator_may_see(headers, gw.api_keys, gw.admin_key):
            return _auth_error("/metrics needs the admin key or a client key (or gateway.metrics_public: true).",
                               401, "authentication_error", "invalid_api_key", **{"www-authenticate": "Bearer"})
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := self._refusal(scope)) is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _unless_client_leaves(request: Request, answer: Awaitable[Response]) -> Response:
    """Await ``answer``, but cancel it (and with it the upstream call) when the client disconnects first:
    nobody would read what the backend goes on generating. Once a stream has begun, Starlette's
    StreamingResponse does the same for the relay."""
    task = asyncio.ensure_future(answer)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=CANCELLED)  # nobody is there to read it
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(gw: Gateway, cfg: GatewayConfig | None = None, *,
               trusted_hosts: frozenset[str] | None = None) -> FastAPI:
    """The ASGI app around an assembled :class:`Gateway` (use :func:`lmfleet.gateway.build_gateway`).
    ``trusted_hosts``: the Host names it answers (None: any)."""
    cfg = cfg or GatewayConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="lmfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if cfg.openapi else None)
    app.state.gateway = gw

    # ---- errors: every kind becomes an OpenAI-shaped body here -----------------------------------
    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = "Not found." if e.status_code == 404 else str(e.detail)
        if e.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}."
        return JSONResponse(error_body(msg, "invalid_request_error" if e.status_code < 500 else "server_error"),
                            status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(e.errors()[:3])), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body("Internal gateway error.", "server_error"), status_code=500)

    app.add_middleware(AuthMiddleware, gw=gw, trusted_hosts=trusted_hosts, metrics_public=cfg.metrics_public)

    # ---- the OpenAI routes -------------------------------------------------------------------
    async def _openai(request: Request, kind: Kind, path: str) -> Response:
        t0 = time.monotonic()
        model_name = None
        try:
            body = await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s)
            model_name = body.get("model") if isinstance(body.get("model"), str) else None
            req = validate_request(kind, body)
            if kind == "completion":
                check_prompt_count(body, cfg.max_prompts)
            model = gw.router.model_or_404(req.model)
            if kind == "chat":
                check_content_parts(body["messages"], model.app.cfg.content_parts)
            check_size(req, model.app.max_model_len)
            size = await model.prompt_size(req)
            plan = await gw.router.route(model)
            run = RequestRun(model, req, path, plan, size, t0, gw.recorder)
            return await _unless_client_leaves(request, run.stream() if req.stream else run.unary())
        except GatewayError as e:
            gw.recorder.count_error(model_name, e.status)
            raise

    async def chat(request: Request) -> Response:
        return await _openai(request, "chat", "/chat/completions")

    async def completions(request: Request) -> Response:
        return await _openai(request, "completion", "/completions")

    # plain Starlette routes: FastAPI's dependency machinery costs CPU on every request and these take none
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "lmfleet",
             "max_model_len": m.app.max_model_len, "ready": gw.health.is_ready(name)}
            for name, m in gw.models.items()]}

    app.include_router(ops_routes(gw, cfg))
    return app

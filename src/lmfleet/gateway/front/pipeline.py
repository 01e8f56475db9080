"""The request path of the OpenAI routes, top-down, as named stages (POST /v1/chat/completions, /v1/completions).

    OpenAIRoutes.__call__ -> prepare -> run                        one request
      1. authenticate  Authenticator.check(scope)                 trusted Host; client key -> tenant     400/401
      2. read          read_json(request, ...)                    media type, size, time              415/413/408
      3. validate      OpenAIRoutes.validate(kind, body)          schema, prompt count, model            400/404
      4. admit         Tenancy.admit(tenant, model, headers)      model allowed, priority class          403/400
      5. size          OpenAIRoutes.size(req, model)              content parts, context, prompt tokens      400
      6. route         Router.route(model, tenant, cls, tokens)   ordered backends; tenant limits, budget    429
      7. run           OpenAIRoutes.run(run, receive, send)       attempts, relay (relay.run.RequestRun)     5xx
      8. record        OpenAIRoutes.run: run.finish()             metrics, ledger row (Recorder.record); release
      any error        error_response(e)                          the one place errors become HTTP (front.errors)

Every other route (/v1/models, operator and admin routes) is FastAPI's, behind :class:`AuthMiddleware`, which runs
the same authentication stage.

The two OpenAI routes are answered as plain ASGI in front of FastAPI's middleware stack: Starlette's error and
exception middlewares, its router and its request/response wrappers each add a layer around every ``send`` of
every streamed chunk, about a tenth of the gateway's CPU on this path (py-spy on benchmarks/bench_relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.front.access import bearer, host_allowed, key_ok, operator_may_see, read_json
from lmfleet.gateway.front.errors import GatewayError, error_response
from lmfleet.gateway.front.tenancy import TENANT_SCOPE_KEY, Tenancy
from lmfleet.gateway.front.validation import (
    Kind,
    ParsedRequest,
    check_content_parts,
    check_prompt_count,
    check_size,
    validate_request,
)
from lmfleet.gateway.relay.disconnect import DisconnectWatch
from lmfleet.gateway.relay.response import RelayResponse, send_whole
from lmfleet.gateway.relay.run import RequestRun
from lmfleet.gateway.routing.served import PromptSize, ServedModel
from lmfleet.tenants import Tenant

if TYPE_CHECKING:  # the assembled gateway, above the front door: read here, never imported at run time
    from lmfleet.gateway.service import Gateway

log = logging.getLogger("lmfleet.gateway")

HOT_ROUTES: dict[str, tuple[Kind, str]] = {"/v1/chat/completions": ("chat", "/chat/completions"),
                                           "/v1/completions": ("completion", "/completions")}
"""The OpenAI routes every token passes through: path -> (request kind, upstream path)."""


class Authenticator:
    """Stage 1, on every route: the trusted Host names on every route but /health; client keys on /v1/* (each key
    resolves to its tenant, left in ``scope[TENANT_SCOPE_KEY]``), the admin key on /admin/*, a key on /metrics
    (unless ``gateway.metrics_public``)."""

    def __init__(self, gw: Gateway, trusted_hosts: frozenset[str] | None = None, metrics_public: bool = False):
        self.gw = gw
        self.trusted_hosts = trusted_hosts
        self.metrics_public = metrics_public

    def check(self, scope: Scope) -> None:
        """Raises :class:`GatewayError` (400/401/403) when the caller may not reach ``scope``'s path."""
        path: str = scope["path"]
        gw = self.gw
        headers = Headers(scope=scope)
        if path != "/health" and not host_allowed(headers.get("host"), self.trusted_hosts):
            raise GatewayError(400, "Invalid Host header: this gateway does not answer to that name (see "
                               "gateway.allowed_hosts).", code="invalid_host")
        if path.startswith("/v1/"):
            tenant = gw.tenants.resolve(bearer(headers))
            if tenant is None:
                raise GatewayError(401, "Invalid or missing API key. Send `Authorization: Bearer <key>`.",
                                   code="invalid_api_key", headers={"www-authenticate": "Bearer"})
            scope[TENANT_SCOPE_KEY] = tenant
        if path.startswith("/admin/"):
            if not gw.admin_key:
                raise GatewayError(403, "The admin API is disabled: set the admin key environment variable "
                                   "(gateway.admin_key_env) and restart.")
            if not key_ok(bearer(headers), {gw.admin_key}):
                raise GatewayError(401, "Invalid or missing admin key.", code="invalid_api_key")
        if path == "/metrics" and not self.metrics_public and not operator_may_see(headers, gw.tenants, gw.admin_key):
            raise GatewayError(401, "/metrics needs the admin key or a client key (or gateway.metrics_public: true).",
                               code="invalid_api_key", headers={"www-authenticate": "Bearer"})


class AuthMiddleware:
    """:class:`Authenticator` in front of FastAPI's routes. Plain ASGI: Starlette's ``BaseHTTPMiddleware`` would
    re-wrap every streamed chunk of every answer."""

    def __init__(self, app: ASGIApp, auth: Authenticator):
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                self.auth.check(scope)
            except GatewayError as e:
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIRoutes:
    """POST /v1/chat/completions and /v1/completions: the stages of the module docstring, one method each."""

    def __init__(self, gw: Gateway, cfg: GatewayConfig, auth: Authenticator, tenancy: Tenancy):
        self.gw, self.cfg, self.auth, self.tenancy = gw, cfg, auth, tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind, path = HOT_ROUTES[scope["path"]]
        try:
            self.auth.check(scope)
        except GatewayError as e:
            await send_whole(send, error_response(e))
            return
        tracer = self.gw.tracer
        span = tracer.start_request(scope["path"], scope["headers"]) if tracer is not None else None
        try:
            run = await self.prepare(Request(scope, receive), kind, path)
        except Exception as e:
            if span is not None:
                attrs = {"lmfleet.error.code": e.code} if isinstance(e, GatewayError) else {}
                tracer.end_request(span, e.status if isinstance(e, GatewayError) else 500, attrs)  # type: ignore
            await send_whole(send, error_response(e, path=scope["path"]))
            return
        if span is not None:
            run.span, run.tracer = span, tracer
        await self.run(run, receive, send)

    async def prepare(self, request: Request, kind: Kind, path: str) -> RequestRun:
        """Stages 2-6: everything before the first upstream call. An error is counted here (model, tenant)."""
        t0 = time.monotonic()
        tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
        model_name = None
        try:
            body = await read_json(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
            model_name = body.get("model") if isinstance(body.get("model"), str) else None
            req, model = self.validate(kind, body)
            cls = self.tenancy.admit(tenant, model.name, request.headers)
            size = await self.size(req, model)
            try:
                plan = await self.gw.router.route(model, tenant, cls, size.tokens)
            except BaseException:
                if size.exact is not None:
                    size.exact.cancel()
                raise
            self.gw.metrics.observe_prepare(model.name, time.monotonic() - t0)  # the gateway phase (lmfleet profile)
            return RequestRun(model, req, path, plan, size, t0, self.gw.recorder)
        except GatewayError as e:
            self.gw.recorder.count_error(model_name, e.status, tenant.name if tenant is not None else None)
            raise

    def validate(self, kind: Kind, body: dict[str, Any]) -> tuple[ParsedRequest, ServedModel]:
        """Stage 3: the body against the API's schema (400) and the model it names (404)."""
        req = validate_request(kind, body)
        if kind == "completion":
            check_prompt_count(body, self.cfg.max_prompts)
        return req, self.gw.router.model_or_404(req.model)

    async def size(self, req: ParsedRequest, model: ServedModel) -> PromptSize:
        """Stage 5: what the model accepts (content parts) and whether prompt + max_tokens fit its context (400)."""
        if req.kind == "chat":
            check_content_parts(req.body["messages"], model.app.cfg.content_parts)
        check_size(req, model.app.max_model_len)
        return await model.prompt_size(req)

    async def run(self, run: RequestRun, receive: Receive, send: Send) -> None:
        """Stages 7-8: try the backends, send the answer, record it (:meth:`RequestRun.finish`), and whatever
        happens release the tenant's slots. One task watches for the client to leave: when it does, this task is
        cancelled (and with it the upstream call)."""
        task = asyncio.current_task()
        assert task is not None
        watch = DisconnectWatch(receive, task)
        status = 200
        try:
            try:
                answer = await run.answer()
            except GatewayError as e:
                status = e.status
                run.recorder.count_error(run.req.model, e.status, run.ticket.tenant if run.ticket else None)
                await send_whole(send, error_response(e, headers=run.plan.headers))
                return
            if isinstance(answer, RelayResponse):
                await answer.send_to(send, watch.answered)
            else:
                watch.answered()
                await send_whole(send, answer)
        except asyncio.CancelledError:
            status = 499
            if not watch.gone:
                raise
            task.uncancel()  # the client left: nobody to answer
        except Exception as e:
            status = 500
            with contextlib.suppress(Exception):  # fails once the response has started: the stream just ends
                await send_whole(send, error_response(e, path=run.path))
        finally:
            watch.stop()
            run.finish()  # stage 8: the answer's metrics and ledger row
            run.release()  # the tenant's slots (in flight, in the local queue), however the request ended
            if run.span is not None:
                _end_span(run, status)


def _end_span(run: RequestRun, status: int) -> None:
    """The request span's closing attributes: who served it, why, what it cost in tokens and time."""
    o = run.outcome
    attrs = {"gen_ai.request.model": run.req.model, "lmfleet.route_reason": run.reason.value,
             "lmfleet.queue_estimate_ms": round(run.plan.estimate_ms, 1),
             "lmfleet.tenant": run.ticket.tenant if run.ticket is not None else None}
    if o is not None:
        attrs.update({"lmfleet.served_by": o.served_by, "gen_ai.usage.input_tokens": o.input_tokens,
                      "gen_ai.usage.output_tokens": o.output_tokens,
                      "lmfleet.ttft_ms": round(o.ttft_s * 1000, 2) if o.ttft_s is not None else None})
        if status == 200:
            status = o.status
    run.tracer.end_request(run.span, status, attrs)  # type: ignore[union-attr]


class GatewayApp(FastAPI):
    """FastAPI, with :class:`OpenAIRoutes` answering the hot routes before its middleware stack."""

    openai_routes: OpenAIRoutes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.openai_routes is not None and scope["type"] == "http" and scope["path"] in HOT_ROUTES
                and scope["method"] == "POST"):
            await self.openai_routes(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

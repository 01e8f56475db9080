"""The gateway's HTTP surface: the OpenAI routes, authentication and the one place errors become HTTP.

A request, top-down::

    route handler  ->  validate (400/404)  ->  router.route (ordered backends)  ->  RequestRun (tries them,
    relays, records the outcome)  ->  backend (HTTP to Serve or a provider)

Operator routes (/health, /ready, /metrics, /admin/*) live in :mod:`lmfleet.gateway.ops`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from lmfleet.config.models import GatewayConfig
from lmfleet.config.tenants import PriorityClass, default_priority_classes
from lmfleet.gateway.access import bearer, host_allowed, key_ok, operator_may_see, read_json
from lmfleet.gateway.errors import GatewayError, error_body
from lmfleet.gateway.ops import ops_routes
from lmfleet.gateway.run import DisconnectWatch, RelayResponse, RequestRun
from lmfleet.gateway.service import Gateway
from lmfleet.gateway.tracing import RequestTracer
from lmfleet.gateway.validation import Kind, check_content_parts, check_prompt_count, check_size, validate_request
from lmfleet.store import Ledger, SqliteSpendStore, StoreUnavailable
from lmfleet.tenants import (
    PRIORITY_HEADER,
    PriorityHeaderError,
    Tenant,
    TenantBook,
    TenantDirectory,
    model_refusal,
    requested_class,
)
from lmfleet.tenants.admin import TenantAdmin, TenantSettingsError
from lmfleet.tenants.keys import KeyFiles

log = logging.getLogger("lmfleet.gateway")


def _auth_error(message: str, status: int, type: str, code: str | None = None, **headers: str) -> JSONResponse:
    return JSONResponse(error_body(message, type, code=code), status_code=status, headers=headers or None)


TENANT_SCOPE_KEY = "lmfleet.tenant"
"""Where the auth layer leaves the caller's :class:`~lmfleet.tenants.Tenant` in the ASGI scope of a /v1 request."""


class AuthMiddleware:
    """The trusted Host names on every route but /health; client keys on /v1/* (each key resolves to its tenant,
    left in ``scope[TENANT_SCOPE_KEY]``), the admin key on /admin/*, a key on /metrics (unless
    ``gateway.metrics_public``). Plain ASGI: Starlette's ``BaseHTTPMiddleware`` would re-wrap every streamed
    chunk of every answer."""

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
        if path.startswith("/v1/"):
            tenant = gw.tenants.resolve(bearer(headers))
            if tenant is None:
                return _auth_error("Invalid or missing API key. Send `Authorization: Bearer <key>`.", 401,
                                   "authentication_error", "invalid_api_key", **{"www-authenticate": "Bearer"})
            scope[TENANT_SCOPE_KEY] = tenant
        if path.startswith("/admin/"):
            if not gw.admin_key:
                return _auth_error("The admin API is disabled: set the admin key environment variable "
                                   "(gateway.admin_key_env) and restart.", 403, "permission_error")
            if not key_ok(bearer(headers), {gw.admin_key}):
                return _auth_error("Invalid or missing admin key.", 401, "authentication_error", "invalid_api_key")
        if path == "/metrics" and not self.metrics_public and not operator_may_see(headers, gw.tenants, gw.admin_key):
            return _auth_error("/metrics needs the admin key or a client key (or gateway.metrics_public: true).",
                               401, "authentication_error", "invalid_api_key", **{"www-authenticate": "Bearer"})
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := self._refusal(scope)) is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


HOT_ROUTES: dict[str, tuple[Kind, str]] = {"/v1/chat/completions": ("chat", "/chat/completions"),
                                           "/v1/completions": ("completion", "/completions")}
"""The OpenAI routes every token passes through: path -> (request kind, upstream path)."""

Prepare = Callable[[Request, Kind, str], Awaitable[tuple[RequestRun, bool]]]


class OpenAIRoutes:
    """POST /v1/chat/completions and /v1/completions as plain ASGI, in front of FastAPI's middleware stack.

    Starlette's error and exception middlewares, its router and its request/response wrappers each add a layer
    around every ``send`` of every streamed chunk; on this path they cost about a tenth of the gateway's CPU
    (py-spy on benchmarks/bench_relay.py). Here the same checks run in the same order (Host, key, body,
    validation, route) and errors get the same OpenAI-shaped bodies, with one task per request watching for
    the client to leave: when it does, the request's task is cancelled (and with it the upstream call).
    """

    def __init__(self, prepare: Prepare, auth: AuthMiddleware, tracer: RequestTracer | None = None):
        self.prepare = prepare
        self.auth = auth
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind, path = HOT_ROUTES[scope["path"]]
        if (refusal := self.auth._refusal(scope)) is not None:
            await refusal(scope, receive, send)
            return
        tracer = self.tracer
        span = tracer.start_request(scope["path"], scope["headers"]) if tracer is not None else None
        try:
            run, stream = await self.prepare(Request(scope, receive), kind, path)
        except GatewayError as e:
            if span is not None:
                tracer.end_request(span, e.status, {"lmfleet.error.code": e.code})  # type: ignore[union-attr]
            await _send_whole(send, JSONResponse(e.body(), status_code=e.status, headers=e.headers))
            return
        except Exception:
            if span is not None:
                tracer.end_request(span, 500, {})  # type: ignore[union-attr]
            log.exception("unexpected error on %s", scope["path"])
            await _send_whole(send, JSONResponse(error_body("Internal gateway error.", "server_error"), 500))
            return
        if span is not None:
            run.span, run.tracer = span, tracer
        await self._answer(run, stream, receive, send)

    async def _answer(self, run: RequestRun, stream: bool, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = DisconnectWatch(receive, task)
        status = 200
        try:
            try:
                answer = await (run.stream() if stream else run.unary())
            except GatewayError as e:
                status = e.status
                run.recorder.count_error(run.req.model, e.status, run.ticket.tenant if run.ticket else None)
                headers = {**run.plan.headers, **e.headers} if run.plan.headers else e.headers
                await _send_whole(send, JSONResponse(e.body(), status_code=e.status, headers=headers))
                return
            if isinstance(answer, RelayResponse):
                await answer.send_to(send, watch.answered)
            else:
                watch.answered()
                await _send_whole(send, answer)
        except asyncio.CancelledError:
            status = 499
            if not watch.gone:
                raise
            task.uncancel()  # the client left: nobody to answer
        except Exception:
            status = 500
            log.exception("unexpected error on %s", run.path)
            with contextlib.suppress(Exception):  # fails once the response has started: the stream just ends
                await _send_whole(send, JSONResponse(error_body("Internal gateway error.", "server_error"), 500))
        finally:
            watch.stop()
            run.release()  # the tenant's slot in flight, however the request ended
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


async def _send_whole(send: Send, r: Response) -> None:
    await send({"type": "http.response.start", "status": r.status_code, "headers": r.raw_headers})
    await send({"type": "http.response.body", "body": r.body})


class GatewayApp(FastAPI):
    """FastAPI, with :class:`OpenAIRoutes` answering the hot routes before its middleware stack."""

    openai_routes: OpenAIRoutes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.openai_routes is not None and scope["type"] == "http" and scope["path"] in HOT_ROUTES
                and scope["method"] == "POST"):
            await self.openai_routes(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


GC_THRESHOLDS = (20_000, 20, 20)
"""Collector thresholds while serving (Python's default: 700, 10, 10)."""


def quiet_gc() -> None:
    """Keep the cyclic garbage collector off the data path; for a process that serves a gateway, called once
    it has started (it changes the whole process's collector settings, so the app does not call it itself).

    The process carries a large, long-lived heap (FastAPI, pydantic, tokenizers, Ray, sometimes torch); with
    Python's default thresholds a request's few hundred short-lived objects trigger collections that walk it,
    and py-spy on benchmarks/bench_relay.py put a quarter of the gateway's CPU in ``gc_collect_main``.
    ``gc.freeze()`` moves everything alive after start-up out of the collector's sight, and larger thresholds
    make the collections that remain rarer (each one walks only what requests left behind).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def create_app(gw: Gateway, cfg: GatewayConfig | None = None, *,
               trusted_hosts: frozenset[str] | None = None) -> FastAPI:
    """The ASGI app around an assembled :class:`Gateway` (use :func:`lmfleet.gateway.build_gateway`).
    ``trusted_hosts``: the Host names it answers (None: any)."""
    cfg = cfg or GatewayConfig()
    tenant_admin = _tenant_admin(gw)
    key_files = KeyFiles(gw.tenants)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.start()
        poll = (asyncio.create_task(tenant_admin.poll_forever())
                if tenant_admin is not None and tenant_admin.store is not None else None)
        # key files re-read when they change (rotation without a restart), by every gateway process on its own
        poll_keys = asyncio.create_task(key_files.poll_forever()) if key_files.sources else None
        try:
            yield
        finally:
            for task in (poll, poll_keys):
                if task is not None:
                    task.cancel()
            await gw.close()

    app = GatewayApp(title="lmfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if cfg.openapi else None)
    app.state.gateway = gw
    app.state.tenant_admin = tenant_admin
    app.state.key_files = key_files

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

    # ---- the OpenAI routes -------------------------------------------------------------------
    async def _openai(request: Request, kind: Kind, path: str) -> tuple[RequestRun, bool]:
        """Everything before the first upstream call: body, validation, model, size, route."""
        t0 = time.monotonic()
        model_name = None
        tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
        try:
            body = await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s)
            model_name = body.get("model") if isinstance(body.get("model"), str) else None
            req = validate_request(kind, body)
            if kind == "completion":
                check_prompt_count(body, cfg.max_prompts)
            model = gw.router.model_or_404(req.model)
            cls = None
            if tenant is not None:
                if (refusal := model_refusal(tenant, model.name)) is not None:
                    raise GatewayError(403, refusal["error"]["message"], param="model", code="model_not_allowed")
                cls = _priority(request, tenant)
            if kind == "chat":
                check_content_parts(body["messages"], model.app.cfg.content_parts)
            check_size(req, model.app.max_model_len)
            size = await model.prompt_size(req)
            plan = await gw.router.route(model, tenant, cls, size.tokens)
            gw.metrics.observe_prepare(model.name, time.monotonic() - t0)  # the gateway phase (lmfleet profile)
            return RequestRun(model, req, path, plan, size, t0, gw.recorder), req.stream
        except GatewayError as e:
            gw.recorder.count_error(model_name, e.status, tenant.name if tenant is not None else None)
            raise

    def _priority(request: Request, tenant: Tenant) -> PriorityClass:
        try:
            return requested_class(request.headers.get(PRIORITY_HEADER), tenant, classes)
        except PriorityHeaderError as e:
            raise GatewayError(400, e.message, param=PRIORITY_HEADER, code="invalid_priority") from None

    classes = gw.router.tenants.classes if gw.router.tenants is not None else default_priority_classes()

    app.add_middleware(AuthMiddleware, gw=gw, trusted_hosts=trusted_hosts, metrics_public=cfg.metrics_public)
    # the two OpenAI routes are answered in front of FastAPI's stack (see OpenAIRoutes); FastAPI answers the rest
    app.openai_routes = OpenAIRoutes(_openai, AuthMiddleware(app, gw, trusted_hosts, cfg.metrics_public), gw.tracer)
    for path in HOT_ROUTES:  # also in FastAPI's router, which then answers other methods with 405
        app.add_route(path, app.openai_routes, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        now = int(time.time())
        tenant: Tenant | None = request.scope.get(TENANT_SCOPE_KEY)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "lmfleet",
             "max_model_len": m.app.max_model_len, "ready": gw.health.is_ready(name)}
            for name, m in gw.models.items() if tenant is None or tenant.may_use(name)]}

    @app.get("/admin/tenants")
    async def admin_tenants() -> dict[str, Any]:
        """Every tenant's settings and this process's live usage (admin key; no key or digest is shown)."""
        book = gw.router.tenants
        queues = {n: {"capacity": m.queue.capacity, "running": m.queue.running, "waiting": len(m.queue.waiting),
                      "peer_running": m.queue.peer_running, "share": m.queue.share}
                  for n, m in gw.models.items() if m.queue is not None}
        return {"classes": [c.model_dump() for c in book.classes] if book is not None else [],
                "tenants": tenant_report(gw.tenants, book, tenant_admin), "local_queues": queues}

    @app.put("/admin/tenants/{name}")
    async def admin_put_tenant(name: str, request: Request) -> dict[str, Any]:
        """Change a tenant's limits, models or classes now, in every gateway process, kept across restarts: the
        fields given replace the current ones (``limits`` field by field). The tenant's effective settings."""
        body = await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s)
        admin = _admin_of(tenant_admin, name)
        try:
            settings = await admin.update(name, body)
        except TenantSettingsError as e:
            raise GatewayError(400, e.message, param=e.param, code="invalid_tenant_settings") from None
        except StoreUnavailable as e:
            raise GatewayError(503, f"The tenant settings cannot be saved now (nothing changed): {e}") from None
        log.info("admin: tenant %s settings set to %s", name, settings.model_dump_json())
        return {"tenant": name, "persisted": admin.store is not None,
                **tenant_report(gw.tenants, gw.router.tenants, admin)[name]}

    @app.delete("/admin/tenants/{name}")
    async def admin_revert_tenant(name: str) -> dict[str, Any]:
        """Back to the tenant's settings in fleet.yaml (in every gateway process)."""
        admin = _admin_of(tenant_admin, name)
        try:
            await admin.revert(name)
        except StoreUnavailable as e:
            raise GatewayError(503, f"The tenant settings cannot be saved now (nothing changed): {e}") from None
        log.info("admin: tenant %s back to its fleet.yaml settings", name)
        return {"tenant": name, **tenant_report(gw.tenants, gw.router.tenants, admin)[name]}

    @app.post("/admin/keys/reload")
    async def admin_reload_keys() -> JSONResponse:
        """Re-read every key file now (this process; the others see a changed file within their poll period).
        Each tenant's key count (never a key); 422 when a file could not be used (its tenant keeps its keys)."""
        report = await key_files.reload()
        body = report.body()
        log.info("admin: key files re-read: %s", {n: t["keys"] for n, t in body["tenants"].items()})
        if report.errors:
            first = report.errors[0]
            body.update(error_body(f"{len(report.errors)} key file(s) could not be used; their tenants keep the keys "
                                   f"they hold. First: {first['message']}", param=first["param"],
                                   code="key_file_unusable"))
            return JSONResponse(body, status_code=422)
        return JSONResponse(body)

    app.include_router(ops_routes(gw, cfg))
    return app


def _tenant_admin(gw: Gateway) -> TenantAdmin | None:
    """Run-time tenant settings (None without ``tenants:``), persisted in the spend store's database: the one the
    gateway opened, else one opened on the SQLite ledger's file (closed with the ledger). A PostgreSQL ledger without
    a spend store keeps changes in memory only (``persisted: false``)."""
    book = gw.router.tenants
    if book is None or not any(m.queue is not None for m in gw.models.values()):
        return None
    store = gw.recorder.store
    if store is None and isinstance(gw.recorder.ledger, Ledger):
        try:
            store = gw.recorder.store = SqliteSpendStore(gw.recorder.ledger.path)
        except StoreUnavailable as e:
            log.error("tenant settings: cannot open the ledger's database (%s); admin changes stay in memory", e)
    if store is None:
        log.warning("tenant settings: no spend store in this gateway; PUT /admin/tenants changes are kept in "
                    "memory only (lost at restart, not shared across processes)")
    admin = TenantAdmin(gw.tenants, book, gw.router.tenant_caps, served=list(gw.models), store=store,
                        spend_caps=gw.router.guard is not None)
    admin.load()
    return admin


def _admin_of(admin: TenantAdmin | None, name: str) -> TenantAdmin:
    """``admin`` when ``name`` is one of its tenants, else a 404 (the name is echoed only when it is a valid one)."""
    if admin is None:
        raise GatewayError(404, "No tenants are configured (fleet.yaml `tenants:`).", param="name",
                           code="tenant_not_found")
    if name not in admin.directory.tenants:
        shown = repr(name) if len(name) <= 63 and name.replace("-", "").replace("_", "").isalnum() else "that name"
        raise GatewayError(404, f"No tenant named {shown}; tenants: {sorted(admin.directory.tenants)}.",
                           param="name", code="tenant_not_found")
    return admin


def tenant_report(directory: TenantDirectory, book: TenantBook | None,
                  admin: TenantAdmin | None = None) -> dict[str, Any]:
    """``GET /admin/tenants``: per tenant its limits, models, classes and, per gateway process, what it uses."""
    out: dict[str, Any] = {}
    now = book.clock() if book is not None else time.time()
    for name, t in directory.tenants.items():
        usage = book.usage.get(name) if book is not None else None
        windows = {}
        for kind, w in (("requests_per_minute", usage.requests if usage else None),
                        ("tokens_per_minute", usage.tokens if usage else None)):
            if w is not None:
                windows[kind] = {"limit": w.limit, "used": round(w.used(now), 1), "remaining": w.remaining(now)}
        out[name] = {"limits": t.limits.model_dump(), "models": sorted(t.models) or None,
                     "priority": t.priority.name, "max_priority": t.max_priority.name,
                     "batch_may_use_providers": t.batch_may_use_providers,
                     "in_flight": book.in_flight.get(name, 0) if book is not None else None, "windows": windows,
                     **(admin.source(name) if admin is not None else {"source": "fleet.yaml"})}
    return out

"""The gateway's HTTP surface: OpenAI routes, health, metrics and the admin API.

Errors of every kind are turned into OpenAI-shaped bodies here and only here.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.errors import GatewayError, error_body
from lmfleet.gateway.router import Router
from lmfleet.gateway.validation import parse_json, validate_request
from lmfleet.overflow import OverflowMode

log = logging.getLogger("lmfleet.gateway")


def load_api_keys(cfg: GatewayConfig, environ: dict[str, str]) -> set[str]:
    """Client API keys from the configured env var and/or file. Empty set: no auth."""
    keys: set[str] = set()
    if cfg.api_keys_env:
        keys |= {k.strip() for k in environ.get(cfg.api_keys_env, "").split(",") if k.strip()}
    if cfg.api_keys_file:
        path = Path(cfg.api_keys_file).expanduser()
        keys |= {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}
    return keys


def _bearer(request: Request) -> str | None:
    h = request.headers.get("authorization", "")
    if h[:7].lower() == "bearer ":
        return h[7:].strip()
    return None


def _key_ok(given: str | None, keys: set[str]) -> bool:
    if not given:
        return False
    return any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)


def _error(e: GatewayError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(router: Router, *, api_keys: set[str], admin_key: str | None,
               on_startup: Callable[[], Any] | None = None) -> FastAPI:
    """Build the gateway app around a :class:`Router` (which holds the fleet and its backends)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.start()
        pollers = [asyncio.create_task(router.health.run())]
        if router.engine_stats is not None:
            pollers.append(asyncio.create_task(router.engine_stats.run()))
        if on_startup:
            on_startup()
        try:
            yield
        finally:
            for p in pollers:
                p.cancel()
            await router.close()

    app = FastAPI(title="lmfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
        return _error(e)

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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = request.url.path
        if path.startswith("/v1/") and api_keys and not _key_ok(_bearer(request), api_keys):
            return JSONResponse(error_body("Invalid or missing API key. Send `Authorization: Bearer <key>`.",
                                           "authentication_error", code="invalid_api_key"), status_code=401,
                                headers={"www-authenticate": "Bearer"})
        if path.startswith("/admin/"):
            if not admin_key:
                return JSONResponse(error_body("The admin API is disabled: set the admin key environment variable "
                                               "(gateway.admin_key_env) and restart.", "permission_error"),
                                    status_code=403)
            if not _key_ok(_bearer(request), {admin_key}):
                return JSONResponse(error_body("Invalid or missing admin key.", "authentication_error",
                                               code="invalid_api_key"), status_code=401)
        return await call_next(request)

    async def _openai(request: Request, kind: str, path: str) -> Response:
        model = None
        try:
            body = parse_json(await request.body())
            model = body.get("model") if isinstance(body.get("model"), str) else None
            return await router.handle(validate_request(kind, body), path)  # type: ignore[arg-type]
        except GatewayError as e:
            router.count_error(model, e.status)
            raise

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _openai(request, "chat", "/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _openai(request, "completion", "/completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "lmfleet", "max_model_len": m.max_model_len,
             "ready": router.health.is_ready(name)}
            for name, m in router.models.items()]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        models = {n: {"ready": h.ready, "degraded": h.degraded, "message": h.message,
                      "running_replicas": h.running_replicas}
                  for n, h in router.health.models.items()}
        for n, h in router.health.models.items():
            router.metrics.model_ready.labels(n).set(1 if h.ready else 0)
        ok = router.health.all_ready()
        degraded = any(h.degraded for h in router.health.models.values())
        # 200 while every model can serve (a degraded fleet still takes traffic), 503 otherwise
        return JSONResponse({"ready": ok, "degraded": degraded, "models": models}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        for n, h in router.health.models.items():
            router.metrics.model_ready.labels(n).set(1 if h.ready else 0)
        for n, m in router.models.items():
            router.metrics.in_flight.labels(n, f"local/{n}").set(m.tracker.in_flight)
        for p in router.providers.values():
            for n in p.cfg.model_map:
                router.metrics.in_flight.labels(n, f"provider/{p.name}").set(p.in_flight)
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- admin -------------------------------------------------------------------------------
    @app.get("/admin/state")
    async def admin_state() -> dict[str, Any]:
        out: dict[str, Any] = {"models": {}, "providers": {}}
        for n, m in router.models.items():
            s = m.tracker.snapshot()
            out["models"][n] = {
                "ready": router.health.is_ready(n), "health": router.health.models[n].message,
                "in_flight": s.in_flight, "capacity": m.capacity, "queued_estimate": max(0, s.in_flight - m.capacity),
                "queue_estimate_ms": round(router.estimate(m, s), 1), "threshold_ms": m.threshold_ms,
                "mode": m.mode.value, "overflowing": m.hysteresis.overflowing, "drain_rps": s.drain_rps,
                "recent_ttft_s": s.ttft_s, "base_ttft_s": s.base_ttft_s,
                "engine_running": s.engine_running, "engine_waiting": s.engine_waiting,
            }
        for n, p in router.providers.items():
            out["providers"][n] = {"breaker": p.breaker.state().value, "in_flight": p.in_flight,
                                   "retry_after_s": round(p.breaker.retry_after_s(), 2)}
        return out

    @app.post("/admin/overflow")
    async def admin_overflow(request: Request) -> dict[str, Any]:
        body = parse_json(await request.body())
        name = body.get("model")
        targets = list(router.models.values()) if name in (None, "*") else [router.model_or_404(str(name))]
        mode = body.get("mode")
        if mode is not None and mode not in {m.value for m in OverflowMode}:
            raise GatewayError(400, f"mode must be one of {[m.value for m in OverflowMode]}, got {mode!r}", param="mode")
        thr = body.get("threshold_ms")
        if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or thr <= 0):
            raise GatewayError(400, f"threshold_ms must be a positive number, got {thr!r}", param="threshold_ms")
        for m in targets:
            if mode is not None:
                m.mode = OverflowMode(mode)
            if thr is not None:
                m.threshold_ms = float(thr)
        log.info("admin: overflow for %s set to mode=%s threshold_ms=%s", [m.name for m in targets], mode, thr)
        return {"models": {m.name: {"mode": m.mode.value, "threshold_ms": m.threshold_ms} for m in targets}}

    @app.get("/admin/usage")
    async def admin_usage(since: float | None = None, until: float | None = None) -> dict[str, Any]:
        if router.ledger is None:
            raise GatewayError(404, "No ledger is configured.")
        await router._ledger_q.join()  # rows of finished requests are in before we read
        rows = await asyncio.to_thread(router.ledger.summary, since, until)
        total = await asyncio.to_thread(router.ledger.totals, since, until)
        return {"since": since, "until": until, "rows": [r.as_dict() for r in rows], "total": total.as_dict()}

    return app

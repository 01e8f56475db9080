"""``create_app``: the ASGI app around an assembled :class:`~lmfleet.gateway.service.Gateway`.

It only wires: the request path of the OpenAI routes is :mod:`lmfleet.gateway.front.pipeline`, errors become HTTP
in :func:`lmfleet.gateway.front.errors.error_response`, the admin API is :mod:`lmfleet.gateway.admin.routes`,
the operator's other routes :mod:`lmfleet.gateway.admin.ops`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from lmfleet.config.models import GatewayConfig
from lmfleet.config.tenants import default_priority_classes
from lmfleet.gateway.admin.ops import ops_routes
from lmfleet.gateway.admin.profile import Profiler
from lmfleet.gateway.admin.routes import admin_routes, tenant_admin_for
from lmfleet.gateway.front.errors import GatewayError, error_response
from lmfleet.gateway.front.pipeline import HOT_ROUTES, Authenticator, AuthMiddleware, GatewayApp, OpenAIRoutes
from lmfleet.gateway.front.tenancy import TENANT_SCOPE_KEY, Tenancy
from lmfleet.gateway.service import Gateway
from lmfleet.tenants import Tenant
from lmfleet.tenants.keys import KeyFiles


def create_app(gw: Gateway, cfg: GatewayConfig | None = None, *,
               trusted_hosts: frozenset[str] | None = None) -> FastAPI:
    """The ASGI app around an assembled :class:`Gateway` (use :func:`lmfleet.gateway.build_gateway`).
    ``trusted_hosts``: the Host names it answers (None: any)."""
    cfg = cfg or GatewayConfig()
    tenant_admin = tenant_admin_for(gw)
    key_files = KeyFiles(gw.tenants)
    profiler = Profiler(gw)

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
    app.state.profiler = profiler

    async def _error(request: Request, e: Exception) -> JSONResponse:
        return error_response(e, method=request.method, path=request.url.path)

    for kind in (GatewayError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(kind, _error)

    auth = Authenticator(gw, trusted_hosts, cfg.metrics_public)
    classes = gw.router.tenants.classes if gw.router.tenants is not None else default_priority_classes()
    app.add_middleware(AuthMiddleware, auth=auth)
    # the two OpenAI routes are answered in front of FastAPI's stack (see front.pipeline); FastAPI answers the rest
    app.openai_routes = OpenAIRoutes(gw, cfg, auth, Tenancy(classes))
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

    app.include_router(ops_routes(gw))
    app.include_router(admin_routes(gw, cfg, tenant_admin, key_files, profiler))
    return app

"""The admin API: every ``/admin/*`` route (the admin key, checked by the authentication stage for the whole prefix).

    GET    /admin/state                  the running fleet's version; per model: load, estimate, mode, replicas;
                                         per provider: breaker
    POST   /admin/overflow               a model's (or every model's) overflow mode, threshold and policy, now
    GET    /admin/usage                  requests, tokens and cost per backend or per tenant, from the ledger;
                                         ?advise=1 rent or buy, ?estimate=1 the predicted wait's error
    GET    /admin/tenants                every tenant's settings and live usage
    PUT    /admin/tenants/{name}         change a tenant's limits, models or classes (every process, kept)
    DELETE /admin/tenants/{name}         back to its fleet.yaml settings
    POST   /admin/keys/reload            re-read every key file now
    GET    /admin/dashboard.json         the dashboard's data
    GET    /admin/profile/snapshot       histogram sums for the request anatomy (lmfleet profile)
    POST   /admin/profile/start, /stop   vLLM's profiler on every replica; stop gathers the trace files
    GET    /admin/profile/files/...      one gathered file

The routes of a subject live with it: :mod:`~lmfleet.gateway.admin.routing_api` (state, overflow),
:mod:`~lmfleet.gateway.admin.usage_api`, :mod:`~lmfleet.gateway.admin.tenants_api` (tenants, keys); the work
behind the dashboard and profiling routes is :mod:`~lmfleet.gateway.admin.dashboard` and
:mod:`~lmfleet.gateway.admin.profile`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, JSONResponse

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.admin.dashboard import DashboardHistory, dashboard_data
from lmfleet.gateway.admin.profile import Profiler
from lmfleet.gateway.admin.recent_errors import recent_errors
from lmfleet.gateway.admin.routing_api import routing_routes
from lmfleet.gateway.admin.tenants_api import tenant_admin_for, tenant_routes
from lmfleet.gateway.admin.usage_api import usage_routes
from lmfleet.gateway.front.access import read_json
from lmfleet.gateway.service import Gateway
from lmfleet.tenants.admin import TenantAdmin
from lmfleet.tenants.keys import KeyFiles

__all__ = ["admin_routes", "tenant_admin_for"]

PROFILE_BODY_TIMEOUT_S = 10.0


def admin_routes(gw: Gateway, cfg: GatewayConfig, tenant_admin: TenantAdmin | None, key_files: KeyFiles,
                 profiler: Profiler) -> APIRouter:
    """The routes above, for one gateway process."""
    r = APIRouter()
    r.include_router(routing_routes(gw, cfg))
    r.include_router(usage_routes(gw))
    r.include_router(tenant_routes(gw, cfg, tenant_admin, key_files))
    history = DashboardHistory()
    errors = recent_errors()
    # each calibration sample is judged against the threshold in force when it came (POST /admin/overflow changes it)
    gw.recorder.calibration.threshold_of = lambda n: gw.models[n].threshold_ms if n in gw.models else None

    # ---- dashboard and profiling -------------------------------------------------------------
    @r.get("/admin/dashboard.json")
    async def dashboard_json(since: float | None = None) -> JSONResponse:
        return await dashboard_data(gw, history, errors.entries(), since)

    @r.get("/admin/profile/snapshot")
    async def profile_snapshot() -> dict[str, Any]:
        return await profiler.snapshot()

    @r.post("/admin/profile/start")
    async def profile_start(request: Request) -> dict[str, Any]:
        return await profiler.start(await read_json(request, cfg.max_body_bytes, PROFILE_BODY_TIMEOUT_S))

    @r.post("/admin/profile/stop")
    async def profile_stop(request: Request) -> dict[str, Any]:
        return await profiler.stop(await read_json(request, cfg.max_body_bytes, PROFILE_BODY_TIMEOUT_S))

    @r.get("/admin/profile/files/{session}/{model}/{node}/{name}")
    async def profile_file(session: str, model: str, node: str, name: str) -> FileResponse:
        return profiler.file(session, model, node, name)

    return r

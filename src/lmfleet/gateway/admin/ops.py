"""The operator's routes outside /admin: liveness (/health), readiness (/ready), Prometheus metrics (/metrics) and
the dashboard's page (/dashboard). The admin API is :mod:`lmfleet.gateway.admin.routes`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from lmfleet.gateway.admin.dashboard import dashboard_routes
from lmfleet.gateway.front.access import operator_may_see
from lmfleet.gateway.service import Gateway
from lmfleet.overflow.engine_stats import ReplicaStats, imbalance


def routing_state(gw: Gateway, name: str, router: str) -> dict[str, Any]:
    """How requests spread over the model's replicas (docs/routing.md); figures as old as the last poll."""
    replicas = gw.served_replicas().get(name, {})
    total = sum(replicas.values(), ReplicaStats())
    rate = total.prefix_cache_hit_rate
    return {"request_router": router, "load_imbalance": imbalance(replicas),
            "prefix_cache_hit_rate": None if rate is None else round(rate, 4),
            "replicas": {rid: st.as_dict() for rid, st in sorted(replicas.items())}}


def ops_routes(gw: Gateway) -> APIRouter:
    """/health and a bare /ready (``{"ready": bool}`` + 200/503) are open; /ready's per-model detail (engine
    error texts) needs a key whenever keys are configured; /metrics is guarded in the auth middleware."""
    r = APIRouter()
    health = gw.health

    @r.get("/health")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @r.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        gw.publish_readiness()
        ok = health.all_ready()
        guard = gw.router.guard
        if guard is not None:
            guard.probe_if_due()  # load balancers poll /ready: a store that is back is noticed without traffic
        if not operator_may_see(request.headers, gw.api_keys, gw.admin_key):
            return JSONResponse({"ready": ok}, status_code=200 if ok else 503)
        models = {n: {"ready": h.ready, "degraded": h.degraded, "message": h.message,
                      "running_replicas": h.running_replicas} for n, h in health.models.items()}
        degraded = any(h.degraded for h in health.models.values())
        body: dict[str, Any] = {"ready": ok, "degraded": degraded, "models": models}
        if guard is not None:  # a budget store that is down closes paid providers; local traffic goes on
            store = guard.status()
            body["budget_store"] = {**store, "message": f"paid providers closed: {store['error']}"
                                    if not store["up"] else "ok"}
            body["degraded"] = degraded or not store["up"]
        ledger = gw.recorder.status()
        if ledger is not None:  # rows wait in memory, in order, while the ledger's database fails
            body["ledger"] = {**ledger, "message": "ok" if ledger["up"] else
                              f"ledger writes failing for {ledger['failing_for_s']} s; {ledger['pending_rows']} "
                              "rows wait in memory"}
            body["degraded"] = body["degraded"] or not ledger["up"]
        # 200 while every model can serve (a degraded fleet still takes traffic), 503 otherwise
        return JSONResponse(body, status_code=200 if ok else 503)

    @r.get("/metrics")
    async def prometheus() -> Response:
        gw.publish_gauges()
        return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    r.include_router(dashboard_routes())  # /dashboard (the page)
    return r

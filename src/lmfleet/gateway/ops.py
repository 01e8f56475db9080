"""The operator's routes: liveness, readiness, Prometheus metrics, the admin API (admin key) and the dashboard."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, get_args

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.access import operator_may_see, read_json
from lmfleet.gateway.dashboard import dashboard_routes
from lmfleet.gateway.errors import GatewayError
from lmfleet.gateway.service import Gateway
from lmfleet.overflow import OverflowMode
from lmfleet.overflow.engine_stats import ReplicaStats, imbalance
from lmfleet.store import Grouping
from lmfleet.store import StoreUnavailable

log = logging.getLogger("lmfleet.gateway")

USAGE_FLUSH_WAIT_S = 5.0
"""/admin/usage waits at most this long for finished requests' rows to reach the ledger before it reads."""


def ops_routes(gw: Gateway, cfg: GatewayConfig | None = None) -> APIRouter:
    """/health and a bare /ready (``{"ready": bool}`` + 200/503) are open; /ready's per-model detail (engine
    error texts) needs a key whenever keys are configured; /metrics is guarded in the auth middleware."""
    cfg = cfg or GatewayConfig()
    r = APIRouter()
    health, metrics = gw.health, gw.metrics

    def _publish_readiness() -> None:
        for n, h in health.models.items():
            metrics.model_ready.labels(n).set(1 if h.ready else 0)

    def _served_replicas() -> dict[str, dict[str, ReplicaStats]]:
        """The engine poller's latest per-replica figures, for the models this gateway serves."""
        table = gw.engine_stats.replicas if gw.engine_stats is not None else {}
        return {n: table[n] for n in gw.models if n in table}

    def _routing_state(name: str, router: str) -> dict[str, Any]:
        """How requests spread over the model's replicas (docs/routing.md); figures as old as the last poll."""
        replicas = _served_replicas().get(name, {})
        total = sum(replicas.values(), ReplicaStats())
        rate = total.prefix_cache_hit_rate
        return {"request_router": router, "load_imbalance": imbalance(replicas),
                "prefix_cache_hit_rate": None if rate is None else round(rate, 4),
                "replicas": {rid: st.as_dict() for rid, st in sorted(replicas.items())}}

    @r.get("/health")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @r.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        _publish_readiness()
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
        _publish_readiness()
        for n, m in gw.models.items():
            metrics.in_flight.labels(n, m.local.label).set(m.local.tracker.in_flight)
        for p in gw.providers.values():
            for n in p.cfg.model_map:
                metrics.in_flight.labels(n, p.label).set(p.in_flight)
        metrics.set_replicas(_served_replicas())
        gw.recorder.status()  # the ledger writer's backlog gauges
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @r.get("/admin/state")
    async def admin_state() -> dict[str, Any]:
        out: dict[str, Any] = {"models": {}, "providers": {}}
        for n, m in gw.models.items():
            s = m.local.tracker.snapshot()
            out["models"][n] = {
                "ready": health.is_ready(n), "health": health.models[n].message,
                "in_flight": s.in_flight, "capacity": m.app.capacity,
                "queued_estimate": max(0, s.in_flight - m.app.capacity),
                "queue_estimate_ms": round(gw.router.estimate(m, s), 1), "threshold_ms": m.threshold_ms,
                "mode": m.mode.value, "overflowing": m.hysteresis.overflowing, "drain_rps": s.drain_rps,
                "recent_ttft_s": s.ttft_s, "base_ttft_s": s.base_ttft_s,
                "engine_running": s.engine_running, "engine_waiting": s.engine_waiting,
                **_routing_state(n, m.app.cfg.deployment.request_router),
            }
        for n, p in gw.providers.items():
            out["providers"][n] = {"breaker": p.breaker.state().value, "in_flight": p.in_flight,
                                   "retry_after_s": round(p.breaker.retry_after_s(), 2)}
        return out

    @r.post("/admin/overflow")
    async def admin_overflow(request: Request) -> dict[str, Any]:
        body = await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s)
        name = body.get("model")
        targets = list(gw.models.values()) if name in (None, "*") else [gw.router.model_or_404(str(name))]
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

    @r.get("/admin/usage")
    async def admin_usage(since: float | None = None, until: float | None = None,
                          by: str = "served_by") -> dict[str, Any]:
        """Requests, tokens and cost per ``served_by`` or per ``tenant`` (rows without one: ``default``), read from
        the ledger (the fleet's shared PostgreSQL when ``ledger.url`` is set); 503 while that cannot be reached."""
        ledger = gw.recorder.ledger
        if ledger is None:
            raise GatewayError(404, "No ledger is configured.")
        if by not in get_args(Grouping):
            raise GatewayError(400, f"by must be one of {list(get_args(Grouping))}, got {by!r}", param="by")
        try:  # rows of finished requests are in before we read (bounded: the database may be down)
            await asyncio.wait_for(gw.recorder.flush(), USAGE_FLUSH_WAIT_S)
        except TimeoutError:
            log.warning("admin/usage: %d ledger rows still waiting to be written; reading without them",
                        gw.recorder.pending)
        try:
            rows = await asyncio.to_thread(ledger.summary, since, until, by)
            total = await asyncio.to_thread(ledger.totals, since, until, by)
        except StoreUnavailable as e:
            raise GatewayError(503, f"The ledger cannot be read now: {e}") from None
        return {"since": since, "until": until, "by": by, "rows": [row.as_dict() for row in rows],
                "total": total.as_dict()}

    r.include_router(dashboard_routes(gw))  # /dashboard (the page) and /admin/dashboard.json (its data)
    from lmfleet.profile.admin import profile_routes  # here: lmfleet.profile.admin imports the gateway's parts

    r.include_router(profile_routes(gw, max_body_bytes=cfg.max_body_bytes))  # /admin/profile/* (lmfleet profile)
    return r

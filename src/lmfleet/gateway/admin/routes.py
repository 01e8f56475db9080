"""The admin API: every ``/admin/*`` route (the admin key, checked by the authentication stage for the whole prefix).

    GET    /admin/state                  per model: load, estimate, mode, replicas; per provider: breaker
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

The work behind them lives with its subject: :mod:`~lmfleet.gateway.admin.dashboard`,
:mod:`~lmfleet.gateway.admin.profile`, :class:`~lmfleet.tenants.admin.TenantAdmin`,
:class:`~lmfleet.tenants.keys.KeyFiles`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, get_args

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, JSONResponse

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.admin.dashboard import DashboardHistory, dashboard_data
from lmfleet.gateway.admin.ops import routing_state
from lmfleet.gateway.admin.profile import Profiler
from lmfleet.gateway.admin.recent_errors import recent_errors
from lmfleet.gateway.front.access import read_json
from lmfleet.gateway.front.errors import GatewayError, error_body
from lmfleet.gateway.routing.router import ServedModel
from lmfleet.gateway.service import Gateway
from lmfleet.overflow import OverflowMode
from lmfleet.overflow.advise import advise as advise_rows
from lmfleet.overflow.advise import facts_from_rows, replica_hour_nusd
from lmfleet.overflow.estimate_error import estimate_errors, samples_from_rows
from lmfleet.overflow.policies import Policy, PolicyTimers
from lmfleet.store import Grouping, Ledger, SqliteSpendStore, StoreUnavailable
from lmfleet.tenants import TenantBook, TenantDirectory
from lmfleet.tenants.admin import TenantAdmin, TenantSettingsError
from lmfleet.tenants.keys import KeyFiles

log = logging.getLogger("lmfleet.gateway")

USAGE_FLUSH_WAIT_S = 5.0
"""/admin/usage waits at most this long for finished requests' rows to reach the ledger before it reads."""

PROFILE_BODY_TIMEOUT_S = 10.0


def admin_routes(gw: Gateway, cfg: GatewayConfig, tenant_admin: TenantAdmin | None, key_files: KeyFiles,
                 profiler: Profiler) -> APIRouter:
    """The routes above, for one gateway process."""
    r = APIRouter()
    history = DashboardHistory()
    errors = recent_errors()
    # each calibration sample is judged against the threshold in force when it came (POST /admin/overflow changes it)
    gw.recorder.calibration.threshold_of = lambda n: gw.models[n].threshold_ms if n in gw.models else None

    # ---- routing and spend ----------------------------------------------------------------------
    @r.get("/admin/state")
    async def admin_state() -> dict[str, Any]:
        out: dict[str, Any] = {"models": {}, "providers": {}}
        for n, m in gw.models.items():
            s = m.local.tracker.snapshot()
            out["models"][n] = {
                "ready": gw.health.is_ready(n), "health": gw.health.models[n].message,
                "in_flight": s.in_flight, "capacity": m.app.capacity,
                "queued_estimate": max(0, s.in_flight - m.app.capacity),
                "queue_estimate_ms": round(gw.router.estimate(m, s), 1), "threshold_ms": m.threshold_ms,
                "miss_margin_ms": round(m.margin.margin_ms(m.threshold_ms, idle=s.in_flight == 0), 1),
                "mode": m.mode.value, "overflowing": m.hysteresis.overflowing, "drain_rps": s.drain_rps,
                "recent_ttft_s": s.ttft_s, "base_ttft_s": s.base_ttft_s,
                "engine_running": s.engine_running, "engine_waiting": s.engine_waiting,
                "pending_prefill_tokens": s.pending_prefill_tokens,
                "prefill_ms_per_1k_tokens": (round(s.prefill_s_per_token * 1e6, 1)
                                             if s.prefill_s_per_token is not None else None),
                "base_prefill_tokens": s.base_prefill_tokens,
                "estimate_calibration": c.as_dict() if (c := gw.recorder.calibration.summary(n)) else None,
                **routing_state(gw, n, m.app.cfg.deployment.request_router),
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
            raise GatewayError(400, f"mode must be one of {[m.value for m in OverflowMode]}, got {mode!r}",
                               param="mode")
        thr = body.get("threshold_ms")
        if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or thr <= 0):
            raise GatewayError(400, f"threshold_ms must be a positive number, got {thr!r}", param="threshold_ms")
        timers = {m.name: _policy_timers(m, body) for m in targets}
        for m in targets:
            if mode is not None:
                m.mode = OverflowMode(mode)
            if thr is not None:
                m.threshold_ms = float(thr)
            m.timers = timers[m.name]
        log.info("admin: overflow for %s set to mode=%s threshold_ms=%s policy=%s", [m.name for m in targets], mode,
                 thr, body.get("policy"))
        return {"models": {m.name: {"mode": m.mode.value, "threshold_ms": m.threshold_ms,
                                    "policy": m.timers.policy.value, "ttft_timeout_ms": m.timers.ttft_timeout_ms,
                                    "hedge_after_ms": m.timers.hedge_after_ms} for m in targets}}

    def _policy_timers(m: ServedModel, body: dict[str, Any]) -> PolicyTimers:
        """``overflow.policy`` and its timers from the body (keys left out: as they are now); 400 when invalid."""
        if not {"policy", "ttft_timeout_ms", "hedge_after_ms"} & body.keys():
            return m.timers
        t = m.timers
        policy = body.get("policy", t.policy.value)
        if policy not in {p.value for p in Policy}:
            raise GatewayError(400, f"policy must be one of {[p.value for p in Policy]}, got {policy!r}",
                               param="policy")
        if policy != Policy.PREDICTIVE.value and not m.providers:
            raise GatewayError(400, f"policy {policy} needs a provider, and no provider maps {m.name!r}",
                               param="policy")
        try:
            return PolicyTimers(Policy(policy), body.get("ttft_timeout_ms", t.ttft_timeout_ms),
                                body.get("hedge_after_ms", t.hedge_after_ms))
        except (ValueError, TypeError) as e:
            raise GatewayError(400, str(e), param="policy") from None

    @r.get("/admin/usage")
    async def admin_usage(since: float | None = None, until: float | None = None,
                          by: str = "served_by", advise: bool = False, estimate: bool = False) -> dict[str, Any]:
        """Requests, tokens and cost per ``served_by`` or per ``tenant`` (rows without one: ``default``), read from
        the ledger (the fleet's shared PostgreSQL when ``ledger.url`` is set); 503 while that cannot be reached.
        ``advise=1``: rent or buy per model instead (``lmfleet usage --advise``); ``estimate=1``: the predicted
        local wait's error per model instead (``lmfleet usage --estimate``)."""
        ledger = gw.recorder.ledger
        if ledger is None:
            raise GatewayError(404, "No ledger is configured.")
        if by not in get_args(Grouping):
            raise GatewayError(400, f"by must be one of {list(get_args(Grouping))}, got {by!r}", param="by")
        if advise and estimate:
            raise GatewayError(400, "advise and estimate: choose one", param="estimate")
        try:  # rows of finished requests are in before we read (bounded: the database may be down)
            await asyncio.wait_for(gw.recorder.flush(), USAGE_FLUSH_WAIT_S)
        except TimeoutError:
            log.warning("admin/usage: %d ledger rows still waiting to be written; reading without them",
                        gw.recorder.pending)
        try:
            if advise or estimate:
                raw = await asyncio.to_thread(ledger.rows, since, until)
            else:
                rows = await asyncio.to_thread(ledger.summary, since, until, by)
                total = await asyncio.to_thread(ledger.totals, since, until, by)
        except StoreUnavailable as e:
            raise GatewayError(503, f"The ledger cannot be read now: {e}") from None
        if estimate:
            thresholds = {n: m.threshold_ms for n, m in gw.models.items()}
            errors = estimate_errors(samples_from_rows(raw), thresholds)
            return {"since": since, "until": until, "models": [e.as_dict(thresholds.get(e.model)) for e in errors]}
        if advise:
            hourly = {n: replica_hour_nusd(m.app.cfg, uses_gpus=m.app.device == "gpu") for n, m in gw.models.items()}
            window = (since, until if until is not None else time.time()) if since is not None else None
            advice = advise_rows(facts_from_rows(raw), hourly, window=window)
            return {"since": since, "until": until, "models": [a.as_dict() for a in advice]}
        return {"since": since, "until": until, "by": by, "rows": [row.as_dict() for row in rows],
                "total": total.as_dict()}

    # ---- tenants and keys --------------------------------------------------------------------
    @r.get("/admin/tenants")
    async def admin_tenants() -> dict[str, Any]:
        """Every tenant's settings and this process's live usage (admin key; no key or digest is shown)."""
        book = gw.router.tenants
        queues = {n: {"capacity": m.queue.capacity, "running": m.queue.running, "waiting": len(m.queue.waiting),
                      "peer_running": m.queue.peer_running, "share": m.queue.share}
                  for n, m in gw.models.items() if m.queue is not None}
        return {"classes": [c.model_dump() for c in book.classes] if book is not None else [],
                "tenants": tenant_report(gw.tenants, book, tenant_admin), "local_queues": queues}

    @r.put("/admin/tenants/{name}")
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

    @r.delete("/admin/tenants/{name}")
    async def admin_revert_tenant(name: str) -> dict[str, Any]:
        """Back to the tenant's settings in fleet.yaml (in every gateway process)."""
        admin = _admin_of(tenant_admin, name)
        try:
            await admin.revert(name)
        except StoreUnavailable as e:
            raise GatewayError(503, f"The tenant settings cannot be saved now (nothing changed): {e}") from None
        log.info("admin: tenant %s back to its fleet.yaml settings", name)
        return {"tenant": name, **tenant_report(gw.tenants, gw.router.tenants, admin)[name]}

    @r.post("/admin/keys/reload")
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


def tenant_admin_for(gw: Gateway) -> TenantAdmin | None:
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

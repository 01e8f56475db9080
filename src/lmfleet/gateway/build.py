"""``build_gateway``: the one way to assemble a gateway, used by ``lmfleet serve`` and by the tests.

    app = build_gateway(fleet, apps, serve_url="http://127.0.0.1:8001")     # a FastAPI app
    uvicorn.run(app, ...)                                                    # or httpx.ASGITransport(app)

Tests and benchmarks inject what would otherwise be I/O: ``fetch_status`` (Serve's status; None: every
model counts as ready), ``fetch_engine_metrics`` (Ray's metrics pages; None: no poller) and
``load_tokenizer``; backends are real HTTP servers (fakes in ``lmfleet.testing.gateway_fakes``).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI

from lmfleet.config.models import FleetConfig, GatewayConfig
from lmfleet.config.tenants import PriorityClass, TenantConfig, default_priority_classes
from lmfleet.engine.app import ModelApp, gateway_model_apps
from lmfleet.gateway.front.access import GatewayConfigError, allowed_hosts, check_exposure, load_keys_from
from lmfleet.gateway.app import create_app
from lmfleet.gateway.routing.backends import LocalBackend, ProviderBackend
from lmfleet.gateway.routing.health import HealthBoard
from lmfleet.gateway.routing.live import NewModels, RunningCapacity
from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.gateway.routing.pollers import EngineStatsPoller
from lmfleet.gateway.routing.router import Router
from lmfleet.gateway.routing.served import ServedModel
from lmfleet.gateway.routing.budget import BudgetGuard
from lmfleet.gateway.observe.recorder import Recorder
from lmfleet.gateway.service import Gateway
from lmfleet.gateway.observe.loopwatch import LoopWatch
from lmfleet.gateway.core.tokens import load_tokenizer_or_none
from lmfleet.gateway.observe.tracing import request_tracer
from lmfleet.gateway.relay.upstream import HttpPool
from lmfleet.overflow import LoadTracker, LocalCostMeter, providers_for
from lmfleet.overflow.margin import MissMargin
from lmfleet.overflow.policies import PolicyTimers
from lmfleet.store import (
    Cap,
    SpendStore,
    SpendStoreError,
    SqlLedger,
    StoreUnavailable,
    caps_for_budget,
    open_ledger,
    open_spend_store,
)
from lmfleet.store import describe as describe_ledger
from lmfleet.overflow.estimator import local_capacity
from lmfleet.tenants import TenantBook, TenantDirectory, TenantKeyError
from lmfleet.tenants.queue import DispatchQueue
from lmfleet.tenants.shared import SharedLimits

log = logging.getLogger("lmfleet.gateway")

__all__ = ["GatewayConfigError", "build_gateway", "check_gateway_access", "check_ledger", "load_api_keys",
           "load_tenants", "preflight"]


def load_api_keys(cfg: GatewayConfig, environ: Mapping[str, str]) -> frozenset[str]:
    """Client API keys from the configured env var and/or file. Empty only when neither is configured; a
    configured source that yields no key raises :class:`GatewayConfigError` (auth never turns off silently)."""
    return load_keys_from(cfg.api_keys_env, cfg.api_keys_file, environ)


def check_gateway_access(cfg: GatewayConfig, host: str | None = None,
                         environ: Mapping[str, str] | None = None, *, tenants: Sequence[TenantConfig] = (),
                         classes: Sequence[PriorityClass] | None = None) -> frozenset[str]:
    """The flat client keys, after refusing settings that would leave the gateway open by accident (raises
    :class:`GatewayConfigError`, one line). ``host``: the effective listen address (``--host``), default
    ``cfg.host``. ``tenants``: their keys are loaded too (a source that yields none is refused) and count as
    client keys. Cheap: ``lmfleet serve`` can call it before deploying anything."""
    environ = os.environ if environ is None else environ
    keys = load_api_keys(cfg, environ)
    has_keys = bool(keys)
    if tenants:
        has_keys = not load_tenants(cfg, tenants, classes, environ).is_open
    check_exposure(host or cfg.host, has_keys, cfg.allow_unauthenticated)
    return keys


def load_tenants(cfg: GatewayConfig, tenants: Sequence[TenantConfig], classes: Sequence[PriorityClass] | None,
                 environ: Mapping[str, str]) -> TenantDirectory:
    """Every tenant with its keys (held as digests), the flat ``cfg.api_keys_*`` keys as tenant ``default``.
    Raises :class:`GatewayConfigError` (one line, naming the config key and variable or file, never a key)."""
    try:
        return TenantDirectory.build(tenants, classes or default_priority_classes(), gateway=cfg, environ=environ)
    except (TenantKeyError, ValueError) as e:
        raise GatewayConfigError(str(e)) from None


def preflight(fleet: FleetConfig, host: str | None = None, environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Everything that would stop :func:`build_gateway`, checked in a moment (``lmfleet serve`` runs it before
    deploying anything): auth and exposure (:func:`check_gateway_access`). Returns the client keys. The ledger's
    database is :func:`check_ledger`'s (it connects)."""
    return check_gateway_access(fleet.gateway, host, environ, tenants=fleet.tenants, classes=fleet.priority_classes)


def _open_ledger(fleet: FleetConfig, environ: Mapping[str, str]) -> tuple[SqlLedger, SpendStore | None, list[Cap]]:
    """The ledger (PostgreSQL at ``ledger.url``, else the SQLite file at ``ledger.path``) and, when caps are
    configured (the fleet's ``budget:`` or a tenant's ``hourly_usd``/``daily_usd``), the spend store in the same
    database. Raises :class:`StoreUnavailable` (one line) when a database
    cannot be reached or opened, :class:`GatewayConfigError` on settings it cannot use."""
    try:
        ledger = open_ledger(fleet.ledger, environ)
    except (OSError, sqlite3.Error) as e:
        raise StoreUnavailable(f"ledger database {describe_ledger(fleet.ledger)}: {e}") from None
    except StoreUnavailable:
        raise
    except SpendStoreError as e:
        raise GatewayConfigError(f"ledger: {e}") from None
    caps = caps_for_budget(fleet.budget)
    tenant_caps = any(t.limits.hourly_usd is not None or t.limits.daily_usd is not None for t in fleet.tenants)
    try:
        store = open_spend_store(fleet.ledger, environ=environ) if caps or tenant_caps else None
    except StoreUnavailable:
        ledger.close()
        raise
    except SpendStoreError as e:
        ledger.close()
        raise GatewayConfigError(f"ledger: {e}") from None
    return ledger, store, caps


def check_ledger(fleet: FleetConfig, environ: Mapping[str, str] | None = None) -> None:
    """Open the ledger (and the spend store) once and close them: a database that cannot be reached at start
    fails in seconds (:class:`StoreUnavailable`, one line; the CLI exits 1) instead of after the deploy."""
    ledger, store, _ = _open_ledger(fleet, os.environ if environ is None else environ)
    ledger.close()
    if store is not None:
        store.close()


def _tokenizer(app: ModelApp) -> Any | None:
    return load_tokenizer_or_none(app.tokenizer_path, trust_remote_code=app.cfg.engine.trust_remote_code)


def _queue_slots(app: ModelApp) -> int:
    """Local slots the priority queue hands out: what the deployment may run at once at its largest (with
    autoscaling, its max_replicas), so the queue never holds back demand Serve's autoscaler must see; beyond
    that, Serve's own FIFO queue waits."""
    auto = app.cfg.deployment.autoscaling
    return max(app.capacity, local_capacity(app.cfg, auto.max_replicas)) if auto is not None else app.capacity


def _shared_tenant_limits(fleet: FleetConfig, apps: list[ModelApp], store: SpendStore | None,
                          environ: Mapping[str, str]) -> SharedLimits | None:
    """Tenant rate/concurrency limits shared through the spend store's database (docs/tenants.md), when there is
    something to share: a tenant with such a limit and several gateway processes (``gateway.workers``) or nodes
    (``ledger.url``). One process alone keeps them in memory (no database call on its path). ``store``: the spend
    store already open (None: one is opened here)."""
    limited = any(t.limits.requests_per_minute or t.limits.tokens_per_minute or t.limits.max_concurrency
                  for t in fleet.tenants)
    if not limited or (fleet.gateway.workers == 1 and fleet.ledger.url is None):
        return None
    if store is None:
        try:
            store = open_spend_store(fleet.ledger, environ=environ)
        except SpendStoreError as e:  # unreachable at start: like the ledger, fail the start (one line)
            if isinstance(e, StoreUnavailable):
                raise
            raise GatewayConfigError(f"ledger: {e}") from None
    # a slot counts no longer than its request can live: the longest wait in the local queue plus the timeout
    longest_s = (max((a.cfg.deployment.request_timeout_s for a in apps), default=600.0)
                 + max((c.max_wait_s or 0.0 for c in fleet.priority_classes), default=0.0))
    return SharedLimits(store, slot_ttl_s=longest_s + 60.0, workers=fleet.gateway.workers)  # type: ignore[arg-type]


def build_gateway(fleet: FleetConfig, apps: list[ModelApp], *, serve_url: str, host: str | None = None,
                  environ: Mapping[str, str] | None = None,
                  fetch_status: Callable[[], dict[str, Any]] | None = None,
                  fetch_engine_metrics: Callable[[], list[str]] | None = None,
                  load_tokenizer: Callable[[ModelApp], Any | None] = _tokenizer) -> FastAPI:
    """Assemble the gateway for ``apps`` (the fleet's resolved models) served behind ``serve_url``.

    ``host``: the address it will listen on (default ``gateway.host``), for the exposure check and the trusted
    Host names. Raises :class:`GatewayConfigError` on settings that would leave it open (see
    :func:`check_gateway_access`), :class:`StoreUnavailable` when the ledger's database cannot be reached.
    """
    environ = os.environ if environ is None else environ
    host = host or fleet.gateway.host
    preflight(fleet, host, environ)
    tenants = load_tenants(fleet.gateway, fleet.tenants, fleet.priority_classes, environ)
    metrics = GatewayMetrics()
    health = HealthBoard({a.name: a.app_name for a in apps}, fetch_status, fleet.gateway.health_poll_s)
    ledger, store, caps = _open_ledger(fleet, environ)
    names = {a.name for a in apps}  # the recorder's metric labels: a model added live joins them
    recorder = Recorder(metrics, ledger, names, store)
    budget = BudgetGuard(store, caps, recorder.submit, metrics=metrics) if store is not None else None

    providers: dict[str, ProviderBackend] = {}
    for p in fleet.providers:
        providers[p.name] = ProviderBackend.from_config(p, environ, budget)

    # one keep-alive pool to Serve's HTTP front for every model, sized to the fleet (excess waits for a connection)
    local_client = HttpPool(max_connections=max(256, 4 * sum(a.capacity for a in apps)), connect_timeout_s=5.0)
    def served(a: ModelApp, tokenizer: Any | None, backends: list[ProviderBackend]) -> ServedModel:
        c = a.cfg
        names.add(a.name)
        tracker = LoadTracker(a.capacity, window_s=c.overflow.signal_window_s)
        meter = LocalCostMeter(a.hourly_cost_usd, window_s=c.cost.attribution_window_s,
                               min_tokens_per_hour=c.cost.min_output_tokens_per_hour)
        return ServedModel(
            app=a, tokenizer=tokenizer, local=LocalBackend(c, a.base_url(serve_url), local_client, tracker, health, meter),
            providers=backends, threshold_ms=a.threshold_ms,
            queue=DispatchQueue(_queue_slots(a)) if fleet.tenants else None,
            timers=PolicyTimers.from_config(c.overflow),
            margin=MissMargin(c.overflow.miss_quantile, c.overflow.miss_floor), prefill_gate=c.overflow.prefill_gate)

    models: dict[str, ServedModel] = {
        a.name: served(a, load_tokenizer(a), [providers[p.name] for p in providers_for(a.cfg, fleet.providers)])
        for a in apps}

    health.on_refresh = RunningCapacity(models, health).update  # a rollout's missing replicas count as busy
    engine_stats = None
    if fetch_engine_metrics is not None and fleet.gateway.engine_metrics_poll_s > 0:
        engine_stats = EngineStatsPoller({n: m.local.tracker for n, m in models.items()}, fetch_engine_metrics,
                                         fleet.gateway.engine_metrics_poll_s)
    admin_key = environ.get(fleet.gateway.admin_key_env) if fleet.gateway.admin_key_env else None
    shared = _shared_tenant_limits(fleet, apps, store, environ)
    if shared is not None and recorder.store is None:
        recorder.store = shared.store  # opened for the tenant limits alone: closed with the ledger at shutdown
    book = TenantBook(tenants, fleet.priority_classes, shared=shared)
    gw = Gateway(router=Router(models, fleet.budget, ledger, metrics, guard=budget, tenants=book),
                 recorder=recorder, health=health, metrics=metrics, providers=providers,
                 clients=[local_client, *(p.client for p in providers.values())],
                 tenants=tenants, admin_key=admin_key or None,
                 engine_stats=engine_stats, tracer=request_tracer(fleet.observability),
                 loopwatch=LoopWatch(stall_ms=fleet.gateway.loop_stall_warn_ms, observe=metrics.loop_lag.observe))
    gw.new_model = NewModels(lambda f: [(a, load_tokenizer(a)) for a in gateway_model_apps(f, progress=log.info)],
                             served)
    trusted = allowed_hosts(host, fleet.gateway.allowed_hosts)
    if trusted is None and fleet.gateway.allowed_hosts is None:
        log.info("gateway: listening on %s, so every Host header is accepted; set gateway.allowed_hosts to "
                 "restrict them", host)
    return create_app(gw, fleet.gateway, trusted_hosts=trusted)

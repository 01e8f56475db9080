"""A running gateway takes a new version of the fleet (``lmfleet apply``): the changes
:func:`lmfleet.config.diff.applies_live` accepts, swapped in without disturbing a request.

What "a request finishes under the settings it was admitted with" rests on:

* a provider whose settings change becomes a new :class:`~lmfleet.gateway.routing.backends.ProviderBackend`:
  :meth:`~lmfleet.gateway.routing.backends.ProviderBackend.with_config` (same pool, breaker, budget, key) when
  only prices, timeouts, retries, backoff or its model map change, else one of its own, as an added provider
  gets; a request's plan holds the backends it was routed to, so it keeps the old one (a removed provider
  included): its timeouts, retries, budget reservation and price (the ledger's cost) are those in force when it
  was admitted;
* the budget (its caps, ``on_exhausted``) is replaced by one assignment each in the router and the spend guard;
  a reservation already held stays;
* a model's provider list is replaced by one assignment, as are its threshold, its policy timers, its prefill
  gate setting, its miss floor and its overflow section (``enabled``, ``hysteresis``, the cold-start figures: read
  by the router at admission); a request run copies the timers and the threshold when it starts
  (:class:`~lmfleet.gateway.relay.run.RequestRun`).

Values the operator changed at run time (``POST /admin/overflow``) stay unless the new version changes that key.

A kept tenant's settings (limits, models, classes) go through the process's tenant admin, as ``PUT
/admin/tenants/NAME`` does; a tenant an operator set at run time keeps those settings until they are reverted (to
the new version's). A model's new deployment or engine section (the ``lmfleet serve`` process redeploys it) sets
the capacity counted (:func:`serving_record`).

:class:`RunningCapacity`: while a model runs fewer replicas than configured (its engines being replaced, a node
lost), its capacity counts only the running ones (:func:`lmfleet.overflow.estimator.serving_capacity`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lmfleet.config.diff import Change, applies_live, diff_fleets
from lmfleet.config.models import FleetConfig, ModelConfig, ProviderConfig
from lmfleet.gateway.routing.backends import ProviderBackend
from lmfleet.gateway.routing.health import HealthBoard
from lmfleet.gateway.routing.router import Router
from lmfleet.engine.app import ModelApp
from lmfleet.gateway.routing.served import ServedModel
from lmfleet.gateway.relay.upstream import HttpPool
from lmfleet.overflow import providers_for
from lmfleet.overflow.cost import local_hourly_cost_usd
from lmfleet.overflow.estimator import local_capacity, serving_capacity
from lmfleet.overflow.policies import PolicyTimers
from lmfleet.store import caps_for_budget
from lmfleet.tenants import Tenant
from lmfleet.tenants.admin import settings_of

log = logging.getLogger("lmfleet.gateway")

_TIMER_KEYS = ("policy", "ttft_timeout_ms", "hedge_after_ms")


def _same_transport(a: ProviderConfig, b: ProviderConfig) -> bool:
    """Whether ``b`` can reuse ``a``'s connection pool, breaker and key (:meth:`ProviderBackend.with_config`):
    the same endpoint, dialect, key variable, pool size, connect timeout and breaker thresholds."""
    def transport(c: ProviderConfig) -> tuple:
        breaker = c.breaker.model_dump(exclude={"backoff_base_s", "backoff_cap_s"})
        return c.base_url, c.dialect, c.api_key_env, c.max_concurrency, c.timeouts.connect_s, breaker
    return transport(a) == transport(b)


@dataclass(frozen=True)
class Taken:
    """What one new version did to this gateway process."""

    applied: list[Change]
    ignored: list[Change]
    """Changes this process cannot take live (``lmfleet apply`` refuses them; a process started from another
    file than the running fleet's can see some): they wait for a restart."""


@dataclass(frozen=True)
class NewModels:
    """How this process serves a model a new version adds: ``prepare`` resolves the models of a fleet into their
    records and tokenizers (blocking: weights may be built, a tokenizer read; run in a worker thread), ``make``
    builds the served model from one with its provider backends (on the event loop)."""

    prepare: Callable[[FleetConfig], list[tuple[ModelApp, Any]]]
    make: Callable[[ModelApp, Any, list[ProviderBackend]], ServedModel]


class LiveFleet:
    """The fleet this gateway process runs under, and the swap to a new version."""

    def __init__(self, fleet: FleetConfig, router: Router, providers: dict[str, ProviderBackend],
                 clients: list[HttpPool], environ: Mapping[str, str] | None = None,
                 tenant_admin: Any | None = None, health: HealthBoard | None = None,
                 new_models: NewModels | None = None) -> None:
        self.fleet = fleet
        self._router = router
        self._models = router.models
        self._providers = providers
        self._clients = clients
        """The gateway's connection pools (closed at shutdown): a new provider's pool joins them."""
        self._environ = os.environ if environ is None else environ
        self._tenant_admin = tenant_admin
        """The process's :class:`~lmfleet.tenants.admin.TenantAdmin` (None: no tenants): a kept tenant's new
        settings go through it, as a ``PUT /admin/tenants/NAME`` does."""
        self._health = health
        self._new_models = new_models

    async def take_version(self, new: FleetConfig) -> Taken:
        """:meth:`take`, the models ``new`` adds prepared first in a worker thread."""
        added = [m for m in new.models if m.name not in self._models]
        prepared: list[tuple[ModelApp, Any]] = []
        if added and self._new_models is not None:
            try:
                prepared = await asyncio.to_thread(self._new_models.prepare, new.model_copy(update={"models": added}))
            except Exception as e:  # noqa: BLE001 - the version's other changes still apply here
                log.error("gateway: cannot serve the models %s a new version adds (%s); the other changes apply",
                          [m.name for m in added], e)
        return self.take(new, prepared)

    def take(self, new: FleetConfig, prepared: list[tuple[ModelApp, Any]] | None = None) -> Taken:
        """Swap in ``new``'s live keys; returns what changed and what could not. ``prepared``: the added models'
        records and tokenizers (:meth:`take_version`); an added model without one is left out here."""
        changes = diff_fleets(self.fleet, new)
        ready = {a.name for a, _ in prepared or ()}
        can = [c for c in changes if applies_live(c, self.fleet)
               and not (c.cost == "new model" and _item_name(c.path) not in ready)]
        applied = [c for c in changes if c in can]
        ignored = [c for c in changes if c not in can]
        if applied:
            self._swap(self.fleet, new)
            self._add_remove(new, [p for p in prepared or () if p[0].name in ready])
        self.fleet = new
        if ignored:
            log.warning("gateway: the running fleet's new version changes keys this process takes only at a "
                        "restart: %s", ", ".join(c.path for c in ignored))
        return Taken(applied, ignored)

    def _swap(self, old: FleetConfig, new: FleetConfig) -> None:
        if new.budget != old.budget:  # the router reads it at admission; the guard's caps at each reservation
            self._router.budget = new.budget
            if self._router.guard is not None:
                self._router.guard.caps = caps_for_budget(new.budget)
        if self._tenant_admin is not None and new.tenants != old.tenants:
            self._swap_tenants(old, new)
        fresh: dict[str, ProviderBackend] = {}
        for cfg in new.providers:
            backend = self._providers.get(cfg.name)
            if backend is None or not _same_transport(backend.cfg, cfg):
                backend = ProviderBackend.from_config(cfg, self._environ, self._router.guard)
                self._clients.append(backend.client)
            elif backend.cfg != cfg:
                backend = backend.with_config(cfg)
            fresh[cfg.name] = backend
        for name in [n for n in self._providers if n not in fresh]:
            del self._providers[name]  # requests routed to it keep it until they finish
        self._providers.update(fresh)
        for name, m in self._models.items():
            before, after = old.model(name), new.model(name)
            if before is None or after is None:
                continue
            m.providers = [fresh[p.name] for p in providers_for(after, new.providers)]
            o, n = before.overflow, after.overflow
            if n != o:  # the router reads enabled, hysteresis and the cold-start figures from here at admission
                m.app = replace(m.app, cfg=m.app.cfg.model_copy(update={"overflow": n}))
            if (before.deployment, before.engine) != (after.deployment, after.engine):
                m.app = serving_record(m.app, after)  # RunningCapacity counts the new capacity at the next poll
            if n.threshold_ms != o.threshold_ms:
                m.threshold_ms = n.threshold_ms
            if any(getattr(n, k) != getattr(o, k) for k in _TIMER_KEYS):
                m.timers = PolicyTimers.from_config(n)
            if n.prefill_gate != o.prefill_gate:
                m.prefill_gate = n.prefill_gate
            if n.miss_floor != o.miss_floor:
                m.margin.floor = n.miss_floor

    def _swap_tenants(self, old: FleetConfig, new: FleetConfig) -> None:
        """Each kept tenant's new settings: what a reverted run-time setting goes back to, and in force unless an
        operator's run-time setting (``PUT /admin/tenants/NAME``) holds the tenant."""
        admin = self._tenant_admin
        before = {t.name: t for t in old.tenants}
        for t in new.tenants:
            if t.name not in admin.directory.tenants or before.get(t.name) == t:
                continue
            settings = settings_of(Tenant.from_config(t, admin.book.classes))
            admin.file[t.name] = settings
            if t.name not in admin.overrides:
                admin.apply(t.name, settings)


    def _add_remove(self, new: FleetConfig, prepared: list[tuple[ModelApp, Any]]) -> None:
        """Models removed stop taking requests (those admitted finish: they hold their model); models added are
        served, not ready until Serve runs a replica of theirs (their requests go to providers meanwhile)."""
        for name in [n for n in self._models if new.model(n) is None]:
            del self._models[name]
            if self._health is not None:
                self._health.forget(name)
        for app, tokenizer in prepared:
            if app.name in self._models or self._new_models is None:
                continue
            backends = [self._providers[p.name] for p in providers_for(app.cfg, new.providers)]
            self._models[app.name] = self._new_models.make(app, tokenizer, backends)
            if self._health is not None:
                self._health.watch(app.name, app.app_name)


def _item_name(path: str) -> str:
    """``models[tiny]`` -> ``tiny``."""
    return path[path.index("[") + 1:-1]


def serving_record(app: ModelApp, model: ModelConfig) -> ModelApp:
    """``app`` after a new version changed the model's deployment or engine section (``lmfleet serve`` redeploys
    it): the configuration the capacity and the hourly cost are counted from, the context length."""
    cfg = app.cfg.model_copy(update={"deployment": model.deployment, "engine": model.engine})
    return replace(app, cfg=cfg, max_model_len=model.engine.max_model_len or app.max_model_len,
                   hourly_cost_usd=local_hourly_cost_usd(cfg, uses_gpus=app.device == "gpu"))


class RunningCapacity:
    """Each model's capacity (``ModelApp.capacity`` and its load tracker's) follows its running replicas, as
    Serve's status reports them to ``health``, and its configuration (a new version's replicas or engine
    options: :func:`serving_record`); call :meth:`update` after each refresh. A model with no replica running or
    finishing requests (``replicaless``) moves its local requests waiting in Serve's queue to a provider
    (:mod:`lmfleet.gateway.relay.replicaless`)."""

    def __init__(self, models: dict[str, ServedModel], health: HealthBoard) -> None:
        self._models = models
        self._health = health
        self._full = {name: (m.app.cfg, m.app.capacity) for name, m in models.items()}
        """Model -> (the configuration its full capacity was counted from, that capacity)."""

    def full(self, name: str, m: ServedModel) -> int:
        cfg, full = self._full.setdefault(name, (m.app.cfg, m.app.capacity))  # a model added live: its own
        if (cfg.deployment, cfg.engine) != (m.app.cfg.deployment, m.app.cfg.engine):
            full = local_capacity(m.app.cfg)
            self._full[name] = (m.app.cfg, full)
        return full

    def update(self) -> None:
        for name, m in self._models.items():
            h = self._health.models.get(name)
            capacity = serving_capacity(m.app.cfg, self.full(name, m), h.running_replicas if h is not None else 0)
            if capacity != m.app.capacity:
                log.info("gateway: model %s: capacity %d -> %d (%d replicas running)", name, m.app.capacity,
                         capacity, h.running_replicas if h is not None else 0)
                m.app = replace(m.app, capacity=capacity)
                m.local.tracker.capacity = capacity
            if h is not None:
                m.local.gate.limit = h.running_replicas  # one prompt before its first token per replica (>= 1)
            if h is not None and h.replicaless and (moved := m.local.waiting.release()):
                log.warning("gateway: model %s has no replica running or finishing requests: %d local requests "
                            "waiting in Serve's queue move to a provider", name, moved)

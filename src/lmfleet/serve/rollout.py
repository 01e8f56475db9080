"""Serve-side changes of a new fleet version, carried out by the ``lmfleet serve`` process (``lmfleet apply``).

``lmfleet apply`` stores the new version in the cluster (:mod:`lmfleet.cluster.fleet_store`); every gateway takes
its settings, and the ``lmfleet serve`` process that deployed the models, which follows the same version, redeploys
the application of each model whose Serve or engine keys changed (:data:`lmfleet.config.diff.SERVE_APPLIED`). That
process holds what a deploy needs (Ray Serve LLM imported with the proxy switches of the running fleet, the
models' weights resolved), so ``apply`` itself stays a quick command on any node.

Each redeploy is an ordinary Serve redeploy of the model's application, whose deployments carry a ``version``
derived from what the engines are built from (:func:`lmfleet.config.diff.engine_fingerprint`):

* ``in place`` (replicas, autoscaling bounds, ``max_ongoing_requests``, the router): the version is unchanged, so
  Serve adds or stops replicas and reconfigures the running ones; no engine restarts;
* ``replica replacement`` (an engine option, the source, the placement): a new version, so Serve replaces the
  replicas one at a time (``rolling_update_percentage``, :data:`lmfleet.engine.app.ROLLING_UPDATE_FRACTION`): each
  old replica stops taking requests, finishes those in flight, and its successor starts. Meanwhile the gateways
  count only the running replicas (:func:`lmfleet.overflow.estimator.serving_capacity`), so requests over the
  threshold spill, and a model with no replica running goes to its providers (``local_unavailable``);
* ``new model``: its application is deployed; the gateways serve the model at once, not ready (its requests go to
  its providers) until a replica runs;
* ``model removed``: the gateways stop admitting its requests when they take the version; once they all have
  (:data:`DRAIN_GRACE_S`) and its requests in flight ended (this process's and its peers', at most its
  ``request_timeout_s``, :data:`MAX_DRAIN_S`), its application is deleted (Serve stops each replica gracefully).

:func:`rollout_plan` is the pure part: which models to deploy, at what cost.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from lmfleet.config.diff import COSTS, SERVE_APPLIED, Change, Cost, diff_fleets
from lmfleet.config.models import FleetConfig

__all__ = ["ServeFollower", "rollout_plan"]

log = logging.getLogger("lmfleet.serve")

_MODEL = re.compile(r"^models\[(?P<name>.+?)\](\.|$)")

DRAIN_GRACE_S = 4.0
"""Before a removed model's application is deleted: every gateway process has read the version and stopped
admitting its requests (twice the gateways' poll, :data:`lmfleet.gateway.routing.fleet_watch.FLEET_POLL_S`; not
imported: ``lmfleet apply`` imports this module and must not pay for the gateway's imports)."""
MAX_DRAIN_S = 600.0
"""The longest wait for a removed model's requests in flight (its ``request_timeout_s`` when shorter)."""


def rollout_plan(changes: list[Change]) -> dict[str, Cost]:
    """Model name -> the dearest Serve-side cost among ``changes`` of that model (``in place``, ``replica
    replacement``, ``new model``, ``model removed``), in file order; models with only gateway changes are left
    out."""
    plan: dict[str, Cost] = {}
    for c in changes:
        m = _MODEL.match(c.path)
        if m is None or (c.schema_path not in SERVE_APPLIED and c.schema_path != "models[]"):
            continue
        name = m.group("name")
        if name not in plan or COSTS.index(c.cost) > COSTS.index(plan[name]):
            plan[name] = c.cost
    return plan


def describe(plan: dict[str, Cost]) -> str:
    """One line for the terminal: ``tiny (in place), smollm2 (replica replacement)``."""
    return ", ".join(f"{name} ({cost})" for name, cost in plan.items())


class ServeFollower:
    """In the ``lmfleet serve`` process: redeploy the models a new stored version changes (:func:`rollout_plan`).

    ``build``: the models of a fleet as deployable records (:func:`lmfleet.engine.app.build_model_apps`);
    ``deploy``: hands them to Serve without waiting for them to run (:func:`lmfleet.serve.runner.deploy`). Both
    block, and run in a worker thread. A redeploy Serve refuses is logged; the fleet it was computed from is kept
    as deployed (a retry of the same file would be refused again)."""

    def __init__(self, fleet: FleetConfig, build: Callable[[FleetConfig], list[Any]],
                 deploy: Callable[[list[Any]], None], progress: Callable[[str], None] = print, *,
                 delete: Callable[[list[str]], None] | None = None, models: Mapping[str, Any] | None = None,
                 drain_grace_s: float = DRAIN_GRACE_S) -> None:
        self.fleet = fleet
        self._build = build
        self._deploy = deploy
        self._progress = progress
        self._delete = delete
        """Deletes Serve applications by name (``serve.delete``); None: models are not removed."""
        self._models = models
        """The gateway's served models (``.local.tracker``): a removed model's requests in flight, this process's
        and its peers', are counted from its tracker."""
        self._trackers: dict[str, Any] = {}
        self._drain_grace_s = drain_grace_s
        self.deployed_version: int | None = None
        self.removals: list[asyncio.Task] = []
        self._note_trackers()

    def _note_trackers(self) -> None:
        for name, m in (self._models or {}).items():
            self._trackers[name] = m.local.tracker

    def in_flight(self, name: str) -> int:
        tracker = self._trackers.get(name)
        return tracker.snapshot().in_flight if tracker is not None else 0

    async def follow(self, version: int, fleet: FleetConfig) -> dict[str, Cost]:
        """Redeploy what ``fleet`` (stored as ``version``) changes from the fleet deployed, start removing the
        models it removes; returns the plan."""
        old = self.fleet
        plan = rollout_plan(diff_fleets(old, fleet))
        self.fleet = fleet
        deploy = [name for name, cost in plan.items() if cost != "model removed"]
        removed = [name for name, cost in plan.items() if cost == "model removed"]
        if plan:
            self._progress(f"lmfleet: version {version} of the running fleet: deploying {describe(plan)}")
        if deploy:
            subset = fleet.model_copy(update={"models": [m for m in fleet.models if m.name in deploy]})
            try:
                apps = await asyncio.to_thread(self._build, subset)
                await asyncio.to_thread(self._deploy, apps)
            except Exception as e:  # noqa: BLE001 - a refused redeploy must not stop the gateway of this process
                log.error("lmfleet: version %d: the redeploy of %s failed: %s", version, describe(plan), e)
                self._progress(f"lmfleet: error: version {version}: the redeploy of {describe(plan)} failed: {e}")
                return plan
        if removed and self._delete is not None:
            bound = min(MAX_DRAIN_S, max(old.model(n).deployment.request_timeout_s for n in removed))
            self.removals.append(asyncio.create_task(self._remove(version, removed, bound)))
        self._note_trackers()
        self.deployed_version = version
        return plan

    async def _remove(self, version: int, names: list[str], bound_s: float) -> None:
        """Once every gateway stopped admitting them (:data:`DRAIN_GRACE_S`) and their requests in flight ended
        (at most ``bound_s``), delete the models' applications."""
        await asyncio.sleep(self._drain_grace_s)
        deadline = time.monotonic() + bound_s
        while any(self.in_flight(n) > 0 for n in names) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        left = {n: self.in_flight(n) for n in names if self.in_flight(n) > 0}
        if left:
            log.warning("lmfleet: version %d: deleting %s with requests still in flight after %.0f s: %s", version,
                        names, bound_s, left)
        from lmfleet.engine.app import model_app_name

        try:
            await asyncio.to_thread(self._delete, [model_app_name(n) for n in names])
        except Exception as e:  # noqa: BLE001
            self._progress(f"lmfleet: error: version {version}: deleting {names} failed: {e}")
            return
        for n in names:
            self._trackers.pop(n, None)
        self._progress(f"lmfleet: version {version}: removed {', '.join(names)}")

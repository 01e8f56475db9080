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
  threshold spill, and a model with no replica running goes to its providers (``local_unavailable``).

:func:`rollout_plan` is the pure part: which models to redeploy, at what cost.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from lmfleet.config.diff import COSTS, SERVE_APPLIED, Change, Cost, diff_fleets
from lmfleet.config.models import FleetConfig

__all__ = ["ServeFollower", "rollout_plan"]

log = logging.getLogger("lmfleet.serve")

_MODEL = re.compile(r"^models\[(?P<name>.+?)\]\.")


def rollout_plan(changes: list[Change]) -> dict[str, Cost]:
    """Model name -> the dearest Serve-side cost among ``changes`` of that kept model (``in place`` or ``replica
    replacement``), in file order; models with only gateway changes are left out."""
    plan: dict[str, Cost] = {}
    for c in changes:
        m = _MODEL.match(c.path)
        if m is None or c.schema_path not in SERVE_APPLIED:
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
                 deploy: Callable[[list[Any]], None], progress: Callable[[str], None] = print) -> None:
        self.fleet = fleet
        self._build = build
        self._deploy = deploy
        self._progress = progress
        self.deployed_version: int | None = None

    async def follow(self, version: int, fleet: FleetConfig) -> dict[str, Cost]:
        """Redeploy what ``fleet`` (stored as ``version``) changes from the fleet deployed; returns the plan."""
        plan = rollout_plan(diff_fleets(self.fleet, fleet))
        self.fleet = fleet
        if plan:
            self._progress(f"lmfleet: version {version} of the running fleet: redeploying {describe(plan)}")
            subset = fleet.model_copy(update={"models": [m for m in fleet.models if m.name in plan]})
            try:
                apps = await asyncio.to_thread(self._build, subset)
                await asyncio.to_thread(self._deploy, apps)
            except Exception as e:  # noqa: BLE001 - a refused redeploy must not stop the gateway of this process
                log.error("lmfleet: version %d: the redeploy of %s failed: %s", version, describe(plan), e)
                self._progress(f"lmfleet: error: version {version}: the redeploy of {describe(plan)} failed: {e}")
                return plan
        self.deployed_version = version
        return plan

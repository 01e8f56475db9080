"""Readiness of each model's local deployment, from Ray Serve's own status. Pure mapping + a poller."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("lmfleet.gateway")

SERVING_DEPLOYMENT_STATES = {"HEALTHY", "UPSCALING", "DOWNSCALING"}


@dataclass(frozen=True)
class ModelHealth:
    ready: bool
    message: str
    running_replicas: int = 0


def model_health(app_status: Any | None) -> ModelHealth:
    """Map one Serve application's status overview to our readiness.

    Ready when the application is RUNNING, or when every deployment still has a running replica
    (an UNHEALTHY or DEPLOYING app whose replicas are being replaced can still serve).
    """
    if app_status is None:
        return ModelHealth(False, "not deployed")
    app_state = str(getattr(app_status.status, "value", app_status.status))
    deployments = getattr(app_status, "deployments", {}) or {}
    llm = {n: d for n, d in deployments.items() if n.startswith("LLMServer")} or deployments
    running = sum(int((d.replica_states or {}).get("RUNNING", 0)) for d in llm.values())
    bad = [(n, str(getattr(d.status, "value", d.status)), d.message) for n, d in llm.items()
           if str(getattr(d.status, "value", d.status)) not in SERVING_DEPLOYMENT_STATES]
    if app_state == "RUNNING" and not bad:
        return ModelHealth(True, "serving", running)
    if not bad and running > 0:
        return ModelHealth(True, f"serving ({app_state.lower()})", running)
    detail = "; ".join(f"{n} is {s}" + (f": {m}" if m else "") for n, s, m in bad) or f"application is {app_state}"
    return ModelHealth(False, detail[:500], running)


class HealthBoard:
    """Current readiness per model, refreshed by polling ``fetch`` (``serve.status`` in production)."""

    def __init__(self, app_names: dict[str, str], fetch: Callable[[], dict[str, Any]] | None, period_s: float = 2.0):
        self.app_names = app_names  # model -> Serve application name
        self._fetch = fetch
        self.period_s = period_s
        self.models: dict[str, ModelHealth] = {m: ModelHealth(fetch is None, "starting") for m in app_names}
        self.updated_at = 0.0
        self._marks: dict[str, tuple[float, str]] = {}

    def refresh_from(self, apps: dict[str, Any]) -> None:
        now = time.monotonic()
        for model, app in self.app_names.items():
            h = model_health(apps.get(app))
            mark = self._marks.get(model)
            # an engine failure seen on a request holds until Serve itself reports recovery later
            if mark and h.ready and now - mark[0] < self.period_s * 2:
                h = ModelHealth(False, mark[1], h.running_replicas)
            self.models[model] = h
        self.updated_at = now

    def mark_failed(self, model: str, message: str) -> None:
        self._marks[model] = (time.monotonic(), message)
        cur = self.models.get(model)
        self.models[model] = ModelHealth(False, message, cur.running_replicas if cur else 0)

    def is_ready(self, model: str) -> bool:
        h = self.models.get(model)
        return bool(h and h.ready)

    def all_ready(self) -> bool:
        return all(h.ready for h in self.models.values())

    async def run(self) -> None:
        if self._fetch is None:
            return
        while True:
            try:
                apps = await asyncio.to_thread(self._fetch)
                self.refresh_from(apps)
            except Exception as e:  # the poller must survive Ray hiccups; readiness just goes stale
                log.warning("health poll failed: %s", e)
            await asyncio.sleep(self.period_s)


def serve_status_fetcher() -> Callable[[], dict[str, Any]]:
    from ray import serve

    def fetch() -> dict[str, Any]:
        return dict(serve.status().applications)

    return fetch

"""Readiness of each model's local deployment, from Ray Serve's own status. Pure mapping + a poller."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger("lmfleet.gateway")

SERVING_DEPLOYMENT_STATES = {"HEALTHY", "UPSCALING", "DOWNSCALING"}
HOLDING_REPLICA_STATES = {"RUNNING", "STOPPING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"}
"""Replica states in which a replica may hold requests (serving them, or finishing them before it stops); the
others (STARTING, STOPPED) hold none."""


@dataclass(frozen=True)
class ModelHealth:
    ready: bool
    """At least one replica can serve the model."""
    message: str
    running_replicas: int = 0
    degraded: bool = False
    """Serving, but some replicas are down or being replaced (e.g. a node was lost)."""
    replicaless: bool = False
    """Deployed, and no replica of its engine deployment holds requests (none running or finishing; successors
    still starting): a local request with no answer yet waits in Serve's queue and has reached no engine."""


def model_health(app_status: Any | None) -> ModelHealth:
    """Map one Serve application's status overview to our readiness.

    Ready when the model's deployment has a running replica; degraded when it does but the
    deployment is not healthy (replicas lost or being replaced). Not ready with no running replica.
    """
    if app_status is None:
        return ModelHealth(False, "not deployed")
    app_state = str(getattr(app_status.status, "value", app_status.status))
    deployments = getattr(app_status, "deployments", {}) or {}
    llm = {n: d for n, d in deployments.items() if n.startswith("LLMServer")} or deployments
    running = sum(int((d.replica_states or {}).get("RUNNING", 0)) for d in llm.values())
    holding = sum(int(n) for d in llm.values() for s, n in (d.replica_states or {}).items()
                  if s in HOLDING_REPLICA_STATES)
    bad = [(n, str(getattr(d.status, "value", d.status)), d.message) for n, d in llm.items()
           if str(getattr(d.status, "value", d.status)) not in SERVING_DEPLOYMENT_STATES]
    if app_state == "RUNNING" and not bad:
        return ModelHealth(True, "serving", running)
    detail = "; ".join(f"{n} is {s}" + (f": {m}" if m else "") for n, s, m in bad) or f"application is {app_state}"
    if running > 0:
        return ModelHealth(True, f"degraded: {detail}"[:500], running, degraded=True)
    return ModelHealth(False, detail[:500], running, replicaless=bool(llm) and holding == 0)


class HealthBoard:
    """Current readiness per model, refreshed by polling ``fetch`` (``serve.status`` in production)."""

    def __init__(self, app_names: dict[str, str], fetch: Callable[[], dict[str, Any]] | None, period_s: float = 2.0):
        self.app_names = app_names  # model -> Serve application name
        self._fetch = fetch
        self.period_s = period_s
        self.models: dict[str, ModelHealth] = {m: ModelHealth(fetch is None, "starting") for m in app_names}
        self._marks: dict[str, tuple[float, str]] = {}
        self._broken_streams: dict[str, int] = {}
        self._failures: dict[str, deque[tuple[float, object]]] = {}
        self.on_refresh: Callable[[], None] | None = None
        """Called after each refresh from Serve's status (the running replicas' capacity follows it)."""

    MARK_HOLD_S = 30.0
    STREAM_BREAKS_TO_MARK = 3
    """Consecutive local streams broken mid-way before the model counts as failed (one alone is not a dead
    engine: a dead engine also fails the next request before its first byte, and that marks at once)."""

    FAILURES_TO_MARK = 3
    FAILURE_WINDOW_S = 10.0
    """A model counts as failed after FAILURES_TO_MARK local 5xx answers to *different* requests within
    FAILURE_WINDOW_S: one request (and its retries) that makes the engine answer 500 must not send all traffic
    to paid providers. A dead engine fails every request, so it still goes down within a few seconds."""

    def refresh_from(self, apps: dict[str, Any]) -> None:
        now = time.monotonic()
        for model, app in self.app_names.items():
            h = model_health(apps.get(app))
            mark = self._marks.get(model)
            # Serve notices a dead engine only at its next health check; a failure seen on a request
            # holds the model down until a local request succeeds again or MARK_HOLD_S passes
            if mark and h.ready and now - mark[0] < self.MARK_HOLD_S:
                h = replace(h, ready=False, message=mark[1], degraded=False)
            self.models[model] = h
        if self.on_refresh is not None:
            self.on_refresh()

    def watch(self, model: str, app_name: str) -> None:
        """A model added while the gateway runs: polled from now on, not ready until Serve runs a replica."""
        self.models[model] = ModelHealth(self._fetch is None, "starting")
        self.app_names[model] = app_name

    def forget(self, model: str) -> None:
        """A model removed while the gateway runs: no longer polled nor counted by :meth:`all_ready`."""
        self.app_names.pop(model, None)
        self.models.pop(model, None)

    def mark_failed(self, model: str, message: str) -> None:
        if model not in self.app_names:  # removed meanwhile (a request it admitted before failed)
            return
        self._marks[model] = (time.monotonic(), message)
        cur = self.models.get(model)
        self.models[model] = (replace(cur, ready=False, message=message, degraded=False) if cur
                              else ModelHealth(False, message))

    def note_failure(self, model: str, message: str, request: object, now: float | None = None) -> None:
        """A local 5xx on behalf of ``request`` (any object that identifies it, e.g. its task; its retries
        count once). Marks the model failed once FAILURES_TO_MARK requests failed within FAILURE_WINDOW_S."""
        now = time.monotonic() if now is None else now
        q = self._failures.setdefault(model, deque())
        while q and now - q[0][0] > self.FAILURE_WINDOW_S:
            q.popleft()
        if any(r is request for _, r in q):
            return
        q.append((now, request))
        if len(q) >= self.FAILURES_TO_MARK:
            q.clear()
            self.mark_failed(model, f"{message} ({self.FAILURES_TO_MARK} requests failed within "
                                    f"{self.FAILURE_WINDOW_S:g} s)")

    def note_stream_break(self, model: str, message: str) -> None:
        n = self._broken_streams.get(model, 0) + 1
        self._broken_streams[model] = n
        if n >= self.STREAM_BREAKS_TO_MARK:
            self.mark_failed(model, f"{message} ({n} streams in a row)")

    def mark_ok(self, model: str) -> None:
        """A local request succeeded: the engine serves, whatever an earlier failure suggested."""
        self._broken_streams.pop(model, None)
        self._failures.pop(model, None)
        if self._marks.pop(model, None) is not None:
            cur = self.models.get(model)
            if cur is not None and not cur.ready:
                self.models[model] = replace(cur, ready=True, message="serving", degraded=False, replicaless=False)

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


def _state(v: Any) -> str:
    return str(getattr(v, "value", v))


def status_overview(details: dict[str, Any]) -> dict[str, Any]:
    """Serve's application overviews (what ``serve.status().applications`` holds, as plain namespaces) from the
    controller's details dict: application and deployment status, message, replica counts per state."""
    from types import SimpleNamespace

    return {
        name: SimpleNamespace(
            status=_state(app.get("status")), message=app.get("message") or "",
            deployments={dn: SimpleNamespace(status=_state(dep.get("status")), message=dep.get("message") or "",
                                             replica_states=dict(Counter(_state(r.get("state"))
                                                                         for r in dep.get("replicas") or ())))
                         for dn, dep in (app.get("deployments") or {}).items()})
        for name, app in (details.get("applications") or {}).items()}


def serve_status_fetcher() -> Callable[[], dict[str, Any]]:
    """Every application's status overview. Reads the controller's details dict and maps it itself:
    ``serve.status()`` builds pydantic models of the same dict, and each deployment's ``RequestRouterConfig``
    cloudpickles its router class *by value* on construction (~30 ms of held GIL per call on Ray 2.60, every
    2 s in the gateway's process). Falls back to ``serve.status()`` where the client API differs."""
    from ray import serve

    def fetch() -> dict[str, Any]:
        try:
            from ray.serve.context import _get_global_client

            client = _get_global_client(raise_if_no_controller_running=False)
            if client is None:
                return {}
            return status_overview(client.get_serve_details())
        except (ImportError, AttributeError, TypeError):
            return dict(serve.status().applications)

    return fetch

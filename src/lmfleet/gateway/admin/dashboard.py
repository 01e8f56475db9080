"""The operator dashboard: ``/dashboard`` (a static page) and ``/admin/dashboard.json`` (its data, admin key).

    now = read_gateway(gw, budget)                 # the edge (readings.py): what the gateway knows now
    history.add(now)                               # a bounded ring of readings with their plot points
    body = build_dashboard(now, history.base(now), history.series(since), errors)   # pure: readings in, JSON out

Why two routes: a browser cannot send ``Authorization`` when it opens a page, and a key in a URL ends up in
history, proxies and access logs. So the page holds no data and no key: it asks for the admin key once, keeps
it in ``sessionStorage`` (this tab only, gone when it closes) and polls the JSON with ``Authorization: Bearer``,
which the auth middleware guards like every ``/admin/*`` route. The page is served with a Content-Security-Policy
that allows only its own inline script and style (by hash) and requests to this origin.

What the figures are
--------------------
* Live values (in flight, queue estimate, breaker states, readiness) are read at the call.
* Rates, shares and TTFT percentiles come from the gateway's Prometheus counters, differenced between readings:
  ``window`` over the last ``window_s`` (60 s), each plot point over the ``smooth_s`` (10 s) before it. TTFT
  percentiles are interpolated inside the histogram's buckets (as PromQL's ``histogram_quantile``), so they are
  estimates with the buckets' resolution; the local median from the load tracker is exact.
* The wait estimate's calibration (``estimate_calibration``) is this process's rolling window of the requests it
  kept local (:mod:`lmfleet.overflow.calibration`), exact, not from histograms.
* Readings are taken only when the JSON is asked for (nobody watching costs nothing): plots have gaps where
  nobody looked, and a rate across a gap is the average over it.
* Each gateway process answers with its own view (its counters, its history, its ``pid``): with several workers
  on one port (``gateway.workers``) the page shows the worker its connection reached, and starts its plots
  again when another one answers. Local in-flight counts include the other gateways' (``in_flight_peers``).

Cost: a reading's plot points are computed once, when it is kept; the page asks only for the points after the
last one it has (``?since=``), so a poll costs about the same whatever the history's length
(benchmarks/bench_dashboard.py; figures in docs/dashboard.md).
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from lmfleet.gateway.admin.readings import (
    BudgetReading,
    Counters,
    ModelReading,
    ProviderReading,
    Reading,
    read_counters,
    read_gateway,
)
from lmfleet.gateway.admin.recent_errors import ErrorEntry
from lmfleet.gateway.service import Gateway

__all__ = ["SERIES", "BudgetReading", "Counters", "DashboardHistory", "ModelReading", "ProviderReading", "Reading",
           "build_dashboard", "dashboard_data", "dashboard_routes", "group_errors", "histogram_quantile",
           "read_counters", "read_gateway", "series_point"]

MIN_INTERVAL_S = 1.0
HISTORY = 600
"""Readings kept: 20 minutes at the page's 2-second poll."""
WINDOW_S = 60.0
SMOOTH_S = 10.0


# ---- the pure part: readings in, JSON out ------------------------------------------------------------------

def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a cumulative histogram ``[(upper bound, count), ..., (inf, total)]``, interpolated
    linearly inside its bucket (PromQL's rule: the first bucket starts at 0; a rank in the +inf bucket gives the
    highest finite bound). None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank and n > prev_n:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def _bucket_delta(new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]]
                  ) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, max(0.0, n - before.get(le, 0.0))) for le, n in new]


def _error_delta(new: Counters, old: Counters) -> dict[str, float]:
    before = dict(old.errors)
    return {code: n - before.get(code, 0.0) for code, n in new.errors if n - before.get(code, 0.0) > 0}


@dataclass(frozen=True)
class _Rates:
    requests: float
    local_share: float | None
    tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    errors: dict[str, float]
    external_usd: float


def _rates(new: Counters, old: Counters, dt: float) -> _Rates:
    local, external = max(0.0, new.local - old.local), max(0.0, new.external - old.external)
    served = local + external
    buckets = _bucket_delta(new.ttft, old.ttft)
    return _Rates(
        requests=served + max(0.0, new.gateway - old.gateway),
        local_share=local / served if served > 0 else None,
        tokens_per_s=max(0.0, new.output_tokens - old.output_tokens) / dt if dt > 0 else None,
        ttft_p50_s=histogram_quantile(0.5, buckets), ttft_p99_s=histogram_quantile(0.99, buckets),
        errors=_error_delta(new, old), external_usd=max(0.0, new.external_cost_usd - old.external_cost_usd))


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _model_now(m: ModelReading, window: _Rates | None, window_s: float) -> dict[str, Any]:
    c = m.counters
    return {
        "ready": m.ready, "degraded": m.degraded, "health": m.health, "running_replicas": m.running_replicas,
        "capacity": m.capacity, "in_flight_local": m.in_flight_local, "in_flight_peers": m.in_flight_peers,
        "in_flight_external": m.in_flight_external, "external_shared": m.external_shared,
        "queue_estimate_ms": round(m.queue_estimate_ms, 1), "threshold_ms": m.threshold_ms,
        "queue_ratio": round(m.queue_estimate_ms / m.threshold_ms, 3) if m.threshold_ms > 0 else None,
        "mode": m.mode, "overflowing": m.overflowing, "drain_rps": _r(m.drain_rps),
        "local_output_tps": _r(m.local_output_tps, 1), "ttft_median_ms": _ms(m.ttft_median_s),
        "base_ttft_ms": _ms(m.base_ttft_s), "engine_running": m.engine_running, "engine_waiting": m.engine_waiting,
        "providers": list(m.providers),
        "estimate_calibration": None if m.calibration is None else m.calibration.as_dict(),
        "window_s": window_s,
        "requests": None if window is None else window.requests,
        "local_share": None if window is None else _r(window.local_share, 3),
        "tokens_per_s": None if window is None else _r(window.tokens_per_s, 1),
        "ttft_p50_ms": None if window is None else _ms(window.ttft_p50_s),
        "ttft_p99_ms": None if window is None else _ms(window.ttft_p99_s),
        "errors": {} if window is None else window.errors,
        "external_usd": None if window is None else round(window.external_usd, 6),
        "total": {"local": c.local, "external": c.external, "gateway": c.gateway, "errors": dict(c.errors),
                  "output_tokens": c.output_tokens, "external_usd": round(c.external_cost_usd, 6),
                  "local_usd": round(c.local_cost_usd, 6)},
    }


SERIES = ("t", "in_flight_local", "in_flight_external", "queue_ms", "threshold_ms", "tokens_per_s", "ttft_p50_ms",
          "ttft_p99_ms", "local_share")
"""The fields of a plot point, in order."""


def series_point(base: Reading, cur: Reading, name: str) -> tuple[Any, ...] | None:
    """Model ``name``'s plot point at ``cur`` (fields :data:`SERIES`): live values at ``cur`` (local load includes
    other gateways'), rates since ``base``. None when ``cur`` has no such model."""
    m = cur.models.get(name)
    if m is None:
        return None
    old = base.models.get(name)
    w = _rates(m.counters, old.counters if old else Counters(), cur.t - base.t)
    return (round(cur.t, 3), m.in_flight_local + m.in_flight_peers, m.in_flight_external,
            round(m.queue_estimate_ms, 1), m.threshold_ms, _r(w.tokens_per_s, 1), _ms(w.ttft_p50_s),
            _ms(w.ttft_p99_s), _r(w.local_share, 3))


class DashboardHistory:
    """The last ``maxlen`` readings, at least ``min_interval_s`` apart, each with its plot points (computed once,
    when it is kept: a point's rates span the ``smooth_s`` before it, at least back to the previous reading).

    A reading closer than ``min_interval_s`` to the last kept one is shown by the caller but not kept, so several
    open pages do not shorten the history.
    """

    def __init__(self, maxlen: int = HISTORY, min_interval_s: float = MIN_INTERVAL_S, smooth_s: float = SMOOTH_S):
        self.min_interval_s = min_interval_s
        self.smooth_s = smooth_s
        self._ring: deque[tuple[Reading, dict[str, tuple[Any, ...]]]] = deque(maxlen=maxlen)

    def add(self, r: Reading) -> bool:
        """Keep ``r`` if it is due; says whether it was kept."""
        if self._ring and r.t - self._ring[-1][0].t < self.min_interval_s:
            return False
        points: dict[str, tuple[Any, ...]] = {}
        if self._ring:
            base = next((x for x, _ in reversed(self._ring) if x.t <= r.t - self.smooth_s), self._ring[0][0])
            points = {n: p for n in r.models if (p := series_point(base, r, n)) is not None}
        self._ring.append((r, points))
        return True

    def readings(self) -> list[Reading]:
        """Oldest first."""
        return [r for r, _ in self._ring]

    def base(self, now: Reading, window_s: float = WINDOW_S) -> Reading | None:
        """What ``now``'s window figures are measured from: the oldest kept reading inside ``window_s`` before it,
        else the newest before it; None when none is older than ``now``."""
        found = None
        for r, _ in reversed(self._ring):
            if r.t >= now.t:
                continue
            if found is not None and r.t < now.t - window_s:
                break
            found = r
        return found

    @property
    def last_t(self) -> float | None:
        """The newest kept reading's time: the ``since`` that asks for what comes after it."""
        return self._ring[-1][0].t if self._ring else None

    def series(self, since: float | None = None) -> dict[str, dict[str, list[Any]]]:
        """Per model, the plot points (oldest first) of the readings kept after ``since``, field by field."""
        kept: list[dict[str, tuple[Any, ...]]] = []
        for r, points in reversed(self._ring):  # newest first: a poll asks for the last few only
            if since is not None and r.t <= since:
                break
            kept.append(points)
        kept.reverse()
        rows: dict[str, list[tuple[Any, ...]]] = {}
        for points in kept:
            for name, p in points.items():
                rows.setdefault(name, []).append(p)
        return {name: {f: list(c) for f, c in zip(SERIES, zip(*ps))} for name, ps in rows.items()}


def _budget(b: BudgetReading, external_window_usd: float, window_s: float) -> dict[str, Any]:
    s = b.status
    return {"hourly_usd": b.hourly_usd, "daily_usd": b.daily_usd,
            "spent_hour_usd": None if s is None else round(s.spent_hour_usd, 6),
            "spent_day_usd": None if s is None else round(s.spent_day_usd, 6),
            "allowed": None if s is None else s.allowed, "reason": None if s is None else s.reason,
            "retry_after_s": None if s is None else round(s.retry_after_s, 1),
            "external_usd_window": round(external_window_usd, 6), "window_s": window_s}


def build_dashboard(now: Reading, base: Reading | None, series: dict[str, dict[str, list[Any]]],
                    errors: Sequence[ErrorEntry] = (), *, series_until: float | None = None) -> dict[str, Any]:
    """The dashboard's JSON: live values of ``now``, window figures from ``base`` to ``now`` (none without a
    ``base``), plot points per model (``series``, from :meth:`DashboardHistory.series`), the recent errors."""
    window_s = round(now.t - base.t, 1) if base is not None else 0.0
    models: dict[str, Any] = {}
    external_window = 0.0
    for name, m in now.models.items():
        w = None
        if base is not None:
            old = base.models.get(name)
            w = _rates(m.counters, old.counters if old else Counters(), now.t - base.t)
            external_window += w.external_usd
        models[name] = {**_model_now(m, w, window_s),
                        "series": series.get(name) or {f: [] for f in SERIES}}
    return {
        "t": now.t,
        "series_until": series_until,
        "models": models,
        "providers": {p.name: {"breaker": p.breaker, "retry_after_s": round(p.retry_after_s, 1),
                               "in_flight": p.in_flight, "max_concurrency": p.max_concurrency,
                               "models": list(p.models)} for p in now.providers},
        "budget": _budget(now.budget, external_window, window_s),
        "errors": group_errors(errors),
    }


def group_errors(errors: Sequence[ErrorEntry], limit: int = 20) -> list[dict[str, Any]]:
    """Newest first, a run of the same line folded into one row with its count and time span (a provider that
    fails every request would otherwise fill the list with one message), at most ``limit`` rows."""
    out: list[dict[str, Any]] = []
    for e in reversed(errors):
        last = out[-1] if out else None
        if last is not None and last["message"] == e.message and last["level"] == e.level:
            last["count"] += 1
            last["first_t"] = e.t
            continue
        if len(out) == limit:
            break
        out.append({"t": e.t, "first_t": e.t, "level": e.level, "message": e.message, "count": 1})
    return out


# ---- HTTP ------------------------------------------------------------------------------------------------------

def _page() -> tuple[bytes, str]:
    """The page and its Content-Security-Policy (its one inline script and style allowed by hash)."""
    html = resources.files("lmfleet.gateway").joinpath("static/dashboard.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in blocks)

    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
           "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode("utf-8"), csp


_PAGE: tuple[bytes, str] | None = None
_PID = os.getpid()

_NO_STORE = {"cache-control": "no-store", "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


async def dashboard_data(gw: Gateway, history: DashboardHistory, errors: Sequence[ErrorEntry],
                         since: float | None = None) -> JSONResponse:
    """``GET /admin/dashboard.json``: the page's data (a reading now, the series since ``since``)."""
    now = read_gateway(gw, await gw.router.budget_status())
    history.add(now)
    body = build_dashboard(now, history.base(now), history.series(since), errors, series_until=history.last_t)
    body["pid"] = _PID  # several workers on one port each answer with their own view
    return JSONResponse(body, headers=_NO_STORE)


def dashboard_routes() -> APIRouter:
    """``GET /dashboard``: the page (open, it holds nothing; its data is ``GET /admin/dashboard.json``, in
    :mod:`lmfleet.gateway.admin.routes`)."""
    r = APIRouter()

    @r.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        global _PAGE
        if _PAGE is None:
            _PAGE = _page()
        body, csp = _PAGE
        return Response(body, media_type="text/html; charset=utf-8",
                        headers={**_NO_STORE, "content-security-policy": csp, "x-frame-options": "DENY"})

    return r

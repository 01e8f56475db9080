"""One request's journey: validate, estimate the local wait, pick a target, fall back on failure.

The flow, at a glance::

    model = fleet[request.model]                   # 404 if unknown
    check_context(prompt_tokens, max_tokens)       # 400 if it cannot fit
    decision = policy.decide(estimate, ...)        # local / provider / reject (429)
    for target in attempt_order(decision):         # chosen target first, then the fallbacks
        try: return await relay(target)            # nothing sent to the client yet -> may retry
        except retryable UpstreamError: continue
    -> 503/504/429 with the last reason

Decisions live in ``lmfleet.overflow`` (pure functions); this module only wires them to I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from lmfleet.config.models import FleetConfig, ModelConfig, ProviderConfig
from lmfleet.gateway import sse
from lmfleet.gateway.errors import GatewayError, UpstreamError
from lmfleet.gateway.health import HealthBoard
from lmfleet.gateway.metrics import GatewayMetrics
from lmfleet.gateway.tokens import count_prompt_tokens
from lmfleet.gateway.upstream import OpenStream, Target, complete, open_stream
from lmfleet.gateway.validation import ParsedRequest, check_context
from lmfleet.overflow import (
    BudgetStatus,
    CircuitBreaker,
    HysteresisState,
    Ledger,
    LoadTracker,
    LocalCostMeter,
    OverflowMode,
    ProviderCandidate,
    QueueSignals,
    RouteDecision,
    backoff_s,
    check_budget,
    decide,
    estimate_wait_ms,
    external_cost_usd,
    local_capacity,
    providers_for,
    served_by_local,
    served_by_provider,
)

from lmfleet.overflow.budget import DAY_S

log = logging.getLogger("lmfleet.gateway")

SERVED_BY = "x-lmfleet-served-by"
ROUTE_REASON = "x-lmfleet-route-reason"
QUEUE_ESTIMATE = "x-lmfleet-queue-estimate-ms"


@dataclass
class LocalModel:
    """A model served by the local fleet, with its live load and routing state."""

    cfg: ModelConfig
    base_url: str
    max_model_len: int | None
    tokenizer: Any | None
    tracker: LoadTracker
    capacity: int
    meter: LocalCostMeter
    threshold_ms: float
    mode: OverflowMode = OverflowMode.AUTO
    hysteresis: HysteresisState = field(default_factory=HysteresisState)
    last_estimate_ms: float = 0.0

    @property
    def name(self) -> str:
        return self.cfg.name


@dataclass
class Provider:
    cfg: ProviderConfig
    client: httpx.AsyncClient
    headers: dict[str, str]
    breaker: CircuitBreaker
    in_flight: int = 0

    @property
    def name(self) -> str:
        return self.cfg.name


@dataclass
class Outcome:
    """What one served request cost and how it went, for metrics and the ledger."""

    served_by: str
    reason: str
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    status: int = 200


def provider_api_key(p: ProviderConfig) -> str | None:
    return os.environ.get(p.api_key_env) if p.api_key_env else None


class Router:
    """Routes requests for every model of a fleet. Owns the HTTP clients, trackers, breakers and ledger."""

    def __init__(self, fleet: FleetConfig, models: dict[str, LocalModel], providers: dict[str, Provider],
                 local_client: httpx.AsyncClient, health: HealthBoard, metrics: GatewayMetrics, ledger: Ledger | None,
                 uses_gpus: bool = False):
        self.fleet = fleet
        self.models = models
        self.providers = providers
        self.local_client = local_client
        self.health = health
        self.metrics = metrics
        self.ledger = ledger
        self.uses_gpus = uses_gpus
        self.engine_stats = None
        """An :class:`~lmfleet.overflow.engine_stats.EngineStatsPoller`, started with the gateway, or None."""
        self._budget: tuple[float, BudgetStatus | None] = (0.0, None)
        self._ledger_q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._writer: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self.ledger is not None and self._writer is None:
            self._writer = asyncio.create_task(self._write_ledger())

    async def close(self) -> None:
        if self._writer is not None:
            await self._ledger_q.join()
            self._writer.cancel()
        await self.local_client.aclose()
        for p in self.providers.values():
            await p.client.aclose()

    async def _write_ledger(self) -> None:
        assert self.ledger is not None
        while True:
            row = await self._ledger_q.get()
            try:
                await asyncio.to_thread(self.ledger.record, **row)
            except Exception as e:  # a full disk must not take the gateway down
                log.error("ledger write failed: %s", e)
            finally:
                self._ledger_q.task_done()

    # ---- routing ---------------------------------------------------------------------------
    def model_or_404(self, name: str) -> LocalModel:
        m = self.models.get(name)
        if m is None:
            served = ", ".join(sorted(self.models))
            raise GatewayError(404, f"The model {name!r} does not exist here. Served models: {served}.",
                               param="model", code="model_not_found")
        return m

    async def budget_status(self) -> BudgetStatus | None:
        b = self.fleet.budget
        if self.ledger is None or (b.hourly_usd is None and b.daily_usd is None):
            return None
        at, cached = self._budget
        if cached is not None and time.monotonic() - at < 1.0:
            return cached
        now = time.time()
        events = await asyncio.to_thread(self.ledger.spend_events, now - DAY_S)
        status = check_budget(events, hourly_usd=b.hourly_usd, daily_usd=b.daily_usd, now=now)
        self._budget = (time.monotonic(), status)
        return status

    def _candidates(self, m: LocalModel) -> list[ProviderCandidate]:
        out = []
        for pc in providers_for(m.cfg, self.fleet.providers):
            p = self.providers[pc.name]
            out.append(ProviderCandidate(p.name, pc.model_map, p.breaker.allows(), p.in_flight, pc.max_concurrency))
        return out

    def estimate(self, m: LocalModel, signals: QueueSignals | None = None) -> float:
        """Predicted local wait (ms) for a request of ``m`` arriving now."""
        return estimate_wait_ms(signals or m.tracker.snapshot(), m.capacity,
                                cold_service_s=m.cfg.overflow.cold_service_s, cold_ttft_s=m.cfg.overflow.cold_ttft_s)

    async def route(self, m: LocalModel) -> tuple[RouteDecision, str]:
        """The routing decision for one request of ``m`` and the reason to report for it."""
        estimate = self.estimate(m)
        m.last_estimate_ms = estimate
        self.metrics.queue_estimate.labels(m.name).set(estimate)
        candidates = self._candidates(m)
        budget = await self.budget_status() if candidates else None
        mode = m.mode
        if not self.health.is_ready(m.name) and mode is not OverflowMode.FORCE_OFF and candidates:
            mode = OverflowMode.FORCE_ON  # local is down: anyone healthy beats a 503
        d = decide(model=m.name, estimate_ms=estimate, threshold_ms=m.threshold_ms, hysteresis=m.cfg.overflow.hysteresis,
                   state=m.hysteresis, mode=mode, enabled=m.cfg.overflow.enabled or m.mode is OverflowMode.FORCE_ON,
                   budget=budget, on_exhausted=self.fleet.budget.on_exhausted, candidates=candidates)
        m.hysteresis = d.state
        reason = d.reason.value
        if mode is not m.mode and d.is_provider:
            reason = "local_unavailable"
        self.metrics.overflowed.labels(m.name, d.target, reason).inc()
        return d, reason

    def _local_target(self, m: LocalModel, has_fallback: bool) -> Target:
        # give up on a slow local first token only when someone else can take the request; otherwise the
        # retry would just put it at the back of the same queue
        ftt = m.cfg.overflow.local_first_token_timeout_s if has_fallback else None
        return Target("local", m.name, served_by_local(m.name), m.base_url, m.name, self.local_client,
                      first_token_timeout_s=ftt, total_timeout_s=m.cfg.deployment.request_timeout_s)

    def _provider_target(self, m: LocalModel, p: Provider) -> Target:
        return Target("provider", p.name, served_by_provider(p.name), p.cfg.base_url.rstrip("/"),
                      p.cfg.model_map[m.name], p.client, p.headers,
                      first_token_timeout_s=p.cfg.timeouts.first_token_s, total_timeout_s=p.cfg.timeouts.total_s,
                      idle_timeout_s=p.cfg.timeouts.first_token_s)

    def attempt_order(self, m: LocalModel, d: RouteDecision, budget_ok: bool) -> list[Target]:
        """The chosen target first, then fallbacks: other healthy providers, and local if not chosen."""
        fallbacks = []
        if budget_ok and m.mode is not OverflowMode.FORCE_OFF:
            fallbacks = [self._provider_target(m, self.providers[p.name])
                         for p in providers_for(m.cfg, self.fleet.providers)
                         if p.name != d.target and self.providers[p.name].breaker.allows()]
        if d.is_provider:
            return [self._provider_target(m, self.providers[d.target]), *fallbacks,
                    self._local_target(m, has_fallback=False)]
        return [self._local_target(m, has_fallback=bool(fallbacks)), *fallbacks]

    # ---- serving ---------------------------------------------------------------------------
    async def handle(self, req: ParsedRequest, path: str) -> Response:
        m = self.model_or_404(req.model)
        t0 = time.monotonic()
        prompt_tokens = await count_prompt_tokens(m.tokenizer, req.kind, req.body)
        if prompt_tokens is not None and m.max_model_len:
            check_context(prompt_tokens, req.max_tokens, m.max_model_len)
        d, reason = await self.route(m)
        if d.is_reject:
            retry = max(1, int(d.retry_after_s or 60))
            raise GatewayError(429, f"External spending budget exhausted and the local queue for {m.name!r} is "
                               f"full (predicted wait {d.estimate_ms:.0f} ms). Retry later.",
                               code="budget_exhausted", headers={"retry-after": str(retry)})
        budget = self._budget[1]
        targets = self.attempt_order(m, d, budget_ok=budget is None or budget.allowed)
        deadline = t0 + m.cfg.deployment.request_timeout_s
        ctx = _Attempt(self, m, req, path, d, reason, prompt_tokens or 0, t0, deadline)
        if req.stream:
            return await ctx.stream(targets)
        return await ctx.unary(targets)

    def count_error(self, model: str | None, status: int) -> None:
        """An error answer that never reached a backend's accounting (validation, routing, give-up)."""
        label = model if model in self.models else "unknown"  # arbitrary names must not blow up cardinality
        self.metrics.errors.labels(label, str(status)).inc()
        self.metrics.requests.labels(label, "none", str(status)).inc()

    def finish(self, m: LocalModel, o: Outcome, latency_s: float) -> None:
        """Metrics, cost and the ledger row of one finished request."""
        labels = (m.name, o.served_by)
        self.metrics.requests.labels(m.name, o.served_by, str(o.status)).inc()
        self.metrics.latency.labels(*labels).observe(latency_s)
        if o.ttft_s is not None:
            self.metrics.ttft.labels(*labels).observe(o.ttft_s)
        self.metrics.tokens.labels(*labels, "input").inc(o.input_tokens)
        self.metrics.tokens.labels(*labels, "output").inc(o.output_tokens)
        if o.status != 200:
            self.metrics.errors.labels(m.name, str(o.status)).inc()
        if o.served_by.startswith("provider/"):
            p = self.providers[o.served_by.removeprefix("provider/")]
            cost = external_cost_usd(o.input_tokens, o.output_tokens, p.cfg.price)
        else:
            m.meter.record(o.output_tokens)
            cost = m.meter.request_cost_usd(o.output_tokens)
        self.metrics.cost.labels(*labels).inc(cost)
        if self.ledger is not None:
            self._ledger_q.put_nowait(dict(
                model=m.name, served_by=o.served_by, route_reason=o.reason, input_tokens=o.input_tokens,
                output_tokens=o.output_tokens, status=o.status, cost_usd=cost, latency_ms=latency_s * 1000,
                ttft_ms=o.ttft_s * 1000 if o.ttft_s is not None else None))


class _Attempt:
    """State of one request across its attempts (targets tried in order)."""

    def __init__(self, router: Router, m: LocalModel, req: ParsedRequest, path: str, d: RouteDecision,
                 reason: str, prompt_tokens: int, t0: float, deadline: float):
        self.r, self.m, self.req, self.path, self.d = router, m, req, path, d
        self.prompt_tokens, self.t0, self.deadline = prompt_tokens, t0, deadline
        self.reason = reason
        self.last_error: UpstreamError | None = None

    def _headers(self, target: Target) -> dict[str, str]:
        return {SERVED_BY: target.served_by, ROUTE_REASON: self.reason,
                QUEUE_ESTIMATE: f"{self.m.last_estimate_ms:.0f}"}

    def _begin(self, target: Target):
        if target.is_local:
            return self.m.tracker.on_start(self.prompt_tokens)
        p = self.r.providers[target.name]
        p.in_flight += 1
        return None

    def _end(self, target: Target, ticket, ok: bool, output_tokens: int = 0) -> None:
        if target.is_local:
            self.m.tracker.on_finish(ticket, output_tokens=output_tokens, ok=ok)
            if ok:
                self.r.health.mark_ok(self.m.name)
        else:
            self.r.providers[target.name].in_flight -= 1

    def _failed(self, target: Target, e: UpstreamError, attempt_no: int, more: bool) -> None:
        self.last_error = e
        log.warning("model %s: %s attempt %d failed: %s%s", self.m.name, target.served_by, attempt_no, e.message,
                    " (trying next target)" if more else "")
        if target.is_local:
            # a dead engine or replica, not a slow queue: only then does the model stop counting as ready
            if not e.timeout and (e.status is None or (e.status >= 500 and e.status != 504)):
                self.r.health.mark_failed(self.m.name, f"local engine error: {e.message}")
        else:
            b = self.r.providers[target.name].breaker
            if e.status == 429:
                b.on_rate_limited(e.retry_after_s)
            elif e.retryable:
                b.on_failure()
        if e.retryable:
            self.r.metrics.retries.labels(self.m.name, target.served_by).inc()
        self.reason = f"fallback_after_{'local' if target.is_local else 'provider'}_error"

    def _tries(self, targets: list[Target]):
        """(target, attempt number, is_last) for each attempt, with provider retries and backoff."""
        for i, t in enumerate(targets):
            last_target = i == len(targets) - 1
            if t.is_local:
                # retries go through Serve's router to another (or a restarted) replica; with nowhere else
                # to go, keep trying a little longer so a lost node does not lose requests that had not started
                n = 4 if last_target else 2
            else:
                n = 1 + (self.r.providers[t.name].cfg.max_retries if last_target else 0)
            for k in range(n):
                yield t, k, last_target and k == n - 1

    async def _pause(self, target: Target, k: int) -> None:
        if target.is_local:
            await asyncio.sleep(min(0.5 * 2 ** (k - 1), 4.0))
            return
        cfg = self.r.providers[target.name].cfg.breaker
        wait = backoff_s(k, cfg.backoff_base_s, cfg.backoff_cap_s)
        if self.last_error and self.last_error.retry_after_s:
            wait = max(wait, self.last_error.retry_after_s)
        await asyncio.sleep(min(wait, max(0.0, self.deadline - time.monotonic())))

    def _give_up(self) -> GatewayError:
        e = self.last_error
        if time.monotonic() >= self.deadline:
            return GatewayError(504, f"Request to {self.m.name!r} timed out after "
                                     f"{self.m.cfg.deployment.request_timeout_s:g} s.", code="timeout")
        if e is not None and not e.retryable and e.status is not None:
            return GatewayError(e.status, e.message, code="upstream_rejected")
        if e is not None and e.status == 429:
            retry = str(max(1, int(e.retry_after_s or 1)))
            return GatewayError(429, f"Model {self.m.name!r} is rate limited by every backend: {e.message}",
                                code="rate_limited", headers={"retry-after": retry})
        why = e.message if e else "no backend available"
        return GatewayError(503, f"Model {self.m.name!r} is unavailable: {why}. "
                                 f"Local deployment: {self.r.health.models.get(self.m.name).message}.",
                            code="model_unavailable", headers={"retry-after": "5"})

    def _allowed(self, t: Target) -> bool:
        if t.is_local:
            return True
        return self.r.providers[t.name].breaker.try_acquire()

    async def _first_success(self, targets: list[Target], call):
        """Try targets in order until ``call(target)`` succeeds; returns (target, ticket, result).

        Only failures before anything reached the client come here, so every one may move on.
        """
        for t, k, last in self._tries(targets):
            if time.monotonic() >= self.deadline:
                break
            if k > 0:
                await self._pause(t, k)
            if not self._allowed(t):
                continue
            ticket = self._begin(t)
            try:
                return t, ticket, await call(_with_timeout(t, self.deadline - time.monotonic()))
            except UpstreamError as e:
                self._end(t, ticket, ok=False)
                self._failed(t, e, k + 1, not last)
                if not e.retryable:
                    break
            except BaseException:  # the client went away (cancellation): the slot must still be freed
                self._end(t, ticket, ok=False)
                raise
        raise self._give_up()

    async def unary(self, targets: list[Target]) -> Response:
        t, ticket, (raw, obj) = await self._first_success(targets, lambda tt: complete(tt, self.path, self.req.body))
        usage = sse.usage_of(obj) or (self.prompt_tokens, 0)
        self._end(t, ticket, ok=True, output_tokens=usage[1])
        if not t.is_local:
            self.r.providers[t.name].breaker.on_success()
        if obj.get("model") != self.req.model:  # a provider's own model name never reaches the client
            obj["model"] = self.req.model
            raw = json.dumps(obj).encode()
        self.r.finish(self.m, Outcome(t.served_by, self.reason, usage[0], usage[1]), time.monotonic() - self.t0)
        return Response(raw, media_type="application/json", headers=self._headers(t))

    async def stream(self, targets: list[Target]) -> Response:
        t, ticket, st = await self._first_success(targets, lambda tt: open_stream(tt, self.path, self.req.body))
        ttft = time.monotonic() - self.t0
        if t.is_local:
            self.m.tracker.on_first_token(ticket)
        return StreamingResponse(self._relay(st, t, ticket, ttft), media_type="text/event-stream",
                                 headers={**self._headers(t), "cache-control": "no-cache"})

    async def _relay(self, st: OpenStream, t: Target, ticket, ttft: float) -> AsyncIterator[bytes]:
        usage: tuple[int, int] | None = None
        chunks = 0
        ok = False
        status = 200
        try:
            async with _deadline(self.deadline):
                async for batch in st.batches():
                    out = []
                    for e in batch:
                        if b'"usage":{' in e or b'"usage": {' in e:
                            obj = sse.event_json(e)
                            usage = sse.usage_of(obj) or usage
                            if not self.req.wants_usage and obj is not None:
                                if not obj.get("choices"):
                                    continue
                                obj.pop("usage", None)
                                e = _event(obj)
                        if t.upstream_model != self.req.model and b'"model":' in e:
                            obj = sse.event_json(e)
                            if obj is not None:
                                obj["model"] = self.req.model
                                e = _event(obj)
                        if sse.has_choices(e):
                            chunks += 1
                        if sse.is_done(e):
                            ok = True
                        elif b'"error"' in e and (obj := sse.event_json(e)) is not None and "error" in obj:
                            status = 502
                        out.append(e)
                    if out:  # what arrived together goes out together: one write, no waiting for more
                        yield b"".join(out)
            if not ok and status == 200:
                status = 502
                yield sse.error_event(f"the stream from {t.served_by} ended without [DONE] after {chunks} chunks",
                                      code="upstream_truncated")
        except TimeoutError:
            status = 504
            yield sse.error_event(f"request exceeded {self.m.cfg.deployment.request_timeout_s:g} s", code="timeout")
        except (httpx.HTTPError, OSError) as ex:
            status = 502
            log.warning("model %s: stream from %s broke after %d chunks: %s", self.m.name, t.served_by, chunks,
                        type(ex).__name__)
            yield sse.error_event(f"the stream from {t.served_by} broke after {chunks} chunks ({type(ex).__name__})",
                                  code="upstream_stream_error")
        finally:
            await st.aclose()
            out = usage[1] if usage else chunks
            inp = usage[0] if usage else self.prompt_tokens
            self._end(t, ticket, ok=status == 200, output_tokens=out)
            if not t.is_local:
                b = self.r.providers[t.name].breaker
                b.on_success() if status == 200 else b.on_failure()
            elif status == 502:
                self.r.health.note_stream_break(self.m.name, "local stream broke")
            self.r.finish(self.m, Outcome(t.served_by, self.reason, inp, out, ttft, status), time.monotonic() - self.t0)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _with_timeout(t: Target, remaining_s: float) -> Target:
    from dataclasses import replace

    remaining_s = max(0.001, remaining_s)
    ftt = min(t.first_token_timeout_s, remaining_s) if t.first_token_timeout_s else remaining_s
    total = min(t.total_timeout_s, remaining_s) if t.total_timeout_s else remaining_s
    return replace(t, first_token_timeout_s=ftt, total_timeout_s=total)


def _deadline(deadline: float):
    """``asyncio.timeout`` at an absolute ``time.monotonic()`` deadline."""
    return asyncio.timeout(max(0.0, deadline - time.monotonic()))

"""Backends: what one attempt of a request is sent to. Each owns its own state; nothing reaches back.

Two kinds, one protocol (:class:`Backend`)::

    LocalBackend     a model's Ray Serve deployment: load tracker, readiness, cost meter, Serve base URL
    ProviderBackend  an external OpenAI-compatible provider: breaker, in-flight cap, price, model map, key

The request run (:mod:`lmfleet.gateway.relay.run`) drives a backend through one attempt in the order that
:mod:`lmfleet.gateway.relay.backend` draws (the protocol and its :class:`Ask` are the relay's), and asks it how
often to retry (:meth:`attempts`) and how long to wait between tries (:meth:`backoff_s`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmfleet.config.models import ModelConfig, ProviderConfig
from lmfleet.dialects import resolve as resolve_dialect
from lmfleet.gateway.routing.budget import BudgetGuard
from lmfleet.gateway.core.errors import UpstreamError, UpstreamRateLimited, UpstreamServerError, UpstreamUnreachable
from lmfleet.gateway.routing.health import HealthBoard
from lmfleet.gateway.relay.backend import Ask, Backend
from lmfleet.gateway.relay.prefillgate import PrefillGate
from lmfleet.gateway.relay.replicaless import WaitingForReplica
from lmfleet.gateway.relay.upstream import Endpoint, HttpPool
from lmfleet.store import Reservation
from lmfleet.overflow import CircuitBreaker, LoadTracker, LocalCostMeter, Reason, backoff_s, external_cost_usd
from lmfleet.overflow.breaker import Admission
from lmfleet.provenance import local_label, provider_label

__all__ = ["Ask", "Backend", "LocalBackend", "ProviderBackend", "ProviderSlot"]

log = logging.getLogger("lmfleet.gateway")


@dataclass
class ProviderSlot:
    """A provider attempt in flight: the breaker's admission (only the half-open probe's own success may close
    the breaker) and the budget it holds (None: no caps configured)."""

    admission: Admission
    reservation: Reservation | None = None


_DEAD_ENGINE_TEXTS = ("EngineCore encountered an issue", "EngineDeadError", "ActorDiedError")
"""What a 5xx says when the engine or its replica is gone (vLLM's EngineDeadError message, Ray's actor death):
the engine's own word, not one request's fault."""


def _says_dead(message: str) -> bool:
    return any(t in message for t in _DEAD_ENGINE_TEXTS)


class LocalBackend:
    """One model's local deployment (Ray Serve), reached through Serve's HTTP front (HAProxy or Serve's proxy)."""

    fallback_reason = Reason.FALLBACK_AFTER_LOCAL_ERROR
    needs_exact_prompt = False
    retry_backoff_s: tuple[float, float] = (0.5, 4.0)
    """(first, largest) wait before another local attempt of one request; it doubles per attempt."""

    def __init__(self, cfg: ModelConfig, base_url: str, client: HttpPool, tracker: LoadTracker,
                 health: HealthBoard, meter: LocalCostMeter):
        self.cfg = cfg
        self.model = cfg.name
        self.label = local_label(cfg.name)
        self.base_url = base_url
        self.client = client
        self.tracker = tracker
        self.health = health
        self.meter = meter
        self.gate = PrefillGate()
        """``overflow.prefill_gate``: one streamed prompt before its first token per running replica (the run
        enters it when the model's gate is on; every end of an attempt leaves it)."""
        self.waiting = WaitingForReplica()
        """Local attempts with a provider after them, awaiting their answer: moved on when Serve has no replica
        of the model running or finishing requests (:meth:`RunningCapacity.update
        <lmfleet.gateway.routing.live.RunningCapacity.update>`)."""

    def endpoint(self, model: str, *, has_fallback: bool) -> Endpoint:
        # give up on a slow local first token only when someone else can take the request; otherwise the
        # retry would just put it at the back of the same queue
        ftt = self.cfg.overflow.local_first_token_timeout_s if has_fallback else None
        return Endpoint(self.label, "local deployment", self.base_url, self.model, self.client,
                        first_token_timeout_s=ftt, total_timeout_s=self.cfg.deployment.request_timeout_s,
                        not_found_is_transient=True)

    async def acquire(self, ask: Ask) -> Any | None:
        return self.tracker.on_start(ask.prompt_tokens, awaits_first_token=ask.streamed)

    async def pass_gate(self, slot: Any, timeout_s: float) -> bool:
        """Wait for :attr:`gate` (``overflow.prefill_gate``); False: ``timeout_s`` passed first."""
        self.tracker.on_gate_wait(slot)
        if not await self.gate.enter(id(slot), timeout_s):
            return False
        self.tracker.on_gate_enter(slot)
        return True

    def first_token(self, slot: Any) -> None:
        self.gate.leave(id(slot))
        self.tracker.on_first_token(slot)

    def finish(self, slot: Any, output_tokens: int) -> None:
        self._end(slot, output_tokens, ok=True)
        self.health.mark_ok(self.model)

    def fail(self, slot: Any, err: UpstreamError) -> None:
        self._end(slot)
        # only a dead engine or replica makes the model stop counting as ready; not a slow queue (timeouts), a
        # redeploying app (404), a 4xx, nor one request that makes the engine answer 500 (see HealthBoard)
        if isinstance(err, UpstreamUnreachable) or (isinstance(err, UpstreamServerError) and _says_dead(err.message)):
            self.health.mark_failed(self.model, f"local engine error: {err.message}")
        elif isinstance(err, UpstreamServerError) and err.status is not None and err.status >= 500 \
                and err.status != 504:
            # the request's task identifies it: its retries count once
            self.health.note_failure(self.model, f"local engine error: {err.message}", asyncio.current_task())

    def break_stream(self, slot: Any, output_tokens: int, *, timed_out: bool) -> None:
        self._end(slot, output_tokens)
        if not timed_out:
            self.health.note_stream_break(self.model, "local stream broke")

    def cancel(self, slot: Any) -> None:
        self._end(slot)

    def _end(self, slot: Any, output_tokens: int = 0, *, ok: bool = False) -> None:
        """The attempt ended (answered, failed, broken off or cancelled): out of the gate, off the tracker."""
        self.gate.leave(id(slot))
        self.tracker.on_finish(slot, output_tokens=output_tokens, ok=ok)

    def attempts(self, *, last: bool) -> int:
        # retries go through Serve's router to another (or a restarted) replica; with nowhere else to go, keep
        # trying a little longer so a lost node does not lose requests that had not started
        return 4 if last else 2

    def backoff_s(self, k: int, last_error: UpstreamError | None) -> float:
        first, cap = self.retry_backoff_s
        return min(first * 2 ** (k - 1), cap)

    def charge(self, input_tokens: int, output_tokens: int) -> float:
        self.meter.record(output_tokens)
        return self.meter.request_cost_usd(output_tokens)


class ProviderBackend:
    """An external OpenAI-compatible provider, shared by every model its ``model_map`` names."""

    fallback_reason = Reason.FALLBACK_AFTER_PROVIDER_ERROR

    def __init__(self, cfg: ProviderConfig, client: HttpPool, api_key: str | None,
                 breaker: CircuitBreaker, budget: BudgetGuard | None = None):
        self.cfg = cfg
        self.budget = budget
        self.name = cfg.name
        self.label = provider_label(cfg.name)
        self.client = client
        self.dialect = resolve_dialect(cfg.dialect, cfg.base_url)
        self._headers = self.dialect.auth_headers(api_key)
        self.breaker = breaker
        self._in_flight = [0]  # one count for this provider across its with_config twins

    @property
    def needs_exact_prompt(self) -> bool:
        return self.budget is not None

    @classmethod
    def from_config(cls, cfg: ProviderConfig, environ: Mapping[str, str],
                    budget: BudgetGuard | None = None) -> "ProviderBackend":
        """A provider with its own connection pool and breaker; its key from ``environ`` (a warning, and no key,
        when the variable is not set)."""
        key = environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if cfg.api_key_env and not key:
            log.warning("provider %s: environment variable %s is not set; sending no API key", cfg.name,
                        cfg.api_key_env)
        client = HttpPool(max_connections=cfg.max_concurrency or 1000, connect_timeout_s=cfg.timeouts.connect_s)
        return cls(cfg, client, key, CircuitBreaker.from_config(cfg.breaker), budget)

    def with_config(self, cfg: ProviderConfig) -> "ProviderBackend":
        """This provider under new settings (``lmfleet apply``: prices, timeouts, retries): a new backend sharing
        the connection pool, the breaker, the budget and the key. Requests planned on this one keep it, so they
        finish, and are priced, under the settings they were admitted with."""
        twin = copy.copy(self)  # shallow: the pool, breaker, budget, headers and in-flight count are shared
        twin.cfg = cfg
        return twin

    @property
    def in_flight(self) -> int:
        """Requests in flight to this provider, under any of its settings (``max_concurrency`` counts them all)."""
        return self._in_flight[0]

    def endpoint(self, model: str, *, has_fallback: bool) -> Endpoint:
        t = self.cfg.timeouts
        return Endpoint(self.label, f"provider {self.name}", self.cfg.base_url.rstrip("/"), self.cfg.model_map[model],
                        self.client, self._headers, first_token_timeout_s=t.first_token_s, total_timeout_s=t.total_s,
                        idle_timeout_s=t.first_token_s, dialect=self.dialect)

    def healthy(self) -> bool:
        """The breaker lets requests through now (no side effect: see :meth:`acquire`)."""
        return self.breaker.allows()

    async def acquire(self, ask: Ask) -> ProviderSlot | None:
        if not self.breaker.allows():
            return None
        reservation = None
        if self.budget is not None:  # hold the worst case before sending anything
            reservation = await self.budget.reserve(ask.request_id, ask.prompt_upper, ask.max_tokens,
                                                    self.cfg.price, ask.max_model_len, ask.spend_caps)
            if reservation is None:
                return None
        admission = self.breaker.acquire()  # after the await: the breaker may have changed meanwhile
        if admission is None:
            if reservation is not None:
                self.budget.release(reservation)  # type: ignore[union-attr]
            return None
        self._in_flight[0] += 1
        return ProviderSlot(admission, reservation)

    def first_token(self, slot: Any) -> None:
        pass

    def finish(self, slot: Any, output_tokens: int) -> None:
        self._in_flight[0] -= 1
        self.breaker.on_success(ticket=slot.admission)

    def fail(self, slot: Any, err: UpstreamError) -> None:
        self._in_flight[0] -= 1
        if slot.reservation is not None:  # nothing was served: the hold goes back
            self.budget.release(slot.reservation)  # type: ignore[union-attr]
        if isinstance(err, UpstreamRateLimited):
            self.breaker.on_rate_limited(err.retry_after_s)
        elif err.retryable:
            self.breaker.on_failure()

    def break_stream(self, slot: Any, output_tokens: int, *, timed_out: bool) -> None:
        self._in_flight[0] -= 1
        self.breaker.on_failure()

    def cancel(self, slot: Any) -> None:
        self._in_flight[0] -= 1
        self.breaker.release(slot.admission)  # neutral; a cancelled probe frees the probe slot

    def attempts(self, *, last: bool) -> int:
        return 1 + (self.cfg.max_retries if last else 0)

    def backoff_s(self, k: int, last_error: UpstreamError | None) -> float:
        b = self.cfg.breaker
        wait = backoff_s(k, b.backoff_base_s, b.backoff_cap_s)
        if last_error is not None and last_error.retry_after_s:
            wait = max(wait, last_error.retry_after_s)
        return wait

    def charge(self, input_tokens: int, output_tokens: int) -> float:
        return external_cost_usd(input_tokens, output_tokens, self.cfg.price)

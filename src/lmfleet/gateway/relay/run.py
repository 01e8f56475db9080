"""One request's run: try the planned backends in order, relay the answer, record the outcome.

    run = RequestRun(model, req, path, plan, prompt_size, t0, recorder)
    return await run.answer()

The attempt loop is a state machine (:mod:`~lmfleet.gateway.relay.machine`): each attempt ends in one event
(answered, skipped, failed, local attempts over, rejected) and one transition function says where the loop goes.
A failure before anything reached the client moves on to the next attempt (the same backend again per its retry
schedule, then the next backend); after the first streamed byte the stream ends with an explicit error event
(:mod:`~lmfleet.gateway.relay.stream`). Under ``overflow.policy`` ttft_timeout or hedge, a streamed request's
local attempt races the policy's timer (:class:`~lmfleet.gateway.relay.race.Race`, decisions by
:func:`lmfleet.overflow.policies.next_step`). The run talks to backends (:class:`~lmfleet.gateway.relay.backend.
Backend`) and the recorder only; nothing calls back into the router. The answer goes out through
:mod:`~lmfleet.gateway.relay.response`, the outcome to :mod:`~lmfleet.gateway.observe.recorder`; the tenant's
local queue slot is :class:`~lmfleet.gateway.relay.localslot.LocalSlot`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.responses import Response

from lmfleet.gateway.core.errors import GatewayError, UpstreamError, UpstreamMisconfigured, UpstreamRateLimited
from lmfleet.gateway.core.headers import HEDGED, QUEUE_ESTIMATE, ROUTE_REASON, SERVED_BY, UPSTREAM_MODEL
from lmfleet.gateway.core.request import ParsedRequest
from lmfleet.gateway.observe.recorder import Outcome, Recorder
from lmfleet.gateway.observe.tracing import RequestTracer
from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.backend import Ask, Backend
from lmfleet.gateway.relay.localslot import LocalSlot, release
from lmfleet.gateway.relay.machine import Event, Phase, may_send, transition
from lmfleet.gateway.relay.race import CANCELLED, Race, local_error
from lmfleet.gateway.relay.replicaless import NoReplica
from lmfleet.gateway.relay.response import RelayResponse
from lmfleet.gateway.relay.stream import relay_stream
from lmfleet.gateway.relay.upstream import Endpoint, complete, open_stream
from lmfleet.gateway.relay.usage import ESTIMATED, PROVIDER, answer_text, answered_model, estimate
from lmfleet.overflow import Reason
from lmfleet.overflow.policies import Action, AttemptState, Policy, Step, next_step
from lmfleet.tenants.queue import QueueFull

if TYPE_CHECKING:  # routing's types, read by the relay (routing calls the relay, never the other way)
    from lmfleet.gateway.routing.backends import ProviderBackend
    from lmfleet.gateway.routing.router import Plan
    from lmfleet.gateway.routing.served import PromptSize, ServedModel

log = logging.getLogger("lmfleet.gateway")

T = TypeVar("T")

_ID_PREFIX = f"{uuid.uuid4().hex[:12]}-"
_ids = itertools.count()
"""Request ids: unique per process by the counter, across processes and restarts by the random prefix
(a uuid4 per request costs a getrandom system call)."""



class RequestRun:
    """One request across its attempts (the plan's backends, tried in order)."""

    span: Any = None
    """The request's trace span (None: tracing off, the default); set with :attr:`tracer` by the route."""
    tracer: RequestTracer | None = None
    outcome: Outcome | None = None
    """How it ended, once recorded (served by, tokens, status)."""
    ended: tuple[Backend, Any, Outcome] | None = None
    """The answer has ended (the backend, its slot, the outcome): the record stage (:meth:`finish`) records it."""
    _relay_span: Any = None
    hedged = False
    """A provider attempt ran beside the local one (overflow.policy hedge): the answer says so (x-lmfleet-hedged)."""

    def __init__(self, model: ServedModel, req: ParsedRequest, path: str, plan: Plan, prompt: PromptSize,
                 t0: float, recorder: Recorder):
        self.m, self.req, self.path, self.plan = model, req, path, plan
        self.prompt_tokens, self.t0, self.recorder = prompt.tokens, t0, recorder
        self.prompt_upper = prompt.upper
        self.exact_prompt, self._count_prompt = prompt.exact, prompt.count
        counted = model.tokenizer is not None and prompt.exact is None and prompt.count is None
        self.counted_prompt = prompt.tokens if counted else None
        """The tokenizer's count of the prompt once known (None: not counted, or no tokenizer): an answer without
        usage is then counted without tokenizing its prompt again."""
        self.deadline = t0 + model.app.cfg.deployment.request_timeout_s
        # the policy in force at admission: `lmfleet apply` may swap the model's while this request runs
        self.timers, self.threshold_ms = model.timers, model.threshold_ms
        self.reason: Reason = plan.reason
        self.request_id = f"{_ID_PREFIX}{next(_ids):x}"
        self.last_error: UpstreamError | None = None
        self.ticket = plan.ticket
        """The tenant's admission (None: no tenant): tokens are counted on it; whoever answers releases it."""
        self.local_slot = (LocalSlot(model.queue, plan.priority, self.ticket.tenant if self.ticket else "", t0)
                           if model.queue is not None and plan.priority is not None else None)
        """Its place in the model's local priority queue (None: no tenants, or no class)."""

    # ---- answers -----------------------------------------------------------------------------
    async def unary(self) -> Response:
        b, slot, (raw, obj) = await self._first_success(lambda ep: complete(ep, self.path, self.req.body))
        finished = False
        answered = obj.get("model") if isinstance(obj.get("model"), str) and obj.get("model") else None
        try:
            usage, source = sse.usage_of(obj), PROVIDER
            if usage is None:  # never free: counted with the model's tokenizer
                usage, source = await estimate(self.m.tokenizer, self.req.kind, self.req.body, answer_text(obj),
                                               self.prompt_tokens, prompt_counted=self.counted_prompt), ESTIMATED
            if obj.get("model") != self.req.model:  # a provider's own model name never reaches the client
                obj["model"] = self.req.model
                raw = json.dumps(obj).encode()
            b.finish(slot, usage[1])
            finished = True
        finally:
            if not finished:  # whatever went wrong, the slot is freed
                b.cancel(slot)
        self.ended = (b, slot, Outcome(b.label, self.reason.value, usage[0], usage[1], usage_source=source,
                                       upstream_model=answered))
        return Response(raw, media_type="application/json", headers=self._headers(b, answered))

    async def answer(self) -> Any:
        """The answer (:meth:`stream` or :meth:`unary`); with the prompt's count still pending, the upstream call
        runs alongside it and the count (or its context-length 400) is settled before the answer is returned."""
        work = self.stream() if self.req.stream else self.unary()
        if self.exact_prompt is None:
            return await work
        up = asyncio.ensure_future(work)
        try:
            await self._exact_prompt()
        except BaseException:
            up.cancel()
            await asyncio.wait([up])
            if not up.cancelled():
                up.exception()  # retrieved: the count's answer (400, or the client leaving) is the one that counts
            raise
        return await up

    async def _exact_prompt(self) -> None:
        """Settle the prompt's exact count (started now unless already running); reservations use it from here."""
        if self.exact_prompt is None:
            assert self._count_prompt is not None
            self.exact_prompt = asyncio.ensure_future(self._count_prompt())
        n = await self.exact_prompt
        if n is not None:
            self.prompt_tokens = self.prompt_upper = self.counted_prompt = n
        self._count_prompt = None

    async def stream(self) -> Response:
        b, slot, st = await self._first_success(lambda ep: open_stream(ep, self.path, self.req.body), race=True)
        if self.exact_prompt is not None:  # nothing goes to the client before the prompt is known to fit
            try:
                await self.exact_prompt
            except BaseException:
                await st.aclose()
                b.cancel(slot)
                raise
        ttft = time.monotonic() - self.t0
        b.first_token(slot)
        if self.span is not None:
            self._relay_span = self.tracer.start_relay(self.span)  # type: ignore[union-attr]
        answered = answered_model(b"".join(st.head))
        return RelayResponse(relay_stream(self, st, b, slot, ttft, answered),
                             headers={**self._headers(b, answered), "cache-control": "no-cache"})

    # ---- attempts ----------------------------------------------------------------------------
    def _tries(self) -> Iterator[tuple[Backend, int, bool, bool]]:
        """(backend, attempt number, has a later backend, is the very last attempt) in order."""
        backends = self.plan.backends
        for i, b in enumerate(backends):
            later = i < len(backends) - 1
            n = b.attempts(last=not later)
            for k in range(n):
                yield b, k, later, not later and k == n - 1

    async def _first_success(self, call: Callable[[Endpoint], Awaitable[T]],
                             race: bool = False) -> tuple[Backend, Any, T]:
        """Try attempts in order until ``call`` succeeds; returns (backend, its slot, the result).

        The loop is the state machine of :mod:`~lmfleet.gateway.relay.machine`: each attempt ends in one event and
        :func:`~lmfleet.gateway.relay.machine.transition` says where the loop goes next. Only failures before
        anything reached the client come here, so every one may move on. ``race``: ``call`` returns at the first
        token (a stream), so a local attempt may race the policy's timer (:class:`~lmfleet.gateway.relay.race.Race`).
        """
        phase = Phase.TRYING
        attempt = 0
        policy = self.timers.policy
        racing = race and policy in (Policy.TTFT_TIMEOUT, Policy.HEDGE) and bool(self.hedgers())
        local = self.m.local
        for b, k, later, final in self._tries():
            if not may_send(phase, b is local):
                continue
            if k > 0:
                await asyncio.sleep(min(b.backoff_s(k, self.last_error), self.remaining()))
            if self.remaining() <= 0:
                phase = transition(phase, Event.OUT_OF_TIME)
                break
            if self._count_prompt is not None and b.needs_exact_prompt:
                await self._exact_prompt()  # a provider's budget reserves on the count, not on the bound
            slot = await b.acquire(Ask(f"{self.request_id}-{attempt}", self.prompt_tokens, self.prompt_upper,
                                       self.req.max_tokens, self.m.app.max_model_len, self.plan.spend_caps,
                                       streamed=bool(self.req.stream)))
            attempt += 1
            if slot is None:
                phase = transition(phase, Event.SKIPPED)
                continue
            event, won = await self._attempt(b, slot, call, k + 1, later, final, attempt, policy,
                                             racing and b is local)
            phase = transition(phase, event)
            if phase is Phase.SERVED:
                assert won is not None
                return won
            if phase is Phase.GAVE_UP:
                break
        else:
            phase = transition(phase, Event.EXHAUSTED)
        if self.reason is Reason.TTFT_TIMEOUT:
            self.recorder.metrics.ttft_failovers.labels(self.m.name, "failed").inc()
        if self._queue_expired() and self.remaining() > 0:
            raise self._deadline_passed()
        raise self._give_up()

    async def _attempt(self, b: Backend, slot: Any, call: Callable[[Endpoint], Awaitable[T]], attempt_no: int,
                       later: bool, final: bool, n: int, policy: Policy,
                       race: bool) -> tuple[Event, tuple[Backend, Any, T] | None]:
        """One attempt, its backend's slot acquired, to its end: its event, and (backend, slot, result) when it
        answered. ``race``: the local attempt races the policy's timer, and the race settles it."""
        try:
            local = self.local_slot if b is self.m.local else None
            if local is not None and not await local.take(self.remaining):
                b.cancel(slot)
                return (Event.LOCAL_OVER if local.expired else Event.SKIPPED), None
            # overflow.prefill_gate, for a local attempt without a timer racing it (the timer would not run while
            # the attempt waits in the gate)
            if b is self.m.local and self.m.gated and self.req.stream and not race and \
                    not await self.m.local.pass_gate(slot, self.remaining()):
                b.cancel(slot)  # the request's time ran out in the gateway's queue
                if local is not None:
                    local.leave()
                return Event.SKIPPED, None
            ep = b.endpoint(self.req.model, has_fallback=later).within(self.remaining())
            if not race:
                # with a provider after it, a local attempt moves on if Serve has no replica to take it (replicaless)
                with self.m.local.waiting.watch() if b is self.m.local and later else contextlib.nullcontext():
                    result = await call(ep) if self.span is None else await self._traced(call, ep, b, n)
                if self.reason is Reason.TTFT_TIMEOUT:
                    self.recorder.metrics.ttft_failovers.labels(self.m.name, "served").inc()
                return Event.ANSWERED, (b, slot, result)
        except UpstreamError as e:
            b.fail(slot, e)
            if self.local_slot is not None:
                self.local_slot.leave()
            self.failed(b, e, attempt_no, more=not final)
            if not e.retryable:
                return Event.REJECTED, None
            if isinstance(e, NoReplica):
                return Event.LOCAL_OVER, None  # another local attempt would wait for the same missing replica
            if b is self.m.local and policy is not Policy.PREDICTIVE and later and (
                    self._after_local_error(e) is Action.SEND_PROVIDER):
                return Event.LOCAL_OVER, None  # next_step: a local error goes straight to a provider (no local retry)
            return Event.FAILED, None
        except QueueFull as e:
            b.cancel(slot)
            raise GatewayError(429, f"The local queue for {self.m.name!r} is full ({e}).", code="queue_full",
                               headers={**self.plan.headers, "retry-after": "1"}) from None
        except BaseException:  # the client went away (cancellation): free the slot, the upstream call is closed
            self.abandon(b, slot)
            raise
        return await Race(self, b, slot, ep, call, attempt_no, final).outcome()  # it settles the attempt

    def abandon(self, b: Backend, slot: Any) -> None:
        """The client went away during ``b``'s attempt: free its slot, record it (status 499)."""
        b.cancel(slot)
        self.record(b, slot, Outcome(b.label, self.reason.value, self.prompt_tokens, 0, None, CANCELLED,
                                     usage_source=ESTIMATED))

    # ---- overflow.policy: the local attempt against its timer -------------------------------------------------
    def hedgers(self) -> list[ProviderBackend]:
        """The plan's providers (after the local backend): where a hedge or a failover may go."""
        local = self.m.local
        return [b for b in self.plan.backends if b is not local]  # type: ignore[misc]

    def step(self, state: AttemptState, provider_open: bool) -> Step:
        return next_step(self.timers, now=time.monotonic(), estimate_ms=self.plan.estimate_ms,
                         threshold_ms=self.threshold_ms, permissions=self.plan.permissions,
                         provider_open=provider_open, attempt=state)

    def _after_local_error(self, e: UpstreamError) -> Action:
        """What the policy does after the local attempt failed with ``e`` (no hedge running)."""
        return self.step(AttemptState(local_dispatched_at=self.t0, local_error=local_error(e)),
                          any(p.healthy() for p in self.hedgers())).action

    async def _traced(self, call: Callable[[Endpoint], Awaitable[T]], ep: Endpoint, b: Backend, attempt: int) -> T:
        """One attempt in its own span, whose context goes upstream in a ``traceparent`` header."""
        tracer = self.tracer
        assert tracer is not None
        span = tracer.start_attempt(self.span, b.label, attempt)
        try:
            result = await call(dataclasses.replace(ep, headers={**ep.headers, **tracer.traceparent(span)}))
        except BaseException as e:
            tracer.end_attempt(span, e)
            raise
        tracer.end_attempt(span)
        return result

    def _queue_expired(self) -> bool:
        return self.local_slot is not None and self.local_slot.expired

    def _deadline_passed(self) -> GatewayError:
        cls = self.plan.priority
        wait = cls.max_wait_s if cls is not None else 0
        return GatewayError(429, f"No local slot for {self.m.name!r} freed up within the {wait:g} s deadline of class "
                                 f"{cls.name if cls else ''!r}. Please try again later.", type="rate_limit_error",
                            code="queue_deadline_exceeded", headers={**self.plan.headers, "retry-after": "1"})

    def failed(self, b: Backend, e: UpstreamError, attempt_no: int, more: bool) -> None:
        self.last_error = e
        log.warning("model %s: %s attempt %d failed: %s%s", self.m.name, b.label, attempt_no, e.message,
                    " (trying next target)" if more else "")
        self.recorder.metrics.upstream_failures.labels(b.label, type(e).__name__).inc()
        if e.retryable:
            self.recorder.metrics.retries.labels(self.m.name, b.label).inc()
        self.reason = b.fallback_reason

    def _give_up(self) -> GatewayError:
        e, name = self.last_error, self.m.name
        if self.remaining() <= 0:
            return GatewayError(504, f"Request to {name!r} timed out after "
                                     f"{self.m.app.cfg.deployment.request_timeout_s:g} s.", code="timeout")
        if e is not None and not e.retryable and e.status is not None:
            return GatewayError(e.status, e.message, code="upstream_rejected")
        if isinstance(e, UpstreamMisconfigured):  # the provider's own auth/model message is not for the client
            return GatewayError(502, f"Model {name!r} could not be served: an external provider refused the "
                                     "gateway's credentials or model mapping, and no other backend could take "
                                     "the request. The operator has been alerted (lmfleet_upstream_failures).",
                                code="upstream_misconfigured")
        if isinstance(e, UpstreamRateLimited):
            retry = str(max(1, int(e.retry_after_s or 1)))
            return GatewayError(429, f"Model {name!r} is rate limited by every backend: {e.message}",
                                code="rate_limited", headers={"retry-after": retry})
        why = e.message if e else "no backend available"
        local = self.m.local.health.models.get(name)
        return GatewayError(503, f"Model {name!r} is unavailable: {why}. "
                                 f"Local deployment: {local.message if local else 'unknown'}.",
                            code="model_unavailable", headers={"retry-after": "5"})

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # ---- bookkeeping -------------------------------------------------------------------------
    def _headers(self, b: Backend, answered: str | None = None) -> dict[str, str]:
        h = {SERVED_BY: b.label, ROUTE_REASON: self.reason.value, QUEUE_ESTIMATE: f"{self.plan.estimate_ms:.0f}",
             **self.plan.headers}
        if answered is not None and answered.isascii() and answered.isprintable():  # what a header may carry
            h[UPSTREAM_MODEL] = answered
        if self.hedged:
            h[HEDGED] = "1"
        return h

    def record(self, b: Backend, slot: Any, o: Outcome) -> None:
        if b is self.m.local:  # the estimate's error is measured on local answers; the miss margin learns from it
            predicted = o.predicted_wait_ms
            if predicted is None:
                predicted = self.plan.estimate_ms
                o = dataclasses.replace(o, predicted_wait_ms=predicted, admission=self.plan.admission)
            if o.ttft_s is not None and o.status == 200:
                self.m.margin.observe(predicted, o.ttft_s * 1000, self.m.threshold_ms)
            elif o.ttft_s is None and o.status == CANCELLED:  # cancelled before its first token: waited at least this
                self.m.margin.observe(predicted, (time.monotonic() - self.t0) * 1000, self.m.threshold_ms)
        self.outcome = o
        if self._relay_span is not None:
            self.tracer.end_relay(self._relay_span, o.status, o.output_tokens)  # type: ignore[union-attr]
            self._relay_span = None
        ticket = self.ticket
        if ticket is not None:
            ticket.add_tokens(o.input_tokens + o.output_tokens)
        self.recorder.record(self.m.name, o, time.monotonic() - self.t0, b.charge(o.input_tokens, o.output_tokens),
                             slot, ticket.tenant if ticket is not None else None)

    def finish(self) -> None:
        """Stage 8, record: the ended answer's metrics and ledger row (nothing when no answer ended). Idempotent."""
        if self.ended is not None:
            b, slot, o = self.ended
            self.ended = None
            self.record(b, slot, o)

    def release(self) -> None:
        """The request has ended (answered, failed or abandoned): free its tenant's slot in flight and its place
        in the local queue. Idempotent."""
        release(self.ticket, self.local_slot)

"""One request's run: try the planned backends in order, relay the answer, record the outcome.

    run = RequestRun(model, req, path, plan, prompt_size, t0, recorder)
    return await run.answer()

A failure before anything reached the client moves on to the next attempt (the same backend again per
its retry schedule, then the next backend); after the first streamed byte it ends the stream with an
explicit error event. Under ``overflow.policy`` ttft_timeout or hedge, a streamed request's local attempt races
the policy's timer (:meth:`RequestRun._race`, decisions by :func:`lmfleet.overflow.policies.next_step`): at the
timer the local attempt is cancelled and the request goes on to the providers (ttft_timeout), or a provider
attempt starts beside it and the first first token wins (hedge). The run talks to backends and the recorder
only; nothing calls back into the router.
The answer goes out through :mod:`~lmfleet.gateway.relay.response`, the outcome to
:mod:`~lmfleet.gateway.observe.recorder`; the tenant's local queue slot is
:class:`~lmfleet.gateway.relay.localslot.LocalSlot`; the backends are driven through
:class:`~lmfleet.gateway.relay.backend.Backend`.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.responses import Response

from lmfleet.gateway.core.errors import (
    GatewayError,
    UpstreamError,
    UpstreamMisconfigured,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamServerError,
)
from lmfleet.gateway.core.headers import HEDGED, QUEUE_ESTIMATE, ROUTE_REASON, SERVED_BY, UPSTREAM_MODEL
from lmfleet.gateway.core.request import ParsedRequest
from lmfleet.gateway.observe.recorder import Outcome, Recorder
from lmfleet.gateway.observe.tracing import RequestTracer
from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.backend import Ask, Backend
from lmfleet.gateway.relay.localslot import LocalSlot, release
from lmfleet.gateway.relay.response import RelayResponse
from lmfleet.gateway.relay.rewrite import rewrite, take_usage
from lmfleet.gateway.relay.upstream import STREAM_ERRORS, Endpoint, OpenStream, complete, open_stream
from lmfleet.gateway.relay.usage import ESTIMATED, PROVIDER, StreamText, answer_text, answered_model, count_usage, \
    estimate
from lmfleet.overflow import Reason
from lmfleet.overflow.policies import (
    PROVIDER_RECHECK_S,
    Action,
    AttemptState,
    LocalError,
    Policy,
    Step,
    StepReason,
    next_step,
)
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

CANCELLED = 499
"""Status recorded (metrics, ledger) for a request whose client went away before it was answered."""


class RequestRun:
    """One request across its attempts (the plan's backends, tried in order)."""

    span: Any = None
    """The request's trace span (None: tracing off, the default); set with :attr:`tracer` by the route."""
    tracer: RequestTracer | None = None
    outcome: Outcome | None = None
    """How it ended, once recorded (served by, tokens, status)."""
    _relay_span: Any = None
    hedged = False
    """A provider attempt ran beside the local one (overflow.policy hedge): the answer says so (x-lmfleet-hedged)."""
    _settled = False
    """The race (:meth:`_race`) has already failed or dropped the current local attempt (its slot is freed)."""

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
        self._record(b, slot, Outcome(b.label, self.reason.value, usage[0], usage[1], usage_source=source,
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
        return RelayResponse(self._relay(st, b, slot, ttft, answered),
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

        Only failures before anything reached the client come here, so every one may move on. ``race``: ``call``
        returns at the first token (a stream), so a local attempt may race the policy's timer (:meth:`_race`).
        """
        attempt = 0
        policy = self.m.timers.policy
        skip_local = False
        for b, k, later, final in self._tries():
            if b is self.m.local and (skip_local or self._queue_expired()):
                continue  # its class's deadline in the local queue has passed, or the policy moved on to a provider
            if k > 0:
                await asyncio.sleep(min(b.backoff_s(k, self.last_error), self._remaining()))
            if self._remaining() <= 0:
                break
            if b is not self.m.local and self._count_prompt is not None:
                await self._exact_prompt()  # a provider's budget reserves on the count, not on the bound
            slot = await b.acquire(Ask(f"{self.request_id}-{attempt}", self.prompt_tokens, self.prompt_upper,
                                       self.req.max_tokens, self.m.app.max_model_len, self.plan.spend_caps,
                                       streamed=bool(self.req.stream)))
            attempt += 1
            if slot is None:
                continue
            try:
                local = self.local_slot if b is self.m.local else None
                if local is not None and not await local.take(self._remaining):
                    b.cancel(slot)
                    continue
                ep = b.endpoint(self.req.model, has_fallback=later).within(self._remaining())
                if race and b is self.m.local and policy in (Policy.TTFT_TIMEOUT, Policy.HEDGE) and self._hedgers():
                    self._settled = False
                    won = await self._race(b, slot, ep, call, k + 1, final)
                    if isinstance(won, tuple):
                        return won
                    if won is _STOP:
                        break
                    skip_local = won is _TO_PROVIDERS
                    continue
                result = await call(ep) if self.span is None else await self._traced(call, ep, b, attempt)
                if self.reason is Reason.TTFT_TIMEOUT:
                    self.recorder.metrics.ttft_failovers.labels(self.m.name, "served").inc()
                return b, slot, result
            except UpstreamError as e:
                b.fail(slot, e)
                if self.local_slot is not None:
                    self.local_slot.leave()
                self._failed(b, e, k + 1, more=not final)
                if not e.retryable:
                    break
                if b is self.m.local and policy is not Policy.PREDICTIVE and later:
                    # next_step: a local error goes straight to a provider under these policies (no local retry)
                    skip_local = self._after_local_error(e) is Action.SEND_PROVIDER
            except QueueFull as e:
                b.cancel(slot)
                raise GatewayError(429, f"The local queue for {self.m.name!r} is full ({e}).", code="queue_full",
                                   headers={**self.plan.headers, "retry-after": "1"}) from None
            except BaseException:  # the client went away (cancellation): free the slot, the upstream call is closed
                if self._settled:  # a race already failed or dropped this attempt
                    raise
                b.cancel(slot)
                self._record(b, slot, Outcome(b.label, self.reason.value, self.prompt_tokens, 0, None, CANCELLED,
                                              usage_source=ESTIMATED))
                raise
        if self.reason is Reason.TTFT_TIMEOUT:
            self.recorder.metrics.ttft_failovers.labels(self.m.name, "failed").inc()
        if self._queue_expired() and self._remaining() > 0:
            raise self._deadline_passed()
        raise self._give_up()

    # ---- overflow.policy: the local attempt against its timer -------------------------------------------------
    def _hedgers(self) -> list[ProviderBackend]:
        """The plan's providers (after the local backend): where a hedge or a failover may go."""
        local = self.m.local
        return [b for b in self.plan.backends if b is not local]  # type: ignore[misc]

    def _step(self, state: AttemptState, provider_open: bool) -> Step:
        return next_step(self.m.timers, now=time.monotonic(), estimate_ms=self.plan.estimate_ms,
                         threshold_ms=self.m.threshold_ms, permissions=self.plan.permissions,
                         provider_open=provider_open, attempt=state)

    def _after_local_error(self, e: UpstreamError) -> Action:
        """What the policy does after the local attempt failed with ``e`` (no hedge running)."""
        return self._step(AttemptState(local_dispatched_at=self.t0, local_error=_local_error(e)),
                          any(p.healthy() for p in self._hedgers())).action

    async def _race(self, b: Backend, slot: Any, ep: Endpoint, call: Callable[[Endpoint], Awaitable[T]],
                    attempt_no: int, final: bool) -> tuple[Backend, Any, T] | object:
        """One local attempt under ttft_timeout or hedge: run it against the policy's timer, asking
        :func:`~lmfleet.overflow.policies.next_step` at each event (a first token, an error, the timer).

        Returns the winner (backend, slot, open stream), or what the attempt loop does next: :data:`_TO_PROVIDERS`
        (the local attempt is over: only the later backends, no local retry), :data:`_RETRY` (the local attempt
        failed: go on as after any failure) or :data:`_STOP` (give up with the last error). Every attempt it
        drops is cancelled upstream (closing its connection makes Serve abort it in vLLM, a provider stop
        generating) and recorded in the ledger with status 499: its prompt and what it generated are paid for.
        """
        m = self.m
        metrics = self.recorder.metrics
        state = AttemptState(local_dispatched_at=self.t0)  # the timer counts from the request's arrival
        local: asyncio.Task = asyncio.create_task(call(ep))
        hedge: asyncio.Task | None = None
        hb: ProviderBackend | None = None
        hslot: Any = None
        local_exc: UpstreamError | None = None
        closed_until = 0.0  # no provider took the hedge or the failover: ask again after this
        try:
            while True:
                step = self._step(state, time.monotonic() >= closed_until
                                  and any(p.healthy() for p in self._hedgers()))
                act = step.action
                if act is Action.WAIT:
                    running = [t for t in (local, hedge) if t is not None and not t.done()]
                    timeout = None if step.wake_at is None else max(0.0, step.wake_at - time.monotonic())
                    if running:
                        await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                    else:  # not reached: the table waits on an event only while an attempt runs
                        await asyncio.sleep(timeout if timeout is not None else PROVIDER_RECHECK_S)
                    now = time.monotonic()
                    if local.done() and state.local_first_token_at is None and state.local_error is None:
                        exc = local.exception()
                        if exc is None:
                            state = dataclasses.replace(state, local_first_token_at=now)
                        elif isinstance(exc, UpstreamError):
                            local_exc = exc
                            state = dataclasses.replace(state, local_error=_local_error(exc))
                            self._local_failed(b, slot, exc, attempt_no, more=not final or hedge is not None)
                        else:
                            raise exc
                    if (hedge is not None and hedge.done() and state.hedge_first_token_at is None
                            and not state.hedge_failed):
                        exc = hedge.exception()
                        if exc is None:
                            state = dataclasses.replace(state, hedge_first_token_at=now)
                        elif isinstance(exc, UpstreamError):
                            state = dataclasses.replace(state, hedge_failed=True)
                            assert hb is not None
                            hb.fail(hslot, exc)
                            self._failed(hb, exc, 1, more=state.local_error is None)
                            metrics.hedges.labels(m.name, "failed").inc()
                        else:
                            raise exc
                    continue
                if act is Action.STREAM:  # one attempt has its first token, the other is gone
                    if state.local_first_token_at is not None:
                        return b, slot, local.result()
                    assert hedge is not None and hb is not None
                    self.reason = Reason.HEDGE_WON
                    metrics.hedges.labels(m.name, "won").inc()
                    return hb, hslot, hedge.result()
                if act is Action.CANCEL_HEDGE:
                    self.reason = Reason.HEDGE_LOCAL_WON
                    if not state.hedge_failed:
                        assert hedge is not None and hb is not None
                        await self._drop(hedge, hb, hslot, Reason.HEDGE_CANCELLED)
                        metrics.hedges.labels(m.name, "lost").inc()
                    hedge = None
                    return b, slot, local.result()
                if act is Action.CANCEL_LOCAL:
                    assert hedge is not None and hb is not None
                    await self._drop(local, b, slot, Reason.HEDGE_CANCELLED)
                    self.reason = Reason.HEDGE_WON
                    metrics.hedges.labels(m.name, "won").inc()
                    return hb, hslot, hedge.result()
                if act in (Action.START_HEDGE, Action.FAIL_OVER):
                    if act is Action.FAIL_OVER:
                        await self._drop(local, b, slot, Reason.TTFT_TIMEOUT_CANCELLED)
                        self.reason = Reason.TTFT_TIMEOUT
                        metrics.ttft_failovers.labels(m.name, "started").inc()
                        return _TO_PROVIDERS
                    hedge, hb, hslot = await self._start_hedge(call)
                    if hedge is None:
                        closed_until = time.monotonic() + PROVIDER_RECHECK_S
                        continue
                    self.hedged = True
                    metrics.hedges.labels(m.name, "started").inc()
                    state = dataclasses.replace(state, hedge_started_at=time.monotonic())
                    continue
                # the local attempt failed (its bookkeeping is done), no hedge is left to answer
                if act is Action.SEND_PROVIDER:
                    return _TO_PROVIDERS
                if step.reason is StepReason.HEDGE_FAILED or (local_exc is not None and not local_exc.retryable):
                    return _STOP
                return _RETRY
        except BaseException:
            # the client went away (or a bug): the hedge is dropped here, the local attempt by the caller
            if hedge is not None and hb is not None and not state.hedge_failed:
                await self._drop(hedge, hb, hslot, Reason.HEDGE_CANCELLED)
            if not local.done():
                local.cancel()
            elif not local.cancelled() and local.exception() is None:
                await local.result().aclose()
            raise

    async def _start_hedge(self, call: Callable[[Endpoint], Awaitable[T]]
                           ) -> tuple[asyncio.Task | None, ProviderBackend | None, Any]:
        """Send the request to the first provider that takes it (breaker, in-flight cap, budget and the tenant's
        caps, as any provider attempt); (None, None, None) when none does now."""
        for p in self._hedgers():
            slot = await p.acquire(Ask(f"{self.request_id}-h", self.prompt_tokens, self.prompt_upper,
                                       self.req.max_tokens, self.m.app.max_model_len, self.plan.spend_caps))
            if slot is not None:
                ep = p.endpoint(self.req.model, has_fallback=False).within(self._remaining())
                return asyncio.create_task(call(ep)), p, slot
        return None, None, None

    async def _drop(self, task: asyncio.Task, b: Backend, slot: Any, reason: Reason) -> None:
        """Cancel one attempt of the race (closing its connection cancels it upstream) and record it: the prompt
        (prefilled, or at least sent) and whatever it generated before it was dropped, status 499."""
        generated = 0
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if task.done() and not task.cancelled() and task.exception() is None:
            st = task.result()
            generated = sse.count_choices(b"".join(st.head))
            await st.aclose()
        elif task.done() and not task.cancelled() and isinstance(task.exception(), UpstreamError):
            b.fail(slot, task.exception())  # it failed just before it was dropped: a failure, nothing to record
            self._leave(b)
            return
        b.cancel(slot)
        self._leave(b)
        self._record(b, slot, Outcome(b.label, reason.value, self.prompt_tokens, generated, None, CANCELLED,
                                      usage_source=ESTIMATED))

    def _leave(self, b: Backend) -> None:
        if b is self.m.local:
            self._settled = True
            if self.local_slot is not None:
                self.local_slot.leave()

    def _local_failed(self, b: Backend, slot: Any, e: UpstreamError, attempt_no: int, more: bool) -> None:
        b.fail(slot, e)
        self._leave(b)
        self._failed(b, e, attempt_no, more=more)

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

    def _failed(self, b: Backend, e: UpstreamError, attempt_no: int, more: bool) -> None:
        self.last_error = e
        log.warning("model %s: %s attempt %d failed: %s%s", self.m.name, b.label, attempt_no, e.message,
                    " (trying next target)" if more else "")
        self.recorder.metrics.upstream_failures.labels(b.label, type(e).__name__).inc()
        if e.retryable:
            self.recorder.metrics.retries.labels(self.m.name, b.label).inc()
        self.reason = b.fallback_reason

    def _give_up(self) -> GatewayError:
        e, name = self.last_error, self.m.name
        if self._remaining() <= 0:
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

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    # ---- relay -------------------------------------------------------------------------------
    async def _relay(self, st: OpenStream, b: Backend, slot: Any, ttft: float,
                     answered: str | None) -> AsyncIterator[bytes]:
        """Relay the stream: what arrives together goes out together, as the backend's own bytes.

        Most reads (a local model's token events) pass through untouched after a few substring scans; only
        a read that carries the usage event, an error event, or a provider's own model name is parsed
        (``answered``: the name its first events carry). A provider's blocks are kept (:class:`StreamText`) to
        count the answer's tokens should no usage arrive; a local engine always sends usage (its chunks count
        otherwise), and its token events are not held or parsed.
        """
        usage: tuple[int, int] | None = None
        chunks = 0
        done = False
        status = 200
        seen = StreamText() if b is not self.m.local else None
        renamed = st.endpoint.upstream_model != self.req.model or answered not in (None, self.req.model)
        rename = self.req.model if renamed else None
        try:
            async with asyncio.timeout(max(0.0, self._remaining())):
                async for block in st.blocks():
                    if rename is not None or b'"error"' in block:
                        block, n, usage, done, failed = rewrite(sse.split_events(block), usage, done,
                                                                 rename, self.req.wants_usage)
                        if failed:
                            status = 502
                    elif b'"usage":' in block:  # the usage event (one per stream): only it is parsed
                        block, usage = take_usage(block, usage, self.req.wants_usage)
                        n = sse.count_choices(block)
                        done = done or sse.DONE in block
                    else:
                        n = sse.count_choices(block)
                        done = done or sse.DONE in block
                    chunks += n
                    if block:  # one write, no waiting for more
                        if seen is not None:
                            seen.add(block)
                        yield block
            if not done and status == 200:
                status = 502
                yield sse.error_event(f"the stream from {b.label} ended without [DONE] after {chunks} chunks",
                                      code="upstream_truncated")
        except TimeoutError:
            status = 504
            yield sse.error_event(f"request exceeded {self.m.app.cfg.deployment.request_timeout_s:g} s",
                                  code="timeout")
        except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream: neutral, recorded
            status = CANCELLED
            raise
        except STREAM_ERRORS as ex:
            status = 502
            log.warning("model %s: stream from %s broke after %d chunks: %s", self.m.name, b.label, chunks,
                        type(ex).__name__)
            yield sse.error_event(f"the stream from {b.label} broke after {chunks} chunks ({type(ex).__name__})",
                                  code="upstream_stream_error")
        finally:
            await st.aclose()
            source = PROVIDER
            if usage is None:  # never free: counted with the model's tokenizer
                source = ESTIMATED
                text = seen.text() if seen is not None else None
                args = (self.m.tokenizer, self.req.kind, self.req.body, text, self.prompt_tokens, chunks,
                        self.counted_prompt)
                # a client that left cancels the task: counted here and now, no await that could be cut short (a
                # prompt counted for the context check is not tokenized again)
                usage = count_usage(*args) if status == CANCELLED else await estimate(*args)
            in_tokens, out_tokens = usage
            if status == 200:
                b.finish(slot, out_tokens)
            elif status == CANCELLED:
                b.cancel(slot)
            else:
                b.break_stream(slot, out_tokens, timed_out=status == 504)
            self._record(b, slot, Outcome(b.label, self.reason.value, in_tokens, out_tokens, ttft, status,
                                          usage_source=source, upstream_model=answered))

    # ---- bookkeeping -------------------------------------------------------------------------
    def _headers(self, b: Backend, answered: str | None = None) -> dict[str, str]:
        h = {SERVED_BY: b.label, ROUTE_REASON: self.reason.value, QUEUE_ESTIMATE: f"{self.plan.estimate_ms:.0f}",
             **self.plan.headers}
        if answered is not None and answered.isascii() and answered.isprintable():  # what a header may carry
            h[UPSTREAM_MODEL] = answered
        if self.hedged:
            h[HEDGED] = "1"
        return h

    def _record(self, b: Backend, slot: Any, o: Outcome) -> None:
        if b is self.m.local:  # the estimate's error is measured on local answers; the miss margin learns from it
            predicted = o.predicted_wait_ms
            if predicted is None:
                predicted = self.plan.estimate_ms
                o = dataclasses.replace(o, predicted_wait_ms=predicted)
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

    def release(self) -> None:
        """The request has ended (answered, failed or abandoned): free its tenant's slot in flight and its place
        in the local queue. Idempotent."""
        release(self.ticket, self.local_slot)


_TO_PROVIDERS, _RETRY, _STOP = object(), object(), object()
"""What the attempt loop does after a race without a winner (:meth:`RequestRun._race`)."""


def _local_error(e: UpstreamError) -> LocalError:
    """How a local attempt failed, as :func:`~lmfleet.overflow.policies.next_step` reads it."""
    if isinstance(e, UpstreamRateLimited):
        return LocalError.RATE_LIMITED
    if isinstance(e, (UpstreamRejected, UpstreamMisconfigured)):
        return LocalError.CLIENT_ERROR
    if isinstance(e, UpstreamServerError):
        return LocalError.UNAVAILABLE if e.status == 503 else LocalError.SERVER_ERROR
    return LocalError.UNREACHABLE  # unreachable, reset, or timed out

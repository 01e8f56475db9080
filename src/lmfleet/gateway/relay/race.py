"""A streamed request's local attempt against the policy's timer (``overflow.policy`` ttft_timeout or hedge).

    event, winner = await Race(run, local, slot, endpoint, call, attempt_no, final).outcome()

At each event (a first token, an error, the timer) the race asks :func:`lmfleet.overflow.policies.next_step` what
to do: wait, start a hedge beside the local attempt, fail over (cancel the local attempt, then the providers), or
cancel the attempt that lost. It ends with the winner (:attr:`~lmfleet.gateway.relay.machine.Event.ANSWERED`) or
with the event the attempt loop goes on with (:func:`~lmfleet.gateway.relay.machine.race_event`).

The race owns its attempts from start to end, whatever happens (a winner, a failure, the client leaving): it
frees their slots and records the ones it drops, so the loop never settles them again. Every attempt it drops is
cancelled upstream (closing its connection makes Serve abort it in vLLM, a provider stop generating) and recorded
in the ledger with status 499: its prompt and what it generated are paid for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from lmfleet.gateway.core.errors import (
    UpstreamError,
    UpstreamMisconfigured,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamServerError,
)
from lmfleet.gateway.observe.recorder import Outcome
from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.backend import Ask, Backend
from lmfleet.gateway.relay.machine import Event, race_event
from lmfleet.gateway.relay.upstream import Endpoint
from lmfleet.gateway.relay.usage import ESTIMATED
from lmfleet.overflow import Reason
from lmfleet.overflow.policies import PROVIDER_RECHECK_S, Action, AttemptState, LocalError

if TYPE_CHECKING:
    from lmfleet.gateway.relay.run import RequestRun

T = TypeVar("T")

CANCELLED = 499
"""Status recorded (metrics, ledger) for a request whose client went away before it was answered."""


class Race(Generic[T]):
    """One local attempt (its slot taken, its endpoint set) against the policy's timer, and the hedge it may start."""

    def __init__(self, run: RequestRun, b: Backend, slot: Any, ep: Endpoint, call: Callable[[Endpoint], Awaitable[T]],
                 attempt_no: int, final: bool):
        self.run, self.b, self.slot, self.ep, self.call = run, b, slot, ep, call
        self.attempt_no, self.final = attempt_no, final
        self.local_over = False
        """The local attempt failed or was dropped: its slot is freed (and a drop recorded)."""

    async def outcome(self) -> tuple[Event, tuple[Backend, Any, T] | None]:
        """The race to its end: (ANSWERED, the winner's (backend, slot, open stream)), or (the loop's event, None)."""
        run, b, slot = self.run, self.b, self.slot
        m = run.m
        metrics = run.recorder.metrics
        hedgers = run.hedgers()
        state = AttemptState(local_dispatched_at=run.t0)  # the timer counts from the request's arrival
        local: asyncio.Task = asyncio.create_task(self._local_call())
        hedge: asyncio.Task | None = None
        hb: Backend | None = None
        hslot: Any = None
        local_exc: UpstreamError | None = None
        closed_until = 0.0  # no provider took the hedge or the failover: ask again after this
        try:
            while True:
                step = run.step(state, time.monotonic() >= closed_until
                                and any(p.healthy() for p in hedgers))  # type: ignore[attr-defined]
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
                            state = dataclasses.replace(state, local_error=local_error(exc))
                            b.fail(slot, exc)
                            self._local_over(b)
                            run.failed(b, exc, self.attempt_no, more=not self.final or hedge is not None)
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
                            run.failed(hb, exc, 1, more=state.local_error is None)
                            metrics.hedges.labels(m.name, "failed").inc()
                        else:
                            raise exc
                    continue
                if act is Action.STREAM:  # one attempt has its first token, the other is gone
                    if state.local_first_token_at is not None:
                        return Event.ANSWERED, (b, slot, local.result())
                    assert hedge is not None and hb is not None
                    run.reason = Reason.HEDGE_WON
                    metrics.hedges.labels(m.name, "won").inc()
                    return Event.ANSWERED, (hb, hslot, hedge.result())
                if act is Action.CANCEL_HEDGE:
                    run.reason = Reason.HEDGE_LOCAL_WON
                    if not state.hedge_failed:
                        assert hedge is not None and hb is not None
                        await self._drop(hedge, hb, hslot, Reason.HEDGE_CANCELLED)
                        metrics.hedges.labels(m.name, "lost").inc()
                    hedge = None
                    return Event.ANSWERED, (b, slot, local.result())
                if act is Action.CANCEL_LOCAL:
                    assert hedge is not None and hb is not None
                    await self._drop(local, b, slot, Reason.HEDGE_CANCELLED)
                    run.reason = Reason.HEDGE_WON
                    metrics.hedges.labels(m.name, "won").inc()
                    return Event.ANSWERED, (hb, hslot, hedge.result())
                if act is Action.FAIL_OVER:
                    await self._drop(local, b, slot, Reason.TTFT_TIMEOUT_CANCELLED)
                    run.reason = Reason.TTFT_TIMEOUT
                    metrics.ttft_failovers.labels(m.name, "started").inc()
                    return race_event(step, True), None
                if act is Action.START_HEDGE:
                    hedge, hb, hslot = await self._start_hedge(hedgers)
                    if hedge is None:
                        closed_until = time.monotonic() + PROVIDER_RECHECK_S
                        continue
                    run.hedged = True
                    metrics.hedges.labels(m.name, "started").inc()
                    state = dataclasses.replace(state, hedge_started_at=time.monotonic())
                    continue
                # the local attempt failed (its bookkeeping is done), no hedge is left to answer
                return race_event(step, local_exc is None or local_exc.retryable), None
        except BaseException:
            # the client went away (or a bug): drop whatever still runs; the local attempt is recorded as cancelled
            if hedge is not None and hb is not None and not state.hedge_failed:
                await self._drop(hedge, hb, hslot, Reason.HEDGE_CANCELLED)
            if not local.done():
                local.cancel()
            elif not local.cancelled() and local.exception() is None:
                await local.result().aclose()
            if not self.local_over:
                run.abandon(b, slot)
            raise

    async def _local_call(self) -> T:
        """The local attempt, moved on (:class:`~lmfleet.gateway.relay.replicaless.NoReplica`, a local error) when
        Serve has no replica to hold it (:mod:`~lmfleet.gateway.relay.replicaless`)."""
        with self.run.m.local.waiting.watch():
            return await self.call(self.ep)

    async def _start_hedge(self, hedgers: list[Backend]) -> tuple[asyncio.Task | None, Backend | None, Any]:
        """Send the request to the first provider that takes it (breaker, in-flight cap, budget and the tenant's
        caps, as any provider attempt); (None, None, None) when none does now."""
        run = self.run
        for p in hedgers:
            slot = await p.acquire(Ask(f"{run.request_id}-h", run.prompt_tokens, run.prompt_upper,
                                       run.req.max_tokens, run.m.app.max_model_len, run.plan.spend_caps))
            if slot is not None:
                ep = p.endpoint(run.req.model, has_fallback=False).within(run.remaining())
                return asyncio.create_task(self.call(ep)), p, slot
        return None, None, None

    async def _drop(self, task: asyncio.Task, b: Backend, slot: Any, reason: Reason) -> None:
        """Cancel one attempt of the race (closing its connection cancels it upstream) and record it: the prompt
        (prefilled, or at least sent) and whatever it generated before it was dropped, status 499."""
        run = self.run
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
            self._local_over(b)
            return
        b.cancel(slot)
        self._local_over(b)
        run.record(b, slot, Outcome(b.label, reason.value, run.prompt_tokens, generated, None, CANCELLED,
                                    usage_source=ESTIMATED))

    def _local_over(self, b: Backend) -> None:
        """``b``'s attempt is settled; the local one frees its place in the local queue."""
        if b is self.b:
            self.local_over = True
            if self.run.local_slot is not None:
                self.run.local_slot.leave()


def local_error(e: UpstreamError) -> LocalError:
    """How a local attempt failed, as :func:`~lmfleet.overflow.policies.next_step` reads it."""
    if isinstance(e, UpstreamRateLimited):
        return LocalError.RATE_LIMITED
    if isinstance(e, (UpstreamRejected, UpstreamMisconfigured)):
        return LocalError.CLIENT_ERROR
    if isinstance(e, UpstreamServerError):
        return LocalError.UNAVAILABLE if e.status == 503 else LocalError.SERVER_ERROR
    return LocalError.UNREACHABLE  # unreachable, reset, or timed out

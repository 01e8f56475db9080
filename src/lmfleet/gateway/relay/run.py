"""One request's run: try the planned backends in order, relay the answer, record the outcome.

    run = RequestRun(model, req, path, plan, prompt_size, t0, recorder)
    return await (run.stream() if req.stream else run.unary())

A failure before anything reached the client moves on to the next attempt (the same backend again per
its retry schedule, then the next backend); after the first streamed byte it ends the stream with an
explicit error event. The run talks to backends and the recorder only; nothing calls back into the router.
The answer goes out through :mod:`~lmfleet.gateway.relay.response`, the outcome to
:mod:`~lmfleet.gateway.observe.recorder`; the tenant's local queue slot is
:class:`~lmfleet.gateway.front.tenancy.LocalSlot`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from starlette.responses import Response

from lmfleet.gateway.front.tenancy import LocalSlot, release
from lmfleet.gateway.front.errors import GatewayError, UpstreamError, UpstreamMisconfigured, UpstreamRateLimited
from lmfleet.gateway.front.validation import ParsedRequest
from lmfleet.gateway.observe.recorder import Outcome, Recorder
from lmfleet.gateway.observe.tracing import RequestTracer
from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.response import RelayResponse
from lmfleet.gateway.relay.rewrite import rewrite, take_usage
from lmfleet.gateway.relay.upstream import STREAM_ERRORS, Endpoint, OpenStream, complete, open_stream
from lmfleet.gateway.relay.usage import ESTIMATED, PROVIDER, StreamText, answer_text, answered_model, count_usage, \
    estimate
from lmfleet.gateway.routing.backends import Ask, Backend
from lmfleet.gateway.routing.router import Plan
from lmfleet.gateway.routing.served import PromptSize, ServedModel
from lmfleet.overflow import Reason
from lmfleet.tenants.queue import QueueFull

log = logging.getLogger("lmfleet.gateway")

SERVED_BY = "x-lmfleet-served-by"
ROUTE_REASON = "x-lmfleet-route-reason"
QUEUE_ESTIMATE = "x-lmfleet-queue-estimate-ms"
UPSTREAM_MODEL = "x-lmfleet-upstream-model"
"""The model name the backend answered with (the client's own name is in the body)."""

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

    def __init__(self, model: ServedModel, req: ParsedRequest, path: str, plan: Plan, prompt: PromptSize,
                 t0: float, recorder: Recorder):
        self.m, self.req, self.path, self.plan = model, req, path, plan
        self.prompt_tokens, self.t0, self.recorder = prompt.tokens, t0, recorder
        self.prompt_upper = prompt.upper
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
                                               self.prompt_tokens), ESTIMATED
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

    async def stream(self) -> Response:
        b, slot, st = await self._first_success(lambda ep: open_stream(ep, self.path, self.req.body))
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

    async def _first_success(self, call: Callable[[Endpoint], Awaitable[T]]) -> tuple[Backend, Any, T]:
        """Try attempts in order until ``call`` succeeds; returns (backend, its slot, the result).

        Only failures before anything reached the client come here, so every one may move on.
        """
        attempt = 0
        for b, k, later, final in self._tries():
            if self._queue_expired() and b is self.m.local:
                continue  # its class's deadline in the local queue has passed: only a later backend may serve
            if k > 0:
                await asyncio.sleep(min(b.backoff_s(k, self.last_error), self._remaining()))
            if self._remaining() <= 0:
                break
            slot = await b.acquire(Ask(f"{self.request_id}-{attempt}", self.prompt_tokens, self.prompt_upper,
                                       self.req.max_tokens, self.m.app.max_model_len, self.plan.spend_caps))
            attempt += 1
            if slot is None:
                continue
            try:
                local = self.local_slot if b is self.m.local else None
                if local is not None and not await local.take(self._remaining):
                    b.cancel(slot)
                    continue
                ep = b.endpoint(self.req.model, has_fallback=later).within(self._remaining())
                if self.span is None:
                    return b, slot, await call(ep)
                return b, slot, await self._traced(call, ep, b, attempt)
            except UpstreamError as e:
                b.fail(slot, e)
                if self.local_slot is not None:
                    self.local_slot.leave()
                self._failed(b, e, k + 1, more=not final)
                if not e.retryable:
                    break
            except QueueFull as e:
                b.cancel(slot)
                raise GatewayError(429, f"The local queue for {self.m.name!r} is full ({e}).", code="queue_full",
                                   headers={**self.plan.headers, "retry-after": "1"}) from None
            except BaseException:  # the client went away (cancellation): free the slot, the upstream call is closed
                b.cancel(slot)
                self._record(b, slot, Outcome(b.label, self.reason.value, self.prompt_tokens, 0, None, CANCELLED,
                                              usage_source=ESTIMATED))
                raise
        if self._queue_expired() and self._remaining() > 0:
            raise self._deadline_passed()
        raise self._give_up()

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
                args = (self.m.tokenizer, self.req.kind, self.req.body, text, self.prompt_tokens, chunks)
                # a client that left cancels the task: counted here and now, no await that could be cut short
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
        return h

    def _record(self, b: Backend, slot: Any, o: Outcome) -> None:
        self.outcome = o
        if self._relay_span is not None:
            self.tracer.end_relay(self._relay_span, o.status, o.output_tokens)  # type: ignore[union-attr]
            self._relay_span = None
        ticket = self.ticket
        if ticket is not None:
            ticket.add_tokens(o.input_tokens + o.output_tokens)
        self.recorder.record(self.m.name, b, o, time.monotonic() - self.t0, slot,
                             ticket.tenant if ticket is not None else None)

    def release(self) -> None:
        """The request has ended (answered, failed or abandoned): free its tenant's slot in flight and its place
        in the local queue. Idempotent."""
        release(self.ticket, self.local_slot)

"""One request's run: try the planned backends in order, relay the answer, record the outcome.

    run = RequestRun(model, req, path, plan, prompt_size, t0, recorder)
    return await (run.stream() if req.stream else run.unary())

A failure before anything reached the client moves on to the next attempt (the same backend again per
its retry schedule, then the next backend); after the first streamed byte it ends the stream with an
explicit error event. The run talks to backends and the recorder only; nothing calls back into the router.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import uuid
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from lmfleet.gateway import sse
from lmfleet.gateway.backends import Ask, Backend
from lmfleet.gateway.errors import GatewayError, UpstreamError, UpstreamMisconfigured, UpstreamRateLimited
from lmfleet.gateway.metrics import GatewayMetrics
from lmfleet.gateway.router import Plan, PromptSize, ServedModel
from lmfleet.gateway.upstream import STREAM_ERRORS, Endpoint, OpenStream, complete, open_stream
from lmfleet.gateway.validation import ParsedRequest
from lmfleet.overflow import Reason
from lmfleet.overflow.money import usd_to_nusd
from lmfleet.store import Ledger, SpendStore, StoreUnavailable, UsageRecord
from lmfleet.gateway.tracing import RequestTracer
from lmfleet.tenants.queue import QueueFull

log = logging.getLogger("lmfleet.gateway")

SERVED_BY = "x-lmfleet-served-by"
ROUTE_REASON = "x-lmfleet-route-reason"
QUEUE_ESTIMATE = "x-lmfleet-queue-estimate-ms"

T = TypeVar("T")

LAST_EVENT = sse.DONE + b"\n\n"
"""How a relayed stream's last block ends."""

_ID_PREFIX = f"{uuid.uuid4().hex[:12]}-"
_ids = itertools.count()
"""Request ids: unique per process by the counter, across processes and restarts by the random prefix
(a uuid4 per request costs a getrandom system call)."""

CANCELLED = 499
"""Status recorded (metrics, ledger) for a request whose client went away before it was answered."""


@dataclass(frozen=True)
class Outcome:
    """What one served request cost and how it went, for metrics and the ledger."""

    served_by: str
    reason: str
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    status: int = 200


TRANSIENT_WRITE_ERRORS: tuple[type[BaseException], ...] = (sqlite3.OperationalError, OSError, StoreUnavailable)
"""Ledger write failures worth retrying: the database is locked, full, unreachable or being restarted. Anything
else (a bug, a row the schema refuses) would fail again: it is logged and the row dropped, as before."""


class Recorder:
    """Metrics and the cost ledger of finished requests.

    Ledger writes (and budget settlements, which write the ledger row in the same transaction) run off the
    event loop, one at a time, in the order they were submitted. A write that fails for a transient reason
    (:data:`TRANSIENT_WRITE_ERRORS`) is retried with backoff until it lands, the rows behind it waiting in
    order, so a locked, full or restarting database loses no row; at most :attr:`max_pending` rows wait
    (more are dropped and counted), and :meth:`close` waits for them at most :attr:`close_deadline_s`.
    """

    retry_first_s = 0.5
    retry_max_s = 5.0
    close_deadline_s = 10.0
    max_pending = 100_000

    def __init__(self, metrics: GatewayMetrics, ledger: Ledger | None, model_names: set[str],
                 store: SpendStore | None = None):
        self.metrics = metrics
        self.ledger = ledger
        self.store = store
        self._model_names = model_names
        self._queue: asyncio.Queue[Callable[[], Any]] = asyncio.Queue()
        self._writer: asyncio.Task | None = None
        self._metric_children: dict[tuple[str, str, int], tuple[Any, ...]] = {}
        self._tenant_metric_children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
        self.failing_since: float | None = None
        """When the write at the head of the queue first failed (None: writes land)."""
        self.dropped = 0

    def start(self) -> None:
        if self.ledger is not None and self._writer is None:
            self._writer = asyncio.create_task(self._write())

    def submit(self, write: Callable[[], Any]) -> None:
        """Run ``write`` (blocking I/O) in the writer, after everything submitted before it."""
        if self._queue.qsize() >= self.max_pending:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                log.error("ledger unavailable and %d rows waiting: %d rows dropped so far", self._queue.qsize(),
                          self.dropped)
            return
        self._queue.put_nowait(write)

    def status(self) -> dict[str, Any] | None:
        """The ledger writer's state for /ready (None without a ledger); also published to the metrics."""
        if self.ledger is None:
            return None
        failing = self.failing_since is not None
        self.metrics.ledger_pending.set(self.pending)
        self.metrics.ledger_failing.set(1 if failing else 0)
        self.metrics.ledger_dropped.set(self.dropped)
        return {"up": not failing, "pending_rows": self.pending, "dropped_rows": self.dropped,
                "failing_for_s": round(time.time() - self.failing_since, 1) if failing else None}

    @property
    def pending(self) -> int:
        """Rows submitted and not yet written."""
        return self._queue.qsize() + (1 if self.failing_since is not None else 0)

    async def flush(self) -> None:
        """Wait until the rows of every finished request are in the ledger."""
        if self._writer is not None:
            await self._queue.join()

    async def close(self) -> None:
        if self._writer is not None:
            try:
                await asyncio.wait_for(self._queue.join(), self.close_deadline_s)
            except TimeoutError:
                log.error("ledger still unavailable at shutdown: %d rows could not be written", self.pending)
            self._writer.cancel()
        if self.store is not None:
            self.store.close()

    async def _write(self) -> None:
        while True:
            write = await self._queue.get()
            try:
                await self._write_one(write)
            finally:
                self._queue.task_done()

    async def _write_one(self, write: Callable[[], Any]) -> None:
        delay = self.retry_first_s
        while True:
            try:
                await asyncio.to_thread(write)
            except TRANSIENT_WRITE_ERRORS as e:  # retried: the row and those behind it wait, in order
                if self.failing_since is None:
                    self.failing_since = time.time()
                    log.error("ledger write failed (%s: %s); retrying, rows wait in memory", type(e).__name__, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            except Exception as e:  # would fail again: a full disk must not take the gateway down either
                self.dropped += 1
                log.error("ledger write failed and was dropped: %s: %s", type(e).__name__, e)
            if self.failing_since is not None:
                log.warning("ledger writes resumed after %.1f s", time.time() - self.failing_since)
                self.failing_since = None
            return

    def count_error(self, model: str | None, status: int, tenant: str | None = None) -> None:
        """An error answer that never reached a backend (validation, routing, give-up). ``tenant``: a configured
        tenant's name (never a client's string: the label set must stay bounded)."""
        label = model if model in self._model_names else "unknown"  # arbitrary names must not blow up cardinality
        self.metrics.errors.labels(label, str(status)).inc()
        self.metrics.requests.labels(label, "none", str(status)).inc()
        if tenant is not None:
            self._tenant_children(tenant, status)[0].inc()

    def _tenant_children(self, tenant: str, status: int) -> tuple[Any, Any, Any]:
        key = (tenant, status)
        c = self._tenant_metric_children.get(key)
        if c is None:
            m = self.metrics
            c = (m.tenant_requests.labels(tenant, str(status)), m.tenant_tokens.labels(tenant, "input"),
                 m.tenant_tokens.labels(tenant, "output"))
            if len(self._tenant_metric_children) < 10_000:  # configured tenants x statuses
                self._tenant_metric_children[key] = c
        return c

    def _children(self, model: str, served_by: str, status: int) -> tuple[Any, ...]:
        """The labelled metric children of one (model, backend, status), looked up once
        (prometheus_client's ``labels()`` costs a few microseconds a call)."""
        key = (model, served_by, status)
        c = self._metric_children.get(key)
        if c is None:
            m = self.metrics
            c = (m.requests.labels(model, served_by, str(status)), m.latency.labels(model, served_by),
                 m.ttft.labels(model, served_by), m.tokens.labels(model, served_by, "input"),
                 m.tokens.labels(model, served_by, "output"), m.errors.labels(model, str(status)) if status != 200
                 else None, m.cost.labels(model, served_by))
            if len(self._metric_children) < 10_000:  # labels are bounded (models x backends x statuses)
                self._metric_children[key] = c
        return c

    def record(self, model: str, backend: Backend, o: Outcome, latency_s: float, slot: Any = None,
               tenant: str | None = None) -> None:
        """Metrics and the ledger row of one finished request; ``tenant``: who sent it (None: no tenant)."""
        if tenant is not None:
            t_requests, t_in, t_out = self._tenant_children(tenant, o.status)
            t_requests.inc()
            t_in.inc(o.input_tokens)
            t_out.inc(o.output_tokens)
        requests, latency, ttft, tokens_in, tokens_out, errors, cost_total = self._children(model, o.served_by,
                                                                                            o.status)
        requests.inc()
        latency.observe(latency_s)
        if o.ttft_s is not None:
            ttft.observe(o.ttft_s)
        tokens_in.inc(o.input_tokens)
        tokens_out.inc(o.output_tokens)
        if errors is not None:
            errors.inc()
        cost = backend.charge(o.input_tokens, o.output_tokens)
        cost_total.inc(cost)
        if self.ledger is None:
            return
        row = UsageRecord(model=model, served_by=o.served_by, route_reason=o.reason, input_tokens=o.input_tokens,
                          output_tokens=o.output_tokens, status=str(o.status), latency_ms=latency_s * 1000,
                          ttft_ms=o.ttft_s * 1000 if o.ttft_s is not None else None, tenant=tenant)
        reservation = getattr(slot, "reservation", None)
        if reservation is not None and self.store is not None:  # settle the hold to the real cost, row included
            store = self.store
            self.submit(lambda: store.settle(reservation, usd_to_nusd(cost), row))
        else:
            ledger = self.ledger
            self.submit(lambda: ledger.record(cost_usd=cost, **dataclasses.asdict(row)))


class RelayResponse(Response):
    """A streamed answer: every block the relay yields is one ASGI send, and a client that goes away cancels the
    relay (and with it the upstream call). Starlette's StreamingResponse does the same through an anyio task
    group per response, which cost a noticeable share of the gateway's CPU (benchmarks/bench_relay.py)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str]):
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        watch = DisconnectWatch(receive, relay)
        try:
            await self.send_to(send, watch.answered)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            relay.uncancel()  # the client left: nothing more to do
        finally:
            watch.stop()

    async def send_to(self, send: Send, answered: Callable[[], None] | None = None) -> None:
        """Send the answer. Whoever calls it watches for the client leaving (and cancels this); ``answered`` is
        called once the response is complete, when the client may close its end while the relay still
        finishes its bookkeeping (reading the upstream to its end)."""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            blocks = self.body_iterator
            async for block in blocks:
                if block.endswith(LAST_EVENT):  # the response's end goes out in the same write as its last event
                    await send({"type": "http.response.body", "body": block, "more_body": False})
                    if answered is not None:
                        answered()
                    async for _ in blocks:  # the relay's own ending (bookkeeping); nothing more is sent
                        pass
                    return
                await send({"type": "http.response.body", "body": block, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if answered is not None:
                answered()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class DisconnectWatch:
    """Cancels ``task`` when the client disconnects before its answer is complete (and with it the upstream
    call); a disconnect after :meth:`answered` is the client closing a finished exchange and changes nothing."""

    def __init__(self, receive: Receive, task: asyncio.Task) -> None:
        self.gone = False
        self._done = False
        self._receive, self._task = receive, task
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._done:
            self.gone = True
            self._task.cancel()

    def answered(self) -> None:
        self._done = True

    def stop(self) -> None:
        self._watcher.cancel()


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
        self.queue = model.queue if plan.priority is not None else None
        self._holds_queue_slot = False
        self._starting = False
        """A local slot held and no first token yet (:meth:`DispatchQueue.begin_start`)."""
        self._queue_expired = False

    # ---- answers -----------------------------------------------------------------------------
    async def unary(self) -> Response:
        b, slot, (raw, obj) = await self._first_success(lambda ep: complete(ep, self.path, self.req.body))
        finished = False
        try:
            usage = sse.usage_of(obj) or (self.prompt_tokens, 0)
            if obj.get("model") != self.req.model:  # a provider's own model name never reaches the client
                obj["model"] = self.req.model
                raw = json.dumps(obj).encode()
            b.finish(slot, usage[1])
            finished = True
        finally:
            if not finished:  # whatever went wrong, the slot is freed
                b.cancel(slot)
        self._record(b, slot, Outcome(b.label, self.reason.value, usage[0], usage[1]))
        return Response(raw, media_type="application/json", headers=self._headers(b))

    async def stream(self) -> Response:
        b, slot, st = await self._first_success(lambda ep: open_stream(ep, self.path, self.req.body))
        ttft = time.monotonic() - self.t0
        b.first_token(slot)
        self._started()
        if self.span is not None:
            self._relay_span = self.tracer.start_relay(self.span)  # type: ignore[union-attr]
        return RelayResponse(self._relay(st, b, slot, ttft), headers={**self._headers(b), "cache-control": "no-cache"})

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
            if self._queue_expired and b is self.m.local:
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
                if self.queue is not None and b is self.m.local and not await self._local_slot():
                    b.cancel(slot)
                    continue
                ep = b.endpoint(self.req.model, has_fallback=later).within(self._remaining())
                if self.span is None:
                    return b, slot, await call(ep)
                return b, slot, await self._traced(call, ep, b, attempt)
            except UpstreamError as e:
                b.fail(slot, e)
                self._leave_queue()
                self._failed(b, e, k + 1, more=not final)
                if not e.retryable:
                    break
            except QueueFull as e:
                b.cancel(slot)
                raise GatewayError(429, f"The local queue for {self.m.name!r} is full ({e}).", code="queue_full",
                                   headers={**self.plan.headers, "retry-after": "1"}) from None
            except BaseException:  # the client went away (cancellation): free the slot, the upstream call is closed
                b.cancel(slot)
                self._record(b, slot, Outcome(b.label, self.reason.value, self.prompt_tokens, 0, None, CANCELLED))
                raise
        if self._queue_expired and self._remaining() > 0:
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

    async def _local_slot(self) -> bool:
        """Wait in the model's priority queue for a local slot (held until :meth:`release`); False when the class's
        deadline there (or the request's timeout) passed first."""
        q, cls = self.queue, self.plan.priority
        assert q is not None and cls is not None
        yield_s = cls.first_token_yield_ms / 1000.0
        if q.try_enter(cls.order, yield_s):
            self._holds_queue_slot = True
        else:
            timeout = self._remaining()
            if cls.max_wait_s is not None:
                timeout = min(timeout, self.t0 + cls.max_wait_s - time.monotonic())
            tenant = self.ticket.tenant if self.ticket is not None else ""
            self._holds_queue_slot = await q.wait(tenant, cls.order, timeout, yield_s)
            if not self._holds_queue_slot:
                if cls.max_wait_s is not None and self._remaining() > 0:
                    self._queue_expired = True
                return False
        q.begin_start(cls.order)
        self._starting = True
        return True

    def _started(self) -> None:
        """The local attempt's first token came (or it ended): requests that yield to this one's class may go."""
        if self._starting:
            self._starting = False
            self.queue.end_start(self.plan.priority.order)  # type: ignore[union-attr]

    def _leave_queue(self) -> None:
        self._started()
        if self._holds_queue_slot:
            self._holds_queue_slot = False
            self.queue.leave()  # type: ignore[union-attr]

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
    async def _relay(self, st: OpenStream, b: Backend, slot: Any, ttft: float) -> AsyncIterator[bytes]:
        """Relay the stream: what arrives together goes out together, as the backend's own bytes.

        Most reads (a local model's token events) pass through untouched after a few substring scans; only
        a read that carries the usage event, an error event, or a provider's own model name is parsed.
        """
        usage: tuple[int, int] | None = None
        chunks = 0
        done = False
        status = 200
        rename = st.endpoint.upstream_model != self.req.model
        try:
            async with asyncio.timeout(max(0.0, self._remaining())):
                async for block in st.blocks():
                    if rename or b'"error"' in block:
                        block, n, usage, done, failed = self._rewrite(sse.split_events(block), usage, done, rename)
                        if failed:
                            status = 502
                    elif b'"usage":' in block:  # the usage event (one per stream): only it is parsed
                        block, usage = self._take_usage(block, usage)
                        n = sse.count_choices(block)
                        done = done or sse.DONE in block
                    else:
                        n = sse.count_choices(block)
                        done = done or sse.DONE in block
                    chunks += n
                    if block:  # one write, no waiting for more
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
            out_tokens = usage[1] if usage else chunks
            in_tokens = usage[0] if usage else self.prompt_tokens
            if status == 200:
                b.finish(slot, out_tokens)
            elif status == CANCELLED:
                b.cancel(slot)
            else:
                b.break_stream(slot, out_tokens, timed_out=status == 504)
            self._record(b, slot, Outcome(b.label, self.reason.value, in_tokens, out_tokens, ttft, status))

    def _take_usage(self, block: bytes, usage: tuple[int, int] | None) -> tuple[bytes, tuple[int, int] | None]:
        """Read the usage of the events in ``block`` that carry one (and drop it unless the client asked), leaving
        the other events' bytes as they are. Returns (bytes to send, usage)."""
        out = []
        pos = 0
        while (i := _find_usage(block, pos)) >= 0:
            start = block.rfind(b"\n\n", pos, i)
            start = pos if start < 0 else start + 2
            end = block.find(b"\n\n", i)
            end = len(block) if end < 0 else end + 2
            event = block[start:end]
            obj = sse.event_json(event)
            usage = sse.usage_of(obj) or usage
            out.append(block[pos:start])
            if self.req.wants_usage or obj is None:
                out.append(event)
            elif obj.get("choices"):
                obj.pop("usage", None)
                out.append(_event(obj))
            pos = end
        out.append(block[pos:])
        return b"".join(out), usage

    def _rewrite(self, batch: list[bytes], usage: tuple[int, int] | None, done: bool,
                 rename: bool) -> tuple[bytes, int, tuple[int, int] | None, bool, bool]:
        """The slow path, event by event: read usage (and drop it unless the client asked), put the client's
        model name back, notice errors. Returns (bytes to send, choice events, usage, done, failed)."""
        out = []
        chunks = 0
        failed = False
        for e in batch:
            if b'"usage":{' in e or b'"usage": {' in e:
                obj = sse.event_json(e)
                usage = sse.usage_of(obj) or usage
                if not self.req.wants_usage and obj is not None:
                    if not obj.get("choices"):
                        continue
                    obj.pop("usage", None)
                    e = _event(obj)
            if rename and b'"model":' in e:
                obj = sse.event_json(e)
                if obj is not None:
                    obj["model"] = self.req.model
                    e = _event(obj)
            if sse.has_choices(e):
                chunks += 1
            elif sse.is_done(e):
                done = True
            elif b'"error"' in e and (obj := sse.event_json(e)) is not None and "error" in obj:
                failed = True
            out.append(e)
        return b"".join(out), chunks, usage, done, failed

    # ---- bookkeeping -------------------------------------------------------------------------
    def _headers(self, b: Backend) -> dict[str, str]:
        return {SERVED_BY: b.label, ROUTE_REASON: self.reason.value, QUEUE_ESTIMATE: f"{self.plan.estimate_ms:.0f}",
                **self.plan.headers}

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
        if self.ticket is not None:
            self.ticket.release()
        self._leave_queue()


def _find_usage(block: bytes, pos: int) -> int:
    """Where the next usage object starts at or after ``pos`` (-1: none); ``"usage":null`` does not count."""
    a, b = block.find(b'"usage":{', pos), block.find(b'"usage": {', pos)
    return b if a < 0 else a if b < 0 else min(a, b)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

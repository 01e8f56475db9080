"""The record stage: metrics and the cost ledger of every finished request.

    recorder.record(model, outcome, latency_s, cost_usd, slot, tenant)   # metrics now, the ledger row queued
    recorder.count_error(model, status, tenant)                           # an error answered before any backend

The caller prices the request (its backend's ``charge``): the recorder knows no backend.

Ledger rows are written off the event loop by one writer task, in order, retried while the database is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.overflow.admission import Admission
from lmfleet.overflow.calibration import CalibrationBook
from lmfleet.overflow.money import usd_to_nusd
from lmfleet.provenance import is_external
from lmfleet.store import Ledger, SpendStore, StoreUnavailable, UsageRecord

log = logging.getLogger("lmfleet.gateway")


@dataclass(frozen=True)
class Outcome:
    """What one served request cost and how it went, for metrics and the ledger."""

    served_by: str
    reason: str
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    status: int = 200
    predicted_wait_ms: float | None = None
    """The local wait the router predicted when it kept the request local (None: sent to a provider at admission,
    or no estimate): with ``ttft_s``, the estimate's error (``lmfleet_queue_estimate_error_seconds``)."""
    usage_source: str = "provider"
    """Where the token counts came from: ``provider`` (the backend's usage) or ``estimated`` (the gateway's count
    with the model's tokenizer, for an answer without usage)."""
    upstream_model: str | None = None
    """The model name the backend answered with (None: it named none)."""
    admission: Admission | None = None
    """A local answer: what ``predicted_wait_ms`` was computed from (the ledger's ``admission``)."""


def waits(o: Outcome) -> tuple[float | None, float | None]:
    """The ledger's ``(predicted_wait_ms, realised_wait_ms)`` of one outcome.

    Only a local answer with an estimate has them. The realised wait is its TTFT as the gateway measured it
    (arrival to the first streamed token: the wait the estimate predicts). A non-streamed answer has no first token
    the gateway can see -- its latency includes the whole generation -- so its realised wait is left empty (NULL)
    rather than counted as the estimate's error; so is a request that ended before its first token.
    """
    if o.predicted_wait_ms is None or is_external(o.served_by):
        return None, None
    return o.predicted_wait_ms, (o.ttft_s * 1000 if o.ttft_s is not None else None)


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
        self._metric_children: dict[tuple[str, str, int, str], tuple[Any, ...]] = {}
        self._tenant_metric_children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
        self.failing_since: float | None = None
        """When the write at the head of the queue first failed (None: writes land)."""
        self.dropped = 0
        self.calibration = CalibrationBook()
        """The wait estimate's samples of the last minutes, per model (its ``threshold_of`` set by the app)."""

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
        """The ledger writer's state for /ready (None without a ledger); also published to the metrics, with the
        wait estimate's calibration."""
        self.metrics.set_calibration(self.calibration)
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

    def _children(self, model: str, served_by: str, status: int, source: str) -> tuple[Any, ...]:
        """The labelled metric children of one (model, backend, status, usage source), looked up once
        (prometheus_client's ``labels()`` costs a few microseconds a call)."""
        key = (model, served_by, status, source)
        c = self._metric_children.get(key)
        if c is None:
            m = self.metrics
            c = (m.requests.labels(model, served_by, str(status)), m.latency.labels(model, served_by),
                 m.ttft.labels(model, served_by), m.tokens.labels(model, served_by, "input", source),
                 m.tokens.labels(model, served_by, "output", source),
                 m.errors.labels(model, str(status)) if status != 200 else None, m.cost.labels(model, served_by))
            if len(self._metric_children) < 10_000:  # labels are bounded (models x backends x statuses x sources)
                self._metric_children[key] = c
        return c

    def record(self, model: str, o: Outcome, latency_s: float, cost_usd: float, slot: Any = None,
               tenant: str | None = None) -> None:
        """Metrics and the ledger row of one finished request; ``cost_usd``: what its backend charges for its
        tokens (the backend's price, applied by the caller); ``tenant``: who sent it (None: no tenant)."""
        if tenant is not None:
            t_requests, t_in, t_out = self._tenant_children(tenant, o.status)
            t_requests.inc()
            t_in.inc(o.input_tokens)
            t_out.inc(o.output_tokens)
        requests, latency, ttft, tokens_in, tokens_out, errors, cost_total = self._children(
            model, o.served_by, o.status, o.usage_source)
        requests.inc()
        latency.observe(latency_s)
        if o.ttft_s is not None:
            ttft.observe(o.ttft_s)
            if o.predicted_wait_ms is not None and o.status == 200 and not is_external(o.served_by):
                self.metrics.observe_estimate_error(model, o.ttft_s - o.predicted_wait_ms / 1000)
                self.calibration.add(model, o.predicted_wait_ms, o.ttft_s * 1000)
        tokens_in.inc(o.input_tokens)
        tokens_out.inc(o.output_tokens)
        if errors is not None:
            errors.inc()
        cost = cost_usd
        cost_total.inc(cost)
        if self.ledger is None:
            return
        predicted, realised = waits(o)
        row = UsageRecord(model=model, served_by=o.served_by, route_reason=o.reason, input_tokens=o.input_tokens,
                          output_tokens=o.output_tokens, status=str(o.status), latency_ms=latency_s * 1000,
                          ttft_ms=o.ttft_s * 1000 if o.ttft_s is not None else None, tenant=tenant,
                          usage_source=o.usage_source, upstream_model=o.upstream_model,
                          predicted_wait_ms=predicted, realised_wait_ms=realised,
                          admission=o.admission if predicted is not None else None)
        reservation = getattr(slot, "reservation", None)
        if reservation is not None and self.store is not None:  # settle the hold to the real cost, row included
            store = self.store
            self.submit(lambda: store.settle(reservation, usd_to_nusd(cost), row))
        else:
            ledger = self.ledger
            self.submit(lambda: ledger.record(cost_usd=cost, **dataclasses.asdict(row)))

"""Exact spend caps at the gateway: a paid request reserves its worst-case cost before it is sent.

    reservation = await guard.reserve(request_id, prompt_tokens, max_tokens, price)   # None: not admitted
    ... the request runs ...
    recorder settles it to the real cost together with its ledger row (``Recorder.record``), or
    guard.release(reservation) when the attempt failed before anything was served.

Reservations are atomic across the gateway's processes (the ledger's SQLite file) or nodes (its PostgreSQL
database, ``ledger.url``; see ``lmfleet.store``), so no cap is ever exceeded, whatever the
concurrency: the budget check in ``router.py`` is a cheap early look; this is the guarantee.

A store that cannot be used (database down, disk full, lock held too long) fails closed and closes the
provider route until it answers again::

    up --(reserve or probe raises StoreUnavailable: logged once, counted)--> down
    down: the router keeps paid requests off providers (local, or 429 with on_exhausted: reject)
          and starts a probe (an empty reservation, released at once) at most every probe_every_s
    down --(a reservation or a probe goes through, or a settle/release lands)--> up   (logged)

A settle or release lands when the store's ``writes_landed`` grows past its value at the last failure with
no write left deferred: requests that were in flight during the outage reopen the route when they finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmfleet.config.models import ProviderPrice
from lmfleet.gateway.observe.metrics import GatewayMetrics
from lmfleet.store import Cap, Reservation, SpendStore, StoreUnavailable, worst_case_cost_nusd

log = logging.getLogger("lmfleet.gateway")

PROBE_EVERY_S = 2.0
"""While the store is down: least time between two recovery probes."""


class BudgetGuard:
    """Reserves against the fleet's caps in ``store``; releases through ``submit`` (the ordered ledger writer).

    Also the gateway's view of the store's health: ``down_since`` / ``last_error`` while it fails (see the
    module docstring), published as ``lmfleet_budget_store_up`` and ``lmfleet_budget_store_failures_total``.
    """

    def __init__(self, store: SpendStore, caps: list[Cap], submit: Callable[[Callable[[], Any]], None], *,
                 metrics: GatewayMetrics | None = None, probe_every_s: float = PROBE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.caps = caps
        self._submit = submit
        self.refused = 0
        self.metrics = metrics
        self.probe_every_s = probe_every_s
        self._clock = clock
        self.down_since: float | None = None
        """Epoch seconds of the outage's first failure; None while the store answers."""
        self.last_error: str | None = None
        self.failures = 0
        """Failed store calls (reservations and probes) since start."""
        self._last_try = float("-inf")
        self._probe: asyncio.Task | None = None
        self._landed_at_failure = 0

    @property
    def is_down(self) -> bool:
        """True while the store fails; a settle or release that landed since the last failure ends that."""
        if self.down_since is not None and self._write_landed_since_failure():
            self._answered()
        return self.down_since is not None

    def _landed(self) -> int:
        return getattr(self.store, "writes_landed", 0)

    def _write_landed_since_failure(self) -> bool:
        return self._landed() > self._landed_at_failure and not getattr(self.store, "pending_writes", 0)

    async def reserve(self, request_id: str, prompt_tokens: int | None, max_tokens: int | None,
                      price: ProviderPrice, max_model_len: int | None,
                      extra_caps: Sequence[Cap] = ()) -> Reservation | None:
        """Hold the request's worst-case cost, or None when a cap (or a store that is down) does not allow it.
        ``prompt_tokens``: an upper bound of the prompt's tokens (None: unknown, not admitted). ``extra_caps``:
        the caps of the request's tenant, held in the same transaction as the fleet's."""
        if prompt_tokens is None:
            return None
        try:
            amount = worst_case_cost_nusd(prompt_tokens, max_tokens, price, max_model_len=max_model_len)
        except ValueError:  # no bound on the output: cannot be admitted against a cap
            return None
        try:
            caps = [*self.caps, *extra_caps] if extra_caps else self.caps
            got = await asyncio.to_thread(self.store.reserve, request_id, amount, caps)
        except StoreUnavailable as e:  # fail closed: no spend while the ledger cannot record it
            self._failed(e)
            return None
        self._answered()
        if not got:
            self.refused += 1
            return None
        return got  # type: ignore[return-value]

    def release(self, reservation: Reservation) -> None:
        self._submit(lambda: self.store.release(reservation))

    # --- the store's health -------------------------------------------------------------------------
    def probe_if_due(self) -> None:
        """While down, start one recovery probe in the background unless one ran less than
        ``probe_every_s`` ago (call on the running loop; cheap, never waits)."""
        if not self.is_down or (self._probe is not None and not self._probe.done()):
            return
        if self._clock() - self._last_try < self.probe_every_s:
            return
        self._last_try = self._clock()
        self._probe = asyncio.create_task(self.probe())

    async def probe(self) -> bool:
        """Try the store once (an empty reservation, released at once; it also lands writes it deferred).
        True when it answered."""
        self._last_try = self._clock()
        try:
            await asyncio.to_thread(self._try_store)
        except StoreUnavailable as e:
            self._failed(e)
            return False
        self._answered()
        return True

    def _try_store(self) -> None:
        held = self.store.reserve("lmfleet-probe", 0, ())
        if isinstance(held, Reservation):
            self.store.release(held)
        pending = getattr(self.store, "pending_writes", 0)
        if pending:  # the release was deferred: the database took the read but not the write
            raise StoreUnavailable(f"{pending} ledger write(s) still waiting for the database")

    def status(self) -> dict[str, Any]:
        """For /ready's detail."""
        return {"up": not self.is_down, "down_since": self.down_since, "error": self.last_error,
                "failures": self.failures, "pending_writes": getattr(self.store, "pending_writes", 0)}

    def _failed(self, e: StoreUnavailable) -> None:
        self.failures += 1
        self.last_error = str(e)
        self._landed_at_failure = self._landed()
        self._last_try = self._clock()
        if self.metrics is not None:
            self.metrics.budget_store_failures.inc()
            self.metrics.budget_store_up.set(0)
        if self.down_since is None:  # once per outage, not per request
            self.down_since = time.time()
            log.error("budget store unavailable, paid providers closed until it is back: %s", e)

    def _answered(self) -> None:
        if self.down_since is None:
            return
        log.warning("budget store is back after %.0f s: paid providers open again", time.time() - self.down_since)
        self.down_since = None
        self.last_error = None
        if self.metrics is not None:
            self.metrics.budget_store_up.set(1)

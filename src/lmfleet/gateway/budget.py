"""Exact spend caps at the gateway: a paid request reserves its worst-case cost before it is sent.

    reservation = await guard.reserve(request_id, prompt_tokens, max_tokens, price)   # None: not admitted
    ... the request runs ...
    recorder settles it to the real cost together with its ledger row (``Recorder.record``), or
    guard.release(reservation) when the attempt failed before anything was served.

Reservations are atomic across the gateway's processes (the ledger's SQLite file, see
``lmfleet.overflow.store``), so no cap is ever exceeded, whatever the concurrency: the budget check in
``router.py`` is a cheap early look; this is the guarantee.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from lmfleet.config.models import ProviderPrice
from lmfleet.overflow.store import Cap, Reservation, SpendStore, StoreUnavailable, worst_case_cost_nusd

log = logging.getLogger("lmfleet.gateway")


class BudgetGuard:
    """Reserves against the fleet's caps in ``store``; releases through ``submit`` (the ordered ledger writer)."""

    def __init__(self, store: SpendStore, caps: list[Cap], submit: Callable[[Callable[[], Any]], None]):
        self.store = store
        self.caps = caps
        self._submit = submit
        self.refused = 0

    async def reserve(self, request_id: str, prompt_tokens: int | None, max_tokens: int | None,
                      price: ProviderPrice, max_model_len: int | None) -> Reservation | None:
        """Hold the request's worst-case cost, or None when a cap (or a store that is down) does not allow it.
        ``prompt_tokens``: an upper bound of the prompt's tokens (None: unknown, not admitted)."""
        if prompt_tokens is None:
            return None
        try:
            amount = worst_case_cost_nusd(prompt_tokens, max_tokens, price, max_model_len=max_model_len)
        except ValueError:  # no bound on the output: cannot be admitted against a cap
            return None
        try:
            got = await asyncio.to_thread(self.store.reserve, request_id, amount, self.caps)
        except StoreUnavailable as e:  # fail closed: no spend while the ledger cannot record it
            log.error("budget store unavailable, paid providers closed: %s", e)
            return None
        if not got:
            self.refused += 1
            return None
        return got  # type: ignore[return-value]

    def release(self, reservation: Reservation) -> None:
        self._submit(lambda: self.store.release(reservation))

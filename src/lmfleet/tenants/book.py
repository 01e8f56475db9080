"""What each tenant uses right now in one gateway process: rate windows and requests in flight.

    book = TenantBook(directory)
    a = book.admit(tenant, cls, estimate_ms=..., threshold_ms=..., provider_ok=..., prompt_tokens=...)
    if a.outcome is not Outcome.REJECT:
        ticket = book.take(tenant)             # counted: one request, one slot in flight
        ...
        ticket.add_tokens(input + output)      # from the answer's usage
        ticket.release()                       # when the request ends, however it ends (idempotent)

Per process: with several gateway workers each enforces the whole limit (docs/tenants.md, "Limits across
gateway processes"). A tenant without limits (``default`` of the flat keys, typically) costs nothing here:
:meth:`TenantBook.take` answers a shared no-op ticket and :meth:`TenantBook.admit` only classifies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from lmfleet.config.tenants import PriorityClass, default_priority_classes
from lmfleet.tenants.admission import Admission, TenantUsage, admit
from lmfleet.tenants.directory import Tenant, TenantDirectory

__all__ = ["TenantBook", "Ticket"]


class Ticket:
    """One admitted request of a tenant: its slot in flight (freed once) and where its tokens are counted."""

    __slots__ = ("_book", "tenant", "released")

    def __init__(self, book: "TenantBook | None", tenant: str):
        self._book = book
        self.tenant = tenant
        self.released = book is None

    def add_tokens(self, n: int) -> None:
        if self._book is not None and n > 0:
            self._book.add_tokens(self.tenant, n)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._book._release(self.tenant)  # type: ignore[union-attr]


def _limited(t: Tenant) -> bool:
    lim = t.limits
    return (lim.requests_per_minute is not None or lim.tokens_per_minute is not None
            or lim.max_concurrency is not None)


class TenantBook:
    """Rate windows and in-flight counts of every configured tenant (mutable; one per gateway process)."""

    def __init__(self, directory: TenantDirectory, classes: Sequence[PriorityClass] | None = None,
                 clock: Callable[[], float] = time.time):
        self.directory = directory
        self.classes = sorted(classes or default_priority_classes(), key=lambda c: c.order)
        """Priority classes, most urgent first (for :func:`lmfleet.tenants.requested_class`)."""
        self.clock = clock
        self.usage: dict[str, TenantUsage] = {n: TenantUsage.for_limits(t.limits) for n, t in directory.tenants.items()}
        self.in_flight: dict[str, int] = dict.fromkeys(directory.tenants, 0)
        self._limited = {n for n, t in directory.tenants.items() if _limited(t)}
        self._free = {n: Ticket(None, n) for n in directory.tenants}
        """Shared no-op tickets of the tenants without limits."""

    def is_limited(self, tenant: Tenant) -> bool:
        """Does ``tenant`` have a rate or concurrency limit (else admission only classifies)?"""
        return tenant.name in self._limited

    def admit(self, tenant: Tenant, cls: PriorityClass, *, estimate_ms: float, threshold_ms: float,
              provider_ok: bool, prompt_tokens: int = 0, budget_left_usd: float | None = None) -> Admission:
        """:func:`lmfleet.tenants.admit` with this tenant's live usage (nothing is counted: see :meth:`take`)."""
        return admit(tenant, cls, usage=self.usage.get(tenant.name, _NO_USAGE),
                     in_flight=self.in_flight.get(tenant.name, 0), estimate_ms=estimate_ms,
                     threshold_ms=threshold_ms, provider_ok=provider_ok, budget_left_usd=budget_left_usd,
                     now=self.clock(), prompt_tokens=prompt_tokens)

    def take(self, tenant: Tenant) -> Ticket:
        """Count an admitted request: one in the requests window, one in flight until the ticket is released."""
        name = tenant.name
        if name not in self._limited:
            return self._free[name]
        self.usage[name] = self.usage[name].record_request(self.clock())
        self.in_flight[name] += 1
        return Ticket(self, name)

    def add_tokens(self, tenant: str, n: int) -> None:
        u = self.usage.get(tenant)
        if u is not None and u.tokens is not None:
            self.usage[tenant] = u.record_tokens(self.clock(), n)

    def _release(self, tenant: str) -> None:
        self.in_flight[tenant] = max(0, self.in_flight[tenant] - 1)


_NO_USAGE = TenantUsage()

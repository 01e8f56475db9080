"""What each tenant uses right now in one gateway process: rate windows and requests in flight.

    book = TenantBook(directory)
    a = book.admit(tenant, cls, estimate_ms=..., threshold_ms=..., provider_ok=..., prompt_tokens=...)
    if a.outcome is not Outcome.REJECT:
        ticket = book.take(tenant)             # counted: one request, one slot in flight
        ...
        ticket.add_tokens(input + output)      # from the answer's usage
        ticket.release()                       # when the request ends, however it ends (idempotent)

Without ``shared`` the limits hold per process (with several gateway workers each enforces the whole limit).
With ``shared`` (:class:`lmfleet.tenants.shared.SharedLimits`: the spend store's database) they hold across
processes and nodes, and a gateway admits and counts in one step, off the event loop::

    a, ticket = await book.enter(tenant, cls, estimate_ms=..., ...)   # ticket None: refused (or take=False)

A tenant without limits (``default`` of the flat keys, typically) costs nothing here: no database call,
:meth:`TenantBook.take` answers a shared no-op ticket and :meth:`TenantBook.admit` only classifies. The
in-memory windows and in-flight counts are always kept: this process's own traffic (``GET /admin/tenants``),
and what admission falls back to, divided by ``workers``, while the shared store is down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from lmfleet.config.tenants import PriorityClass, default_priority_classes
from lmfleet.tenants.admission import Admission, Outcome, TenantUsage, admit
from lmfleet.tenants.directory import Tenant, TenantDirectory
from lmfleet.tenants.window import RateWindow

if TYPE_CHECKING:
    from lmfleet.tenants.shared import SharedLimits, TenantCounts

__all__ = ["TenantBook", "Ticket", "tenant_counter_key"]


class Ticket:
    """One admitted request of a tenant: its slot in flight (freed once) and where its tokens are counted."""

    __slots__ = ("_book", "tenant", "released", "slot")

    def __init__(self, book: "TenantBook | None", tenant: str, slot: str | None = None):
        self._book = book
        self.tenant = tenant
        self.released = book is None
        self.slot = slot
        """Its slot in the shared store (None: none held there)."""

    def add_tokens(self, n: int) -> None:
        if self._book is not None and n > 0:
            self._book.add_tokens(self.tenant, n)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._book._release(self.tenant, self.slot)  # type: ignore[union-attr]


def _limited(t: Tenant) -> bool:
    lim = t.limits
    return (lim.requests_per_minute is not None or lim.tokens_per_minute is not None
            or lim.max_concurrency is not None)


class TenantBook:
    """Rate windows and in-flight counts of every configured tenant (mutable; one per gateway process)."""

    def __init__(self, directory: TenantDirectory, classes: Sequence[PriorityClass] | None = None,
                 clock: Callable[[], float] = time.time, shared: "SharedLimits | None" = None,
                 window_s: float = 60.0):
        self.directory = directory
        self.classes = sorted(classes or default_priority_classes(), key=lambda c: c.order)
        """Priority classes, most urgent first (for :func:`lmfleet.tenants.requested_class`)."""
        self.clock = clock
        self.shared = shared
        """The store every gateway process counts in (None: limits per process, in memory only)."""
        self.window_s = window_s
        self.usage: dict[str, TenantUsage] = {n: TenantUsage.for_limits(t.limits, window_s)
                                              for n, t in directory.tenants.items()}
        self.in_flight: dict[str, int] = dict.fromkeys(directory.tenants, 0)
        self._limited = {n for n, t in directory.tenants.items() if _limited(t)}
        self._free = {n: Ticket(None, n) for n in directory.tenants}
        """Shared no-op tickets of the tenants without limits."""

    def is_limited(self, tenant: Tenant) -> bool:
        """Does ``tenant`` have a rate or concurrency limit (else admission only classifies)?"""
        return tenant.name in self._limited

    def set_limits(self, tenant: Tenant) -> None:
        """``tenant``'s limits changed at run time: its windows take the new limits and keep what they counted (a
        limit lowered below what was used refuses until the window slides); a limit lifted drops its window."""
        name, lim = tenant.name, tenant.limits
        u = self.usage.get(name, _NO_USAGE)

        def resized(w: RateWindow | None, limit: int | None) -> RateWindow | None:
            if limit is None:
                return None
            return RateWindow(limit, self.window_s) if w is None else replace(w, limit=limit)

        self.usage[name] = TenantUsage(resized(u.requests, lim.requests_per_minute),
                                       resized(u.tokens, lim.tokens_per_minute))
        self.in_flight.setdefault(name, 0)
        self._free.setdefault(name, Ticket(None, name))
        if _limited(tenant):
            self._limited.add(name)
        else:
            self._limited.discard(name)

    def admit(self, tenant: Tenant, cls: PriorityClass, *, estimate_ms: float, threshold_ms: float,
              provider_ok: bool, prompt_tokens: int = 0, budget_left_usd: float | None = None) -> Admission:
        """:func:`lmfleet.tenants.admit` with this tenant's live usage (nothing is counted: see :meth:`take`)."""
        return admit(tenant, cls, usage=self.usage.get(tenant.name, _NO_USAGE),
                     in_flight=self.in_flight.get(tenant.name, 0), estimate_ms=estimate_ms,
                     threshold_ms=threshold_ms, provider_ok=provider_ok, budget_left_usd=budget_left_usd,
                     now=self.clock(), prompt_tokens=prompt_tokens)

    def take(self, tenant: Tenant, slot: str | None = None) -> Ticket:
        """Count an admitted request: one in the requests window, one in flight until the ticket is released
        (in this process; ``slot``: its slot in the shared store, already counted there)."""
        name = tenant.name
        if name not in self._limited:
            return self._free[name]
        self.usage[name] = self.usage[name].record_request(self.clock())
        self.in_flight[name] += 1
        return Ticket(self, name, slot)

    async def enter(self, tenant: Tenant, cls: PriorityClass, *, estimate_ms: float, threshold_ms: float,
                    provider_ok: bool, prompt_tokens: int = 0, budget_left_usd: float | None = None,
                    take: bool = True) -> tuple[Admission, Ticket | None]:
        """Admit and, unless refused (or ``take`` is False), count in one step: the ticket of the admitted request.

        With a shared store and a limited tenant, one transaction there (run in a thread); else in memory,
        without an await.
        """
        if self.shared is None or tenant.name not in self._limited:
            a = self.admit(tenant, cls, estimate_ms=estimate_ms, threshold_ms=threshold_ms, provider_ok=provider_ok,
                           prompt_tokens=prompt_tokens, budget_left_usd=budget_left_usd)
            return a, (self.take(tenant) if take and a.outcome is not Outcome.REJECT else None)
        admission = asyncio.ensure_future(asyncio.to_thread(
            self._shared_admission, tenant, cls, take, estimate_ms=estimate_ms, threshold_ms=threshold_ms,
            provider_ok=provider_ok, prompt_tokens=prompt_tokens, budget_left_usd=budget_left_usd))
        try:
            got = await asyncio.shield(admission)
        except asyncio.CancelledError:  # the client left: a slot taken meanwhile must not leak until its TTL
            admission.add_done_callback(self._abandoned)
            raise
        return self._count(tenant, cls, take, got, estimate_ms=estimate_ms, threshold_ms=threshold_ms,
                           provider_ok=provider_ok, prompt_tokens=prompt_tokens, budget_left_usd=budget_left_usd)

    def enter_blocking(self, tenant: Tenant, cls: PriorityClass, *, estimate_ms: float, threshold_ms: float,
                       provider_ok: bool, prompt_tokens: int = 0, budget_left_usd: float | None = None,
                       take: bool = True) -> tuple[Admission, Ticket | None]:
        """:meth:`enter` without an event loop (blocking; for a thread of its own, as the tests' gateways)."""
        kw = dict(estimate_ms=estimate_ms, threshold_ms=threshold_ms, provider_ok=provider_ok,
                  prompt_tokens=prompt_tokens, budget_left_usd=budget_left_usd)
        got = self._shared_admission(tenant, cls, take, **kw) if tenant.name in self._limited else None
        return self._count(tenant, cls, take, got, **kw)  # type: ignore[arg-type]

    def _shared_admission(self, tenant: Tenant, cls: PriorityClass, take: bool, *, estimate_ms: float,
                          threshold_ms: float, provider_ok: bool, prompt_tokens: int,
                          budget_left_usd: float | None) -> tuple[Admission, str | None] | None:
        """The shared store's admission (one transaction; counted there when admitted and ``take``); None when
        there is no store or it is down. Blocking, and touches none of this book's own counts."""
        if self.shared is None:
            return None
        now = self.clock()
        lim = tenant.limits

        def decide(c: "TenantCounts") -> tuple[bool, Admission]:
            usage = TenantUsage(_window(lim.requests_per_minute, self.window_s, c.window_start, c.requests),
                                _window(lim.tokens_per_minute, self.window_s, c.window_start, c.tokens))
            a = admit(tenant, cls, usage=usage, in_flight=c.in_flight, estimate_ms=estimate_ms,
                      threshold_ms=threshold_ms, provider_ok=provider_ok, budget_left_usd=budget_left_usd,
                      now=now, prompt_tokens=prompt_tokens)
            return take and a.outcome is not Outcome.REJECT, a

        return self.shared.admit(tenant_counter_key(tenant.name), decide, now=now, window_s=self.window_s,
                                 holds_slot=lim.max_concurrency is not None,
                                 count_request=lim.requests_per_minute is not None)

    def _abandoned(self, admission: "asyncio.Future[tuple[Admission, str | None] | None]") -> None:
        """The store's answer to a request that left while waiting for it: give its slot back."""
        if admission.cancelled() or admission.exception() is not None:
            return
        got = admission.result()
        if got is not None and got[1] is not None and self.shared is not None:
            self.shared.release(got[1])

    def _count(self, tenant: Tenant, cls: PriorityClass, take: bool, got: tuple[Admission, str | None] | None,
               **kw: object) -> tuple[Admission, Ticket | None]:
        """This process's side of an admission: the fallback decision when the store gave none, and the ticket."""
        if got is None:  # no store answer: this process's share of each limit (fail open)
            a, slot = self._admit_share(tenant, cls, self.clock(), **kw), None
        else:
            a, slot = got
        return a, (self.take(tenant, slot) if take and a.outcome is not Outcome.REJECT else None)

    def _admit_share(self, tenant: Tenant, cls: PriorityClass, now: float, **kw: object) -> Admission:
        """Admission on this process's own counts, every limit divided by ``shared.workers`` (at least 1)."""
        workers = self.shared.workers if self.shared is not None else 1
        lim = tenant.limits
        share = replace(tenant, limits=lim.model_copy(update={
            k: max(1, v // workers) for k in ("requests_per_minute", "tokens_per_minute", "max_concurrency")
            if (v := getattr(lim, k)) is not None}))
        u = self.usage.get(tenant.name, _NO_USAGE)
        usage = TenantUsage(*(None if w is None else replace(w, limit=max(1, w.limit // workers))
                              for w in (u.requests, u.tokens)))
        return admit(share, cls, usage=usage, in_flight=self.in_flight.get(tenant.name, 0), now=now,
                     **kw)  # type: ignore[arg-type]

    def add_tokens(self, tenant: str, n: int) -> None:
        u = self.usage.get(tenant)
        if u is not None and u.tokens is not None:
            now = self.clock()
            self.usage[tenant] = u.record_tokens(now, n)
            if self.shared is not None and n > 0:
                self.shared.add_tokens(tenant_counter_key(tenant), n, now=now, window_s=self.window_s)

    def _release(self, tenant: str, slot: str | None = None) -> None:
        self.in_flight[tenant] = max(0, self.in_flight[tenant] - 1)
        if slot is not None and self.shared is not None:
            self.shared.release(slot)


def tenant_counter_key(name: str) -> str:
    """A tenant's key in the shared store (``tenant:NAME`` is its spend-cap key; the two stay apart)."""
    return f"tenant:{name}:rate"


def _window(limit: int | None, window_s: float, start: float, counts: tuple[float, float]) -> RateWindow | None:
    """The shared store's two fixed windows as a :class:`RateWindow` (None: no such limit)."""
    return None if limit is None else RateWindow(limit, window_s, start, counts[0], counts[1])


_NO_USAGE = TenantUsage()

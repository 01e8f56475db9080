"""TenantBook: one process's live usage per tenant (rate windows, in flight) and its tickets."""

from __future__ import annotations

import pytest

from lmfleet.config.tenants import TenantConfig, TenantLimits, default_priority_classes
from lmfleet.tenants import Outcome, Reason, TenantBook, TenantDirectory

CLASSES = default_priority_classes()
INTERACTIVE, BATCH = CLASSES


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _book(limits: dict, clock: Clock | None = None) -> tuple[TenantBook, object]:
    cfg = TenantConfig(name="a", api_keys_env="A", limits=TenantLimits(**limits))
    d = TenantDirectory.build([cfg], CLASSES, environ={"A": "sk-a"})
    book = TenantBook(d, CLASSES, clock=clock or Clock())
    return book, d.resolve("sk-a")


def _admit(book, tenant, prompt_tokens=0):
    return book.admit(tenant, INTERACTIVE, estimate_ms=0, threshold_ms=1000, provider_ok=False,
                      prompt_tokens=prompt_tokens)


@pytest.mark.parametrize("limits,limited", [
    ({}, False),
    ({"hourly_usd": 1.0}, False),  # spend caps are not admission limits here
    ({"max_concurrency": 1}, True),
    ({"requests_per_minute": 5}, True),
    ({"tokens_per_minute": 100}, True),
])
def test_only_rate_and_concurrency_limits_make_a_tenant_counted(limits, limited):
    book, t = _book(limits)
    assert book.is_limited(t) is limited
    ticket = book.take(t)
    assert book.in_flight["a"] == (1 if limited else 0)
    ticket.release()
    assert book.in_flight["a"] == 0


def test_a_ticket_frees_its_slot_once():
    book, t = _book({"max_concurrency": 2})
    t1, t2 = book.take(t), book.take(t)
    assert _admit(book, t).reason is Reason.CONCURRENCY_LIMIT
    t1.release()
    t1.release()  # idempotent: the other request keeps its slot
    assert book.in_flight["a"] == 1
    assert _admit(book, t).outcome is Outcome.LOCAL_NOW
    t2.release()
    assert book.in_flight["a"] == 0


def test_requests_and_tokens_are_counted_in_their_windows():
    clock = Clock()
    book, t = _book({"requests_per_minute": 2, "tokens_per_minute": 10}, clock)
    book.take(t).add_tokens(9)
    assert _admit(book, t, prompt_tokens=2).reason is Reason.TOKENS_PER_MINUTE
    book.take(t)
    assert _admit(book, t).reason is Reason.REQUESTS_PER_MINUTE
    clock.t += 120  # two windows later nothing counts
    a = _admit(book, t, prompt_tokens=2)
    assert a.outcome is Outcome.LOCAL_NOW and a.headers["x-ratelimit-remaining-requests"] == "2"


def test_classes_are_sorted_most_urgent_first():
    book, _ = _book({})
    assert [c.name for c in TenantBook(book.directory, list(reversed(CLASSES))).classes] == ["interactive", "batch"]

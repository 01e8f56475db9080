"""Tenant limits shared across gateway processes and nodes (issue 14): the counters in the spend store's database.

Against SQLite and a real PostgreSQL: the store's admission table (slots, windows, expiry, release), the issue's
test (2 x N concurrent requests of one tenant with a limit of N through two gateways' books -> exactly N admitted,
on threads and in two processes), the book's fail-open share while the store is down, and that a tenant without
limits never reaches the database.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from lmfleet.config.tenants import TenantConfig, TenantLimits, default_priority_classes
from lmfleet.store import PostgresSpendStore, SqliteSpendStore, StoreUnavailable
from lmfleet.store import TenantCounts
from lmfleet.tenants import Outcome, Reason, TenantBook, TenantDirectory
from lmfleet.tenants.shared import SharedLimits
from lmfleet.testing.pg_shared import fresh_database

pytestmark = pytest.mark.timeout(180)

CLASSES = default_priority_classes()
INTERACTIVE, BATCH = CLASSES
T0 = 1_800_000_000.0  # a multiple of 60
KEY = "tenant:a:rate"


@pytest.fixture(params=["sqlite", "postgres"])
def target(request, tmp_path):
    """(backend, where): a fresh SQLite file or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return "sqlite", str(tmp_path / "ledger.sqlite")
    return "postgres", fresh_database(request.getfixturevalue("pg_server"))


def _open(target, **kw):
    backend, where = target
    return SqliteSpendStore(where, **kw) if backend == "sqlite" else PostgresSpendStore(where, **kw)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _take_if(limit: int):
    """A decision: admit while fewer than ``limit`` are in flight; returns the counts it saw."""
    return lambda c: (c.in_flight < limit, c)


# --- 1. the store: one transaction reads, decides, takes -------------------------------------------------
@pytest.mark.parametrize("slot_ttl_s, count_request, in_flight_after, requests_after", [
    (60.0, True, 1, 1.0),     # concurrency and requests/min limits
    (60.0, False, 1, 0.0),    # concurrency only: no window written
    (None, True, 0, 1.0),     # requests/min only: no slot held
    (None, False, 0, 0.0),    # tokens/min only: read, nothing taken
])
def test_an_admission_takes_only_what_the_tenant_is_limited_by(target, slot_ttl_s, count_request, in_flight_after,
                                                               requests_after):
    with _open(target) as store:
        seen, slot = store.admit_tenant(KEY, _take_if(5), now=T0 + 1, window_s=60, slot_ttl_s=slot_ttl_s,
                                        count_request=count_request)
        assert seen == TenantCounts(0, (0.0, 0.0), (0.0, 0.0), T0)
        assert (slot is not None) is (slot_ttl_s is not None)
        after = store.tenant_counts(KEY, now=T0 + 2, window_s=60)
        assert (after.in_flight, after.requests[0]) == (in_flight_after, requests_after)


def test_a_refusal_writes_nothing(target):
    with _open(target) as store:
        for _ in range(2):
            store.admit_tenant(KEY, _take_if(2), now=T0, window_s=60, slot_ttl_s=60, count_request=True)
        seen, slot = store.admit_tenant(KEY, _take_if(2), now=T0, window_s=60, slot_ttl_s=60, count_request=True)
        assert slot is None and seen.in_flight == 2
        assert store.tenant_counts(KEY, now=T0, window_s=60) == TenantCounts(2, (2.0, 0.0), (0.0, 0.0), T0)


@pytest.mark.parametrize("now, in_flight, requests, tokens", [
    (T0 + 59, 2, (2.0, 0.0), (300.0, 0.0)),      # the same fixed window
    (T0 + 60, 2, (0.0, 2.0), (0.0, 300.0)),      # the next: current becomes previous
    (T0 + 130, 0, (0.0, 0.0), (0.0, 0.0)),       # two windows later, and the slots (ttl 100 s) expired
])
def test_windows_roll_over_and_slots_of_a_dead_gateway_expire(target, now, in_flight, requests, tokens):
    with _open(target) as store:
        for _ in range(2):
            store.admit_tenant(KEY, _take_if(9), now=T0 + 10, window_s=60, slot_ttl_s=100, count_request=True)
        store.add_tenant_tokens(KEY, 100, now=T0 + 20, window_s=60)
        store.add_tenant_tokens(KEY, 200, now=T0 + 30, window_s=60)
        c = store.tenant_counts(KEY, now=now, window_s=60)
        assert (c.in_flight, c.requests, c.tokens) == (in_flight, requests, tokens)


def test_a_release_frees_its_slot_once_and_keys_stay_apart(target):
    with _open(target) as store:
        _, s1 = store.admit_tenant(KEY, _take_if(1), now=T0, window_s=60, slot_ttl_s=60, count_request=False)
        _, other = store.admit_tenant("tenant:b:rate", _take_if(1), now=T0, window_s=60, slot_ttl_s=60,
                                      count_request=False)
        assert s1 and other
        assert store.admit_tenant(KEY, _take_if(1), now=T0, window_s=60, slot_ttl_s=60, count_request=False)[1] is None
        store.release_tenant(s1)
        store.release_tenant(s1)  # idempotent
        assert store.tenant_counts(KEY, now=T0, window_s=60).in_flight == 0
        assert store.tenant_counts("tenant:b:rate", now=T0, window_s=60).in_flight == 1
        assert store.admit_tenant(KEY, _take_if(1), now=T0, window_s=60, slot_ttl_s=60, count_request=False)[1]


def test_schema_version_3_adds_the_tables_to_an_existing_ledger(target):
    with _open(target) as store:
        store.admit_tenant(KEY, _take_if(1), now=T0, window_s=60, slot_ttl_s=60, count_request=True)
    with _open(target) as again:  # reopening migrates nothing twice and keeps the rows
        assert again.tenant_counts(KEY, now=T0, window_s=60).in_flight == 1


# --- 2. the test: two gateways, 2 x N at once, limit N -> exactly N -------------------------------
def _book(store, limits: dict, clock=None, workers: int = 2) -> tuple[TenantBook, object]:
    cfg = TenantConfig(name="a", api_keys_env="A", limits=TenantLimits(**limits))
    d = TenantDirectory.build([cfg], CLASSES, environ={"A": "sk-a"})
    shared = SharedLimits(store, slot_ttl_s=600, workers=workers) if store is not None else None
    return TenantBook(d, CLASSES, clock=clock or Clock(), shared=shared), d.resolve("sk-a")


def _enter(book, tenant, **kw):
    return book.enter_blocking(tenant, INTERACTIVE, estimate_ms=0, threshold_ms=1000, provider_ok=False, **kw)


N = 8


@pytest.mark.parametrize("limits, reason", [
    ({"max_concurrency": N}, Reason.CONCURRENCY_LIMIT),
    ({"requests_per_minute": N}, Reason.REQUESTS_PER_MINUTE),
    ({"max_concurrency": N, "requests_per_minute": 100 * N, "tokens_per_minute": 10_000}, Reason.CONCURRENCY_LIMIT),
])
def test_two_gateways_admit_exactly_n_of_2n_concurrent_requests(target, limits, reason):
    """Two books (two gateways: their own store, their own connection), N threads each, all released at once."""
    stores = [_open(target), _open(target)]
    books = [_book(s, limits) for s in stores]
    start = threading.Barrier(2 * N)
    results: list = []
    lock = threading.Lock()

    def one(book, tenant):
        start.wait()
        a, ticket = _enter(book, tenant)
        with lock:
            results.append((a, ticket))

    threads = [threading.Thread(target=one, args=books[i % 2]) for i in range(2 * N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        admitted = [a for a, ticket in results if ticket is not None]
        refused = [a for a, ticket in results if ticket is None]
        assert len(results) == 2 * N and len(admitted) == N
        assert {a.reason for a in refused} == {reason} and all(a.outcome is Outcome.REJECT for a in refused)
        assert sum(b.in_flight["a"] for b, _ in books) == N  # each gateway's own share, N in all
    finally:
        for s in stores:
            s.close()


def _gateway_process(backend: str, where: str, limits: dict, start, admitted) -> None:
    store = SqliteSpendStore(where) if backend == "sqlite" else PostgresSpendStore(where)
    book, tenant = _book(store, limits)
    start.wait()
    n = 0
    for _ in range(N):
        n += _enter(book, tenant)[1] is not None
    with admitted.get_lock():
        admitted.value += n
    store.close()


@pytest.mark.parametrize("limits", [{"max_concurrency": N}, {"requests_per_minute": N}])
def test_two_gateway_processes_admit_exactly_n(target, limits):
    """The same across two processes (``gateway.workers: 2``; with PostgreSQL, as two nodes would)."""
    ctx = multiprocessing.get_context("spawn")
    start, admitted = ctx.Barrier(2), ctx.Value("i", 0)
    _open(target).close()  # the schema, once, before the race
    procs = [ctx.Process(target=_gateway_process, args=(*target, limits, start, admitted)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert admitted.value == N


# --- 3. the book over the store ------------------------------------------------------------------------
def test_released_slots_and_tokens_reach_the_store(target):
    clock = Clock(T0 + 5)
    with _open(target) as store:
        book, t = _book(store, {"max_concurrency": 1, "tokens_per_minute": 100}, clock)
        a, ticket = _enter(book, t, prompt_tokens=10)
        assert ticket is not None and ticket.slot is not None
        assert _enter(book, t)[0].reason is Reason.CONCURRENCY_LIMIT
        ticket.add_tokens(150)
        ticket.release()
        ticket.release()
        book.shared.drain()
        c = store.tenant_counts(KEY, now=clock.t, window_s=60)
        assert (c.in_flight, c.tokens) == (0, (150.0, 0.0))
        # another gateway's book sees the tokens: its window is full
        other, t2 = _book(store, {"max_concurrency": 1, "tokens_per_minute": 100}, clock)
        assert _enter(other, t2, prompt_tokens=1)[0].reason is Reason.TOKENS_PER_MINUTE


def test_take_false_checks_without_counting(target):
    with _open(target) as store:
        book, t = _book(store, {"max_concurrency": 1, "requests_per_minute": 5})
        a, ticket = _enter(book, t, take=False)
        assert a.outcome is Outcome.LOCAL_NOW and ticket is None
        c = store.tenant_counts(KEY, now=T0, window_s=60)
        assert (c.in_flight, c.requests[0]) == (0, 0.0)


class DownStore:
    """A store whose database is gone; counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def admit_tenant(self, *a, **kw):
        self.calls += 1
        raise StoreUnavailable("ledger database x: gone")

    def release_tenant(self, slot):
        raise StoreUnavailable("gone")

    def add_tenant_tokens(self, *a, **kw):
        raise StoreUnavailable("gone")


@pytest.mark.parametrize("workers, limits, admitted", [
    (2, {"max_concurrency": 8}, 4),
    (4, {"max_concurrency": 8}, 2),
    (3, {"max_concurrency": 2}, 1),        # at least 1
    (2, {"requests_per_minute": 10}, 5),
])
def test_while_the_store_is_down_each_process_admits_its_share(workers, limits, admitted):
    store = DownStore()
    clock = Clock()
    book, t = _book(store, limits, clock, workers=workers)
    got = [_enter(book, t)[1] for _ in range(10)]
    assert sum(x is not None for x in got) == admitted
    assert store.calls == 1  # tried once, then the share for retry_s
    book.shared._down_until = float("-inf")  # retry_s has passed
    _enter(book, t)
    assert store.calls == 2


class CountingStore(DownStore):
    def admit_tenant(self, *a, **kw):
        self.calls += 1
        return a[1](TenantCounts(0, (0, 0), (0, 0), T0))[1], None


async def test_a_tenant_without_limits_never_reaches_the_store():
    store = CountingStore()
    book, t = _book(store, {"hourly_usd": 1.0})
    for cls in CLASSES:
        a, ticket = await book.enter(t, cls, estimate_ms=0, threshold_ms=1000, provider_ok=False)
        assert a.outcome is Outcome.LOCAL_NOW and ticket is not None
    limited, t2 = _book(store, {"max_concurrency": 3})
    await limited.enter(t2, INTERACTIVE, estimate_ms=0, threshold_ms=1000, provider_ok=False)
    assert store.calls == 1


async def test_a_request_that_leaves_while_admitted_gives_its_slot_back(target):
    import asyncio

    with _open(target) as store:
        gate = threading.Event()
        slow = SlowStore(store, gate)
        book, t = _book(slow, {"max_concurrency": 1})
        waiting = asyncio.create_task(book.enter(t, INTERACTIVE, estimate_ms=0, threshold_ms=1000,
                                                 provider_ok=False))
        await asyncio.sleep(0.05)
        waiting.cancel()  # the client left while the store was deciding
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        for _ in range(200):
            await asyncio.sleep(0.01)
            await asyncio.to_thread(book.shared.drain)
            if store.tenant_counts(KEY, now=T0, window_s=60).in_flight == 0:
                break
        assert store.tenant_counts(KEY, now=T0, window_s=60).in_flight == 0
        assert book.in_flight["a"] == 0


class SlowStore:
    """A real store whose admissions wait for ``gate``."""

    def __init__(self, store, gate: threading.Event) -> None:
        self.store, self.gate = store, gate

    def admit_tenant(self, *a, **kw):
        self.gate.wait(10)
        return self.store.admit_tenant(*a, **kw)

    def release_tenant(self, slot):
        self.store.release_tenant(slot)

    def add_tenant_tokens(self, *a, **kw):
        self.store.add_tenant_tokens(*a, **kw)

"""DispatchQueue: local slots, the order waiting requests get them in, deadlines, cancellation, the bound."""

from __future__ import annotations

import asyncio

import pytest

from lmfleet.tenants.queue import DispatchQueue, QueueFull

INTERACTIVE, BATCH = 0, 10


async def _park(q: DispatchQueue, who: list[str], tenant: str, order: int, label: str,
                timeout_s: float | None = None) -> bool:
    ok = await q.wait(tenant, order, timeout_s)
    if ok:
        who.append(label)
    return ok


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("arrivals,expected", [
    # (tenant, class order, label) in arrival order, while the one slot is taken
    ([("a", BATCH, "a-batch"), ("b", INTERACTIVE, "b-inter")], ["b-inter", "a-batch"]),   # classes strictly
    ([("a", BATCH, "a1"), ("a", BATCH, "a2"), ("a", BATCH, "a3"), ("b", BATCH, "b1")],
     ["a1", "b1", "a2", "a3"]),                                                           # round-robin tenants
    ([("a", INTERACTIVE, "a1"), ("a", INTERACTIVE, "a2")], ["a1", "a2"]),                   # FIFO in a tenant
])
async def test_a_freed_slot_goes_to_the_most_urgent_least_recently_served(arrivals, expected):
    q = DispatchQueue(capacity=1)
    assert q.try_enter() and not q.try_enter()
    who: list[str] = []
    tasks = [asyncio.create_task(_park(q, who, t, o, label)) for t, o, label in arrivals]
    await _settle()
    assert len(q.waiting) == len(arrivals)
    for _ in arrivals:
        q.leave()
        await _settle()
    assert who == expected
    await asyncio.gather(*tasks)
    q.leave()
    assert q.running == 0 and not q.waiting


async def test_nobody_skips_the_queue_while_someone_waits():
    q = DispatchQueue(capacity=1)
    assert q.try_enter()
    waiter = asyncio.create_task(q.wait("a", BATCH, None))
    await _settle()
    q.running = 0  # a slot frees up without leave() dispatching: a newcomer must still not jump the queue
    assert not q.try_enter()
    q.running = 1
    q.leave()
    assert await waiter and q.running == 1


async def test_a_wait_past_its_deadline_gets_no_slot_and_leaves_no_trace():
    q = DispatchQueue(capacity=1)
    assert q.try_enter()
    assert await q.wait("a", BATCH, 0.05) is False
    assert await q.wait("a", BATCH, 0) is False
    assert not q.waiting and q.running == 1
    q.leave()
    assert q.running == 0


async def test_a_cancelled_waiter_passes_its_slot_on():
    q = DispatchQueue(capacity=1)
    assert q.try_enter()
    who: list[str] = []
    first = asyncio.create_task(_park(q, who, "a", INTERACTIVE, "first"))
    second = asyncio.create_task(_park(q, who, "b", INTERACTIVE, "second"))
    await _settle()
    q.leave()          # the slot is dispatched to "first" ...
    first.cancel()     # ... which is cancelled before it runs: the slot must reach "second"
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert who == ["second"] and q.running == 1 and not q.waiting


async def test_the_queue_is_bounded():
    q = DispatchQueue(capacity=1, max_waiting=2)
    assert q.try_enter()
    tasks = [asyncio.create_task(q.wait("a", BATCH, None)) for _ in range(2)]
    await _settle()
    with pytest.raises(QueueFull):
        await q.wait("b", INTERACTIVE, None)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert not q.waiting and q.running == 1


@pytest.mark.parametrize("capacity,max_waiting", [(0, 1), (1, -1)])
def test_bad_sizes_are_refused(capacity, max_waiting):
    with pytest.raises(ValueError):
        DispatchQueue(capacity, max_waiting)


async def test_waiting_by_order_counts_each_class():
    q = DispatchQueue(capacity=1)
    assert q.try_enter()
    parked = [asyncio.create_task(q.wait("a", BATCH, None)) for _ in range(3)]
    parked.append(asyncio.create_task(q.wait("b", INTERACTIVE, None)))
    await _settle()
    assert dict(q.waiting_by_order) == {BATCH: 3, INTERACTIVE: 1}
    q.leave()                       # the interactive one goes first
    await _settle()
    assert dict(q.waiting_by_order) == {BATCH: 3}
    parked[0].cancel()              # a cancelled waiter is no longer counted
    await _settle()
    assert dict(q.waiting_by_order) == {BATCH: 2}
    for _ in range(2):
        q.leave()
        await _settle()
    assert dict(q.waiting_by_order) == {}
    await asyncio.gather(*parked, return_exceptions=True)


@pytest.mark.parametrize("capacity, peer_running, age_s, share", [
    (8, 0, 0.0, 8),
    (8, 3, 0.0, 5),     # the other processes hold 3 of the 8
    (8, 8, 0.0, 1),     # they hold them all: one slot each still (their count is up to a report old)
    (8, 20, 0.0, 1),
    (8, 3, 1.9, 5),
    (8, 3, 2.1, 8),     # a count that stopped coming no longer counts
])
def test_the_share_of_one_capacity_across_gateway_processes(capacity, peer_running, age_s, share):
    t = [100.0]
    q = DispatchQueue(capacity, clock=lambda: t[0])
    q.set_peer_running(peer_running)
    t[0] += age_s
    assert q.share == share


async def test_a_smaller_share_queues_and_a_larger_one_dispatches_at_once():
    q = DispatchQueue(capacity=4)
    q.set_peer_running(2)  # another gateway process runs 2: this one may run 2
    assert q.try_enter() and q.try_enter() and not q.try_enter()
    who: list[str] = []
    tasks = [asyncio.create_task(_park(q, who, "b", BATCH, f"b{i}")) for i in range(2)]
    await _settle()
    assert who == [] and len(q.waiting) == 2
    q.set_peer_running(1)  # the other process finished one: one more here, without waiting for a leave()
    await _settle()
    assert who == ["b0"] and q.running == 3
    q.set_peer_running(0)
    await _settle()
    assert who == ["b0", "b1"] and q.running == 4
    await asyncio.gather(*tasks)

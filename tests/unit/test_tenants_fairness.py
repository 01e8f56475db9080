"""The local queue's choice: classes strictly, tenants least-recently-served, FIFO within a tenant."""

from __future__ import annotations

import pytest

from lmfleet.tenants.fairness import Waiting, expired, next_to_dispatch, served

I, B = 0, 10  # class orders: interactive, batch


def _w(seq: int, tenant: str, order: int = B, deadline: float | None = None) -> Waiting:
    return Waiting(seq, tenant, order, deadline)


@pytest.mark.parametrize("waiting, last_served, want", [
    ([], {}, None),
    ([_w(1, "a")], {}, 1),
    ([_w(1, "a", B), _w(2, "b", I)], {}, 2),  # interactive before batch, whoever came first
    ([_w(1, "a", B), _w(2, "a", I)], {"a": 5}, 2),
    ([_w(1, "a"), _w(2, "a"), _w(3, "b")], {"a": 7, "b": 3}, 3),  # b was served longer ago
    ([_w(1, "a"), _w(2, "a"), _w(3, "b")], {"a": 3, "b": 7}, 1),
    ([_w(1, "a"), _w(2, "b")], {"a": 3}, 2),  # never served goes first
    ([_w(2, "a"), _w(1, "b")], {}, 1),  # both never served: arrival order
    ([_w(5, "a"), _w(3, "a"), _w(4, "a")], {"a": 1}, 3),  # FIFO within a tenant
    ([_w(1, "a", B), _w(2, "b", I), _w(3, "c", I)], {"b": 9, "c": 2}, 3),  # fairness inside the urgent class
])
def test_next_to_dispatch(waiting, last_served, want):
    got = next_to_dispatch(waiting, last_served)
    assert (got.seq if got else None) == want


def _drain(queue: list[Waiting], slots: int) -> list[Waiting]:
    last: dict[str, int] = {}
    out = []
    for n in range(slots):
        w = next_to_dispatch(queue, last)
        if w is None:
            break
        queue.remove(w)
        last = served(last, w.tenant, n)
        out.append(w)
    return out


def test_one_tenants_flood_cannot_starve_another():
    """A queues 1000 batch requests first, then B queues 3: B's three are among the first six dispatched."""
    queue = [_w(i, "a") for i in range(1000)] + [_w(1000 + i, "b") for i in range(3)]
    order = [w.tenant for w in _drain(queue, 6)]
    assert order == ["a", "b", "a", "b", "a", "b"]


def test_round_robin_over_three_tenants():
    queue = [_w(i, t) for i, t in enumerate("aaaaabbbcc")]
    assert "".join(w.tenant for w in _drain(queue, 10)) == "abcabcabaa"


def test_interactive_always_before_batch():
    queue = [_w(i, "a", B) for i in range(5)] + [_w(10, "b", I), _w(11, "a", I)]
    order = [(w.tenant, w.order) for w in _drain(queue, 3)]
    assert order == [("b", I), ("a", I), ("a", B)]


def test_served_does_not_mutate():
    last = {"a": 1}
    assert served(last, "b", 2) == {"a": 1, "b": 2} and last == {"a": 1}


@pytest.mark.parametrize("now, want", [(5.0, []), (10.0, [1]), (30.0, [1, 3])])
def test_expired(now, want):
    queue = [_w(3, "b", deadline=20.0), _w(1, "a", deadline=10.0), _w(2, "a", I)]
    assert [w.seq for w in expired(queue, now)] == want

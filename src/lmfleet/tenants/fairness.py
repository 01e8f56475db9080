"""Which waiting request the local queue dispatches next, when a slot frees up.

    key(w) = (class order, tenant's last dispatch number, arrival number)     smallest first

* **Classes are strict**: a more urgent class (lower ``order``) always goes first; batch yields to
  interactive under contention (its deadline bounds how long it yields).
* **Within a class, least-recently-served tenant first**: every dispatch gets the next sequence number and
  the tenant remembers its last one; the tenant whose last dispatch is oldest (or who never had one)
  goes next: round-robin across the tenants that wait, not across requests. A tenant's next request
  waits for at most one dispatch per other waiting tenant of its class, however many they queued.
* **Within a tenant, first come first served** (arrival number).

A linear scan of a bounded queue (the gateway caps it): O(n) per dispatch, no state beyond
``last_served``, which the caller updates with :func:`served`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Waiting", "expired", "next_to_dispatch", "served"]


@dataclass(frozen=True)
class Waiting:
    """One request in the local queue."""

    seq: int
    """Arrival number (increasing)."""
    tenant: str
    order: int
    """Its class's ``order`` (lower goes first)."""
    deadline: float | None = None
    """Monotonic time after which it stops waiting (refused or sent to a provider); None: none."""


def next_to_dispatch(waiting: Iterable[Waiting], last_served: Mapping[str, int]) -> Waiting | None:
    """The request to dispatch next (None: nothing waits). ``last_served``: tenant -> sequence number of its
    latest dispatch (absent: never served, goes first)."""
    return min(waiting, key=lambda w: (w.order, last_served.get(w.tenant, -1), w.seq), default=None)


def served(last_served: Mapping[str, int], tenant: str, dispatch_no: int) -> dict[str, int]:
    """``last_served`` after ``tenant``'s request became dispatch number ``dispatch_no``."""
    return {**last_served, tenant: dispatch_no}


def expired(waiting: Sequence[Waiting], now: float) -> list[Waiting]:
    """The requests whose deadline has passed, in arrival order."""
    return sorted((w for w in waiting if w.deadline is not None and w.deadline <= now), key=lambda w: w.seq)

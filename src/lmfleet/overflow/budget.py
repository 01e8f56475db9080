"""External-spend budget: may overflow still spend money, and if not, when again?

Two rolling windows, an hour and a day, each with an optional cap (``BudgetConfig.hourly_usd``,
``daily_usd``). Spend is a list of ``(ts, usd)`` events (the ledger's external rows, possibly
bucketed; a bucket carries its *latest* timestamp, so it rolls off no earlier than its rows).

For a window ``W`` with cap ``cap``::

    spent(now) = pending_usd + sum(usd for ts, usd in events if ts > now - W)
    exhausted  = spent(now) >= cap

When exhausted, events roll off oldest first; ``retry_after_s`` is the time until enough of them
have left the window that ``spent < cap``: the smallest ``k`` such that
``spent - sum(first k events) < cap`` gives ``retry_after = ts_k + W - now``. ``pending_usd``
(the estimated cost of external requests still in flight) never rolls off in this computation;
if it alone reaches the cap, ``retry_after`` is the whole window, a conservative upper bound.
A cap of 0 disables spending: always exhausted, ``retry_after = W``.
Money is summed in integer nano-dollars, like the ledger, so the roll-off arithmetic is exact.
Both windows are checked; the answer is exhausted if either is, with the larger retry-after.

``retry_after_s`` is that roll-off arithmetic on its own, in nano-dollars, for one window: the spend store
(``lmfleet.store``) uses it for its caps, where a request of ``amount`` fits when ``spent + amount <= cap``
(``check_budget``'s ``spent < cap`` is the same rule with an amount of one nano-dollar).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lmfleet.overflow.money import nusd_to_usd, usd_to_nusd

__all__ = ["DAY_S", "HOUR_S", "BudgetStatus", "check_budget", "retry_after_s"]

HOUR_S = 3600.0
DAY_S = 86400.0


@dataclass(frozen=True)
class BudgetStatus:
    allowed: bool
    reason: str | None
    """None when allowed; else "hourly_budget_exhausted" or "daily_budget_exhausted"."""
    retry_after_s: float
    """Seconds until spending is allowed again (0 when allowed)."""
    spent_hour_usd: float
    spent_day_usd: float


def retry_after_s(events: Iterable[tuple[float, int]], *, held_nusd: int, amount_nusd: int, cap_nusd: int,
                  window_s: float, now: float) -> float:
    """Seconds until ``amount_nusd`` fits under ``cap_nusd`` in the window ending at ``now``, as the settled
    ``(ts, nusd)`` events roll off oldest first (0: it fits now). ``held_nusd`` never rolls off: if it blocks the
    amount on its own, or the amount is over the cap by itself, the whole window (a conservative bound)."""
    inside = sorted((ts, n) for ts, n in events if ts > now - window_s)
    remaining = held_nusd + sum(n for _, n in inside)
    if remaining + amount_nusd <= cap_nusd:
        return 0.0
    for ts, n in inside:
        remaining -= n
        if remaining + amount_nusd <= cap_nusd:
            return max(0.0, ts + window_s - now)
    return window_s


def _window(events: list[tuple[float, float]], cap: float | None, window_s: float, now: float,
            pending_usd: float) -> tuple[float, float | None]:
    """(spent in window, retry_after_s or None when under the cap)."""
    inside = [(ts, usd_to_nusd(usd)) for ts, usd in events if ts > now - window_s]
    held = usd_to_nusd(pending_usd)
    spent = held + sum(n for _, n in inside)
    if cap is None or spent < usd_to_nusd(cap):
        return nusd_to_usd(spent), None
    # spent < cap in integer nano-dollars is "one more nano-dollar fits"
    return nusd_to_usd(spent), retry_after_s(inside, held_nusd=held, amount_nusd=1, cap_nusd=usd_to_nusd(cap),
                                             window_s=window_s, now=now)


def check_budget(
    events: Iterable[tuple[float, float]],
    *,
    hourly_usd: float | None,
    daily_usd: float | None,
    now: float,
    pending_usd: float = 0.0,
) -> BudgetStatus:
    """Decide whether external spend is allowed at ``now`` (epoch seconds, like the events)."""
    ev = list(events)
    spent_h, retry_h = _window(ev, hourly_usd, HOUR_S, now, pending_usd)
    spent_d, retry_d = _window(ev, daily_usd, DAY_S, now, pending_usd)
    if retry_h is None and retry_d is None:
        return BudgetStatus(True, None, 0.0, spent_h, spent_d)
    if retry_d is not None and (retry_h is None or retry_d >= retry_h):
        return BudgetStatus(False, "daily_budget_exhausted", retry_d, spent_h, spent_d)
    return BudgetStatus(False, "hourly_budget_exhausted", retry_h or 0.0, spent_h, spent_d)

"""Pure decisions of the spend store: a request's worst-case cost, and whether a reservation fits its caps.

A **cap** is ``(key, window_s, cap_nusd)``: at most ``cap_nusd`` nano-dollars may be spent in any rolling
``window_s`` by requests that fall under ``key`` (``"global"`` today; per-tenant keys later). One request
usually falls under several caps (global hour, global day, its tenant's day, ...); it is admitted only if
it fits all of them::

    spent(cap)  = held(key) + sum(settled buckets of key whose end is inside the window)
    admitted    = for every cap: spent(cap) + amount <= cap_nusd

``held`` is the worst-case amount of reservations still in flight (not expired), which never rolls off
here. Settled spend is kept in buckets (``bucket_s``, default 60 s) that carry their *end* time, so a
bucket leaves the window no earlier than its last request: spend is never under-counted, and it
rolls off at most one bucket late.

When refused, the retry-after is when enough settled buckets have left the window for the same amount
to fit (``lmfleet.overflow.budget.retry_after_s``); if held reservations alone block it, or the amount is
over the cap by itself, the whole window (a conservative bound).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from lmfleet.config.models import ProviderPrice
from lmfleet.overflow.budget import DAY_S, HOUR_S
from lmfleet.overflow.money import usd_to_nusd

__all__ = [
    "GLOBAL",
    "Cap",
    "Refusal",
    "caps_exceeded",
    "caps_for_budget",
    "tenant_key",
    "worst_case_cost_nusd",
]

GLOBAL = "global"
"""The key every paid request falls under (the fleet-wide hourly and daily caps)."""


@dataclass(frozen=True)
class Cap:
    key: str
    """Which requests count against it: ``"global"``, later e.g. ``"tenant:acme"``."""
    window_s: float
    cap_nusd: int

    def __post_init__(self) -> None:
        if not self.key or "," in self.key:
            raise ValueError(f"cap key {self.key!r} must be non-empty and without ','")
        if self.window_s <= 0 or self.cap_nusd < 0:
            raise ValueError(f"{self.window_s=} must be > 0 and {self.cap_nusd=} >= 0")

    @property
    def name(self) -> str:
        return f"{self.key}/{self.window_s:g}s"

    @property
    def reason(self) -> str:
        """The refusal reason the gateway reports (budget.py's names for the global caps)."""
        if self.key == GLOBAL and self.window_s == HOUR_S:
            return "hourly_budget_exhausted"
        if self.key == GLOBAL and self.window_s == DAY_S:
            return "daily_budget_exhausted"
        return f"budget_exhausted:{self.name}"


@dataclass(frozen=True)
class Refusal:
    """A reservation that does not fit: which cap, how much is spent there, when to try again.

    Falsy, so ``if not store.reserve(...)`` reads like the ``None`` it stands in for.
    """

    cap: Cap
    spent_nusd: int
    """Held + settled in the cap's window at the time of the refusal."""
    amount_nusd: int
    retry_after_s: float

    def __bool__(self) -> bool:
        return False

    @property
    def reason(self) -> str:
        return self.cap.reason


def caps_for_budget(budget: Any, key: str = GLOBAL) -> list[Cap]:
    """The hourly and daily caps (``hourly_usd`` / ``daily_usd``, those set) of ``BudgetConfig`` or a tenant's
    limits, under ``key``."""
    caps = []
    for usd, window in ((budget.hourly_usd, HOUR_S), (budget.daily_usd, DAY_S)):
        if usd is not None:
            caps.append(Cap(key, window, usd_to_nusd(usd)))
    return caps


def tenant_key(name: str) -> str:
    """The spend-cap key of one tenant's external spend."""
    return f"tenant:{name}"


def _nusd_per_token(usd_per_1m: float) -> Decimal:
    # the float's shortest repr as an exact decimal: 0.15 $/1M is exactly 150 nusd/token, not 150.00000000000003
    return Decimal(repr(usd_per_1m)) * 1000


def worst_case_cost_nusd(prompt_tokens: int, max_tokens: int | None, price: ProviderPrice, *,
                         max_model_len: int | None = None) -> int:
    """The most a provider request can cost: ``prompt × input price + output bound × output price``, rounded up.

    The output bound is ``max_tokens``, or ``max_model_len - prompt_tokens`` when the request sets none;
    with both, the smaller (the context caps the output). With neither the cost is unbounded: ValueError.
    """
    if prompt_tokens < 0 or (max_tokens is not None and max_tokens < 0):
        raise ValueError(f"negative token count: {prompt_tokens=} {max_tokens=}")
    bounds = [b for b in (max_tokens, None if max_model_len is None else max(0, max_model_len - prompt_tokens))
              if b is not None]
    if not bounds:
        raise ValueError("worst-case cost is unbounded: the request has no max_tokens and the model no max_model_len")
    cost = prompt_tokens * _nusd_per_token(price.input_per_1m) + min(bounds) * _nusd_per_token(price.output_per_1m)
    return math.ceil(cost)


def caps_exceeded(amount_nusd: int, caps: Sequence[Cap], spent_nusd: Mapping[Cap, int]) -> list[Cap]:
    """The caps (in ``caps`` order) that ``amount_nusd`` would push over; empty when it fits them all."""
    if amount_nusd < 0:
        raise ValueError(f"{amount_nusd=} must be >= 0")
    return [cap for cap in caps if spent_nusd[cap] + amount_nusd > cap.cap_nusd]

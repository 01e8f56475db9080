"""Money as integer nano-dollars (``nusd``): sums of many small costs stay exact (no float drift).

The ledger stores ``cost_nusd`` and the budget sums its windows in the same unit, so a total equals
the sum of its rows to the last nano-dollar. Convert at the edges only.
"""

from __future__ import annotations

__all__ = ["NUSD_PER_USD", "nusd_to_usd", "usd_to_nusd"]

NUSD_PER_USD = 1_000_000_000


def usd_to_nusd(usd: float) -> int:
    """USD -> nano-dollars, rounded to the nearest one."""
    return round(usd * NUSD_PER_USD)


def nusd_to_usd(nusd: int) -> float:
    """Nano-dollars -> USD."""
    return nusd / NUSD_PER_USD

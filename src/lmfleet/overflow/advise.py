"""Rent or buy: would one more local replica have cost less than the overflow it would have absorbed? Pure.

From the ledger's rows over a window, per model:

* ``hours_over``: clock hours (UTC, ``floor(time / 3600)``) in which the model's provider spend exceeded the
  hourly cost of one more replica (``gpu_hour_usd`` x the GPUs one replica holds, or ``node_hour_usd`` for
  CPU-only engines: :func:`replica_hour_nusd`);
* ``overflow_nusd`` against ``replica_nusd``: what the providers cost over the window, and what one more
  replica would have cost had it run the whole window (``hours x hourly``); and the same two sums over the
  ``hours_over`` only (a replica that an autoscaler adds in those hours);
* $/1M output tokens either way: the provider spend, and the replica's cost, over the output tokens the
  providers served (the tokens the extra replica would have had to serve), as ``lmfleet usage`` divides.

The answer, ``buy``, says the replica over the whole window would have cost less than the overflow did. It
assumes that replica could have served all of that overflow: a peak beyond one replica's throughput would
still overflow, so a ``buy`` is an upper bound on the saving, never a promise. Money is integer nano-dollars.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lmfleet.config.models import ModelConfig
from lmfleet.overflow.cost import local_hourly_cost_usd
from lmfleet.overflow.money import nusd_to_usd, usd_to_nusd
from lmfleet.provenance import is_external

__all__ = ["HOUR_S", "AdviceRow", "LedgerFacts", "advise", "facts_from_rows", "replica_hour_nusd"]

HOUR_S = 3600


@dataclass(frozen=True)
class LedgerFacts:
    """The fields of one ledger row that the advice needs."""

    time_s: float
    """When the request finished, epoch seconds."""
    model: str
    served_by: Literal["local", "provider"]
    cost_nusd: int
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class AdviceRow:
    model: str
    hours: int
    """Clock hours in the window."""
    hours_over: int
    """Hours in which provider spend exceeded one more replica's hourly cost."""
    replica_hour_nusd: int
    overflow_nusd: int
    replica_nusd: int
    """One more replica for the whole window."""
    overflow_over_nusd: int
    """Provider spend in the ``hours_over``."""
    replica_over_nusd: int
    """One more replica in the ``hours_over`` only."""
    overflow_output_tokens: int
    local_output_tokens: int

    @property
    def overflow_usd_per_1m(self) -> float | None:
        """Provider spend per million output tokens the providers served; None when they served none."""
        return _per_1m(self.overflow_nusd, self.overflow_output_tokens)

    @property
    def replica_usd_per_1m(self) -> float | None:
        """One more replica's window cost per million of those same tokens; None when there were none."""
        return _per_1m(self.replica_nusd, self.overflow_output_tokens)

    def as_dict(self) -> dict[str, Any]:
        """Dollars, for JSON (``lmfleet usage --advise --json``, ``GET /admin/usage?advise=1``)."""
        return {"model": self.model, "hours": self.hours, "hours_over": self.hours_over,
                "replica_hour_usd": nusd_to_usd(self.replica_hour_nusd), "overflow_usd": nusd_to_usd(self.overflow_nusd),
                "replica_usd": nusd_to_usd(self.replica_nusd), "overflow_over_usd": nusd_to_usd(self.overflow_over_nusd),
                "replica_over_usd": nusd_to_usd(self.replica_over_nusd),
                "overflow_output_tokens": self.overflow_output_tokens, "local_output_tokens": self.local_output_tokens,
                "overflow_usd_per_1m": self.overflow_usd_per_1m, "replica_usd_per_1m": self.replica_usd_per_1m,
                "verdict": self.verdict}

    @property
    def verdict(self) -> Literal["buy", "rent"]:
        """``buy``: the replica over the window costs less than the overflow did; ``rent``: keep overflowing."""
        return "buy" if self.replica_nusd < self.overflow_nusd else "rent"


def facts_from_rows(rows: Iterable[Mapping[str, Any]]) -> list[LedgerFacts]:
    """The advice's fields of raw ledger rows (``Ledger.rows``: ``ts``, ``model``, ``served_by`` as a provenance
    label, ``cost_usd``, token counts); rows without a model (refused before routing) are left out."""
    return [LedgerFacts(time_s=float(r["ts"]), model=r["model"],
                        served_by="provider" if is_external(r["served_by"] or "") else "local",
                        cost_nusd=usd_to_nusd(r["cost_usd"] or 0.0), input_tokens=int(r["input_tokens"] or 0),
                        output_tokens=int(r["output_tokens"] or 0))
            for r in rows if r.get("model")]


def _per_1m(nusd: int, tokens: int) -> float | None:
    return None if tokens <= 0 else nusd_to_usd(nusd) * 1e6 / tokens


def replica_hour_nusd(model: ModelConfig, *, uses_gpus: bool) -> int:
    """The hourly cost of one more replica of ``model`` (``cost.gpu_hour_usd`` x its GPUs, or ``node_hour_usd``)."""
    return usd_to_nusd(local_hourly_cost_usd(model, uses_gpus=uses_gpus, replicas=1))


def advise(
    rows: Iterable[LedgerFacts],
    replica_hour: Mapping[str, int],
    *,
    window: tuple[float, float] | None = None,
) -> list[AdviceRow]:
    """One :class:`AdviceRow` per model of ``replica_hour`` (model -> nano-dollars per replica-hour), by name.

    ``window``: (start, end) epoch seconds; rows outside it are ignored, and it counts
    ``ceil((end - start) / 3600)`` hours. None: from the earliest row's clock hour to the end of the latest
    row's (no rows: every model gets an empty row of 0 hours).
    """
    picked = [r for r in rows if r.model in replica_hour
              and (window is None or window[0] <= r.time_s < window[1])]
    if window is not None:
        if window[1] <= window[0]:
            raise ValueError(f"window {window} must end after it starts")
        hours = math.ceil((window[1] - window[0]) / HOUR_S)
    elif picked:
        first = math.floor(min(r.time_s for r in picked) / HOUR_S)
        last = math.floor(max(r.time_s for r in picked) / HOUR_S)
        hours = last - first + 1
    else:
        hours = 0

    spend_by_hour: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    out_tokens: dict[tuple[str, str], int] = defaultdict(int)
    for r in picked:
        if r.served_by == "provider":
            spend_by_hour[r.model][math.floor(r.time_s / HOUR_S)] += r.cost_nusd
        out_tokens[(r.model, r.served_by)] += r.output_tokens

    result = []
    for model in sorted(replica_hour):
        hourly = replica_hour[model]
        spend = spend_by_hour.get(model, {})
        over = [h for h, nusd in spend.items() if nusd > hourly]
        result.append(AdviceRow(
            model=model, hours=hours, hours_over=len(over), replica_hour_nusd=hourly,
            overflow_nusd=sum(spend.values()), replica_nusd=hourly * hours,
            overflow_over_nusd=sum(spend[h] for h in over), replica_over_nusd=hourly * len(over),
            overflow_output_tokens=out_tokens[(model, "provider")],
            local_output_tokens=out_tokens[(model, "local")],
        ))
    return result

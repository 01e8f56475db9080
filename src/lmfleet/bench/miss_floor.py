"""What ``overflow.miss_floor`` would have done to recorded decisions, and the floor chosen leave-one-trace-out
(``benchmarks/estimator_loto.py --miss-floors``). Pure.

The rows are the requests a replay kept local (:mod:`lmfleet.bench.loto`'s dataset), each with the estimate and the
margin the route weighed (its ``admission`` record). A floor ``f`` raises a learned margin to ``f x threshold``
where the margin applies (an estimate of ``BAND[0] x threshold`` or more, :func:`lmfleet.overflow.margin.
applied_margin_ms`): a row whose estimate plus that margin passes the threshold would have gone to a provider. Of
those, the ones whose realised wait passed the threshold are misses the floor catches; the rest are spills it
adds. A row recorded with the prior (no learned margin yet) keeps its margin; one recorded with no margin on an
idle engine gets the floor where its estimate came from a measured prefill line (``idle``, as the gateway does,
:func:`lmfleet.overflow.margin.miss_margin_ms`), else keeps it (a learned margin of exactly 0 on an idle engine counts
as no margin). What this leaves out: a spilled request no longer holds a slot, so the requests after it
would have waited less (the figures are for the recorded queue, which errs towards more misses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lmfleet.overflow.admission import Admission
from lmfleet.overflow.estimators import admission_of
from lmfleet.overflow.margin import BAND, CAP, PRIOR

__all__ = ["FloorCount", "FloorPick", "floor_counts", "floor_loto"]


@dataclass(frozen=True)
class FloorCount:
    local: int
    """Rows (requests kept local)."""
    missed: int
    """Of them, realised wait over the threshold."""
    caught: int
    """Missed ones the floor would have spilled."""
    added: int
    """Rows the floor would have spilled that met the threshold locally."""

    @property
    def kept_missed(self) -> int:
        return self.missed - self.caught


@dataclass(frozen=True)
class FloorPick:
    held_out: str
    floor: float
    """The floor with the lowest ``miss_weight x kept_missed + added`` on the other traces (the lowest on a tie)."""
    count: FloorCount
    """What it does on the held-out trace."""


def _floored(a: Admission, idle: bool) -> bool:
    """Whether the floor applies to the margin recorded in ``a`` (module docstring)."""
    if a.margin_ms == PRIOR * CAP * a.threshold_ms:
        return False
    if a.margin_ms == 0 and a.signals.in_flight == 0:
        return idle and a.signals.line_measured
    return True


def floor_counts(rows: Sequence[Mapping], floor: float, idle: bool = True) -> FloorCount:
    """The rows' misses, and what a miss floor of ``floor`` (a share of each row's threshold) would have spilled;
    ``idle``: also on an idle engine with a measured prefill line (the gateway's rule), else on a learned margin
    only."""
    local = missed = caught = added = 0
    for r in rows:
        a = admission_of(r)
        thr, est, applied = float(a.threshold_ms), float(a.estimate_ms), float(a.applied_margin_ms)
        miss = float(r["realised_wait_ms"]) > thr
        local += 1
        missed += miss
        if est >= BAND[0] * thr and _floored(a, idle):
            applied = max(applied, floor * thr)
        if est + applied > thr:
            caught += miss
            added += not miss
    return FloorCount(local, missed, caught, added)


def floor_loto(datasets: Mapping[str, Sequence[Mapping]], floors: Sequence[float],
               miss_weight: float) -> list[FloorPick]:
    """For each trace held out: the floor that did best on the others (``miss_weight`` added spills are worth one
    kept miss), and its counts on the held-out one."""
    counts = {f: {t: floor_counts(rs, f) for t, rs in datasets.items()} for f in floors}

    def cost(f: float, traces: Sequence[str]) -> float:
        return sum(miss_weight * counts[f][t].kept_missed + counts[f][t].added for t in traces)

    picks = []
    for held in datasets:
        others = [t for t in datasets if t != held]
        best = min(sorted(floors), key=lambda f: cost(f, others))
        picks.append(FloorPick(held, best, counts[best][held]))
    return picks

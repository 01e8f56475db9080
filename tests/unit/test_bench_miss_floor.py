"""lmfleet.bench.miss_floor: what overflow.miss_floor would have done to recorded decisions, as a table, and the
floor chosen leave-one-trace-out."""

from __future__ import annotations

import pytest

from lmfleet.bench.miss_floor import FloorCount, floor_counts, floor_loto
from lmfleet.overflow.margin import CAP, PRIOR

THR = 2500.0


def row(estimate: float, realised: float, margin: float = 0.0, in_flight: int = 3, line: bool = False,
        stale: bool = False) -> dict:
    """``line``: recorded with a measured prefill line (``stale``: gone stale)."""
    applied = margin if estimate >= 0.5 * THR else 0.0
    return {"realised_wait_ms": realised, "admission": {
        "signals": {"now": 0.0, "in_flight": in_flight, "drain_rps": None, "output_tps": None, "ttft_s": None,
                    "base_ttft_s": 0.4 if line else None, "completions_in_window": 0,
                    "prefill_s_per_token": 0.001 if line else None, "base_prefill_tokens": 300.0 if line else None,
                    "prefill_stale": stale}, "capacity": 8, "prompt_tokens": 100, "order": None,
        "estimate_ms": estimate, "margin_ms": margin, "applied_margin_ms": applied, "threshold_ms": THR}}


@pytest.mark.parametrize("r,floor,expected", [
    (row(2200, 2700), 0.15, FloorCount(1, 1, 1, 0)),             # 2200 + 375 > 2500: a miss caught
    (row(2200, 2300), 0.15, FloorCount(1, 0, 0, 1)),             # ... a spill added
    (row(2200, 2700), 0.1, FloorCount(1, 1, 0, 0)),              # 2200 + 250 stays local
    (row(2200, 2700, margin=400), 0, FloorCount(1, 1, 1, 0)),    # the learned margin would have spilled it already
    (row(2200, 2700, margin=100), 0.15, FloorCount(1, 1, 1, 0)),  # a learned margin under the floor: raised
    (row(1100, 2700), 0.5, FloorCount(1, 1, 0, 0)),              # under the margin's band: the floor never applies
    (row(1600, 2700, margin=PRIOR * CAP * THR), 0.5, FloorCount(1, 1, 0, 0)),  # the prior, not a learned margin
    (row(2200, 2700, in_flight=0), 0.15, FloorCount(1, 1, 0, 0)),  # idle, cold estimate: no margin
    (row(2200, 2700, in_flight=0, line=True), 0.15, FloorCount(1, 1, 1, 0)),  # idle, measured line: the floor
    (row(2200, 2300, in_flight=0, line=True), 0.15, FloorCount(1, 0, 0, 1)),
    (row(2200, 2700, in_flight=0, line=True, stale=True), 0.15, FloorCount(1, 1, 0, 0)),  # a stale line: none
    (row(2200, 2700, margin=50, in_flight=0), 0.15, FloorCount(1, 1, 1, 0)),  # idle with a learned margin
])
def test_floor_counts(r, floor, expected):
    assert floor_counts([r], floor) == expected


def test_floor_counts_on_a_learned_margin_only():
    idle = row(2200, 2700, in_flight=0, line=True)
    assert floor_counts([idle], 0.15, idle=False) == FloorCount(1, 1, 0, 0)
    assert floor_counts([row(2200, 2700)], 0.15, idle=False) == FloorCount(1, 1, 1, 0)


def test_the_floor_is_chosen_on_the_other_traces():
    near_misses = [row(2200, 2700)] * 2              # the floor 0.15 catches both
    near_fine = [row(2200, 2300)] * 4                # the floor 0.15 adds four spills
    datasets = {"a": near_misses, "b": near_misses, "c": near_fine}
    picks = {p.held_out: (p.floor, p.count.kept_missed, p.count.added) for p in floor_loto(datasets, [0, 0.15], 3)}
    assert picks == {"a": (0.15, 0, 0),              # on b and c: 2 misses x 3 > 4 spills
                     "b": (0.15, 0, 0),
                     "c": (0.15, 0, 4)}              # on a and b: 4 misses
    picks = {p.held_out: p.floor for p in floor_loto(datasets, [0, 0.15], 1)}
    assert picks == {"a": 0, "b": 0, "c": 0.15}      # 2 misses x 1 < 4 spills where c is in the training set

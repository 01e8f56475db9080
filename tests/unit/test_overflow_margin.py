"""The miss margin (lmfleet.overflow.margin): the quantile of recent near-threshold under-predictions, as a table,
and the window that feeds it."""

from __future__ import annotations

import pytest

from lmfleet.overflow.margin import (CAP, FLOOR, MIN_SAMPLES, PRIOR, WINDOW_S, MissMargin, applied_margin_ms,
                                     miss_margin_ms)


@pytest.mark.parametrize("errors,quantile,cap,expected", [
    ([], 0.9, 1250, PRIOR * 1250),                             # nothing seen: the prior
    ([900.0] * (MIN_SAMPLES - 1), 0.9, 1250, PRIOR * 1250),    # too few to trust: the prior
    ([0.0] * (MIN_SAMPLES - 1), 0.9, 1250, PRIOR * 1250),
    ([], None, 1250, 0.0),                                     # miss_quantile null: no prior either
    ([900.0] * MIN_SAMPLES, 0.9, 1250, 900.0),
    ([900.0] * MIN_SAMPLES, None, 1250, 0.0),                  # miss_quantile null: the estimate alone decides
    ([-500.0] * 10, 0.9, 1250, 0.0),                           # over-predicted: never a negative margin
    ([3000.0] * 10, 0.9, 1250, 1250.0),                        # capped: an idle engine's requests stay local
    ([float(e) for e in range(0, 1000, 100)], 0.9, 1250, 810.0),  # 0..900: P90 by linear interpolation
    ([float(e) for e in range(0, 1000, 100)], 0.5, 1250, 450.0),
    ([-400.0] * 8 + [2000.0, 2000.0], 0.8, 1250, 80.0),        # 2 big misses in 10 barely move P80
    ([-400.0] * 8 + [2000.0, 2000.0], 0.9, 1250, 1250.0),      # ... but set P90 (2000, capped)
])
def test_miss_margin(errors, quantile, cap, expected):
    assert miss_margin_ms(errors, quantile, cap) == pytest.approx(expected)


@pytest.mark.parametrize("errors,quantile,floor,expected", [
    ([-500.0] * 10, 0.9, 375, 375.0),                          # the estimate was right: the floor
    ([100.0] * 10, 0.9, 375, 375.0),
    ([900.0] * 10, 0.9, 375, 900.0),                           # learned above it: the learned margin
    ([3000.0] * 10, 0.9, 2000, 1250.0),                        # the cap still bounds it
    ([], 0.9, 375, PRIOR * 1250),                              # before the samples: the prior, not the floor
    ([], 0.9, 1000, PRIOR * 1250),
    ([-500.0] * 10, None, 375, 0.0),                           # miss_quantile null: no margin at all
])
def test_the_learned_margin_is_at_least_the_floor(errors, quantile, floor, expected):
    assert miss_margin_ms(errors, quantile, 1250, floor_ms=floor) == pytest.approx(expected)
    assert miss_margin_ms(errors, quantile, 1250, floor_ms=floor, idle=True) == pytest.approx(
        0.0 if not errors else expected)                       # an idle engine, cold estimate: no prior, no floor


@pytest.mark.parametrize("errors,quantile,floor,measured,expected", [
    ([], 0.9, 375, True, 375.0),                               # idle, prefill line measured: the floor
    ([900.0] * (MIN_SAMPLES - 1), 0.9, 375, True, 375.0),      # too few samples: still the floor, not the prior
    ([], 0.9, 375, False, 0.0),                                # the cold estimate (or a stale line): nothing
    ([], 0.9, 0.0, True, 0.0),                                 # miss_floor 0: nothing
    ([], 0.9, 2000, True, 1250.0),                             # capped
    ([], None, 375, True, 0.0),                                # miss_quantile null: no margin at all
    ([900.0] * MIN_SAMPLES, 0.9, 375, True, 900.0),            # learned: as on a busy engine
    ([-500.0] * MIN_SAMPLES, 0.9, 375, False, 375.0),
])
def test_an_idle_engine_with_a_measured_prefill_line_gets_the_floor(errors, quantile, floor, measured, expected):
    assert miss_margin_ms(errors, quantile, 1250, floor_ms=floor, idle=True, measured=measured) == pytest.approx(
        expected)
    assert miss_margin_ms(errors, quantile, 1250, floor_ms=floor, idle=False, measured=measured) == pytest.approx(
        miss_margin_ms(errors, quantile, 1250, floor_ms=floor))  # busy: ``measured`` changes nothing


@pytest.mark.parametrize("errors,expected", [
    ([], 0.0),                                                 # an idle engine: no prior
    ([900.0] * (MIN_SAMPLES - 1), 0.0),
    ([900.0] * MIN_SAMPLES, 900.0),                            # what was learned holds, idle or not
])
def test_an_idle_engine_gets_no_prior(errors, expected):
    assert miss_margin_ms(errors, 0.9, 1250, idle=True) == pytest.approx(expected)


def test_only_requests_predicted_near_the_threshold_count():
    m = MissMargin(0.9)
    for _ in range(20):
        m.observe(predicted_ms=300, realised_ms=4000, threshold_ms=2500, now=0.0)  # an unqueued request: left out
        m.observe(predicted_ms=9000, realised_ms=20000, threshold_ms=2500, now=0.0)  # far above: left out
    assert m.margin_ms(2500, now=1.0) == pytest.approx(PRIOR * CAP * 2500)
    for _ in range(MIN_SAMPLES):
        m.observe(predicted_ms=1700, realised_ms=2600, threshold_ms=2500, now=0.0)
    assert m.margin_ms(2500, now=1.0) == pytest.approx(900.0)


def test_old_samples_leave_the_window():
    m = MissMargin(0.9, floor=0.0)
    for _ in range(MIN_SAMPLES):
        m.observe(1700, 2600, 2500, now=0.0)
    assert m.margin_ms(2500, now=WINDOW_S - 1) == pytest.approx(900.0)
    assert m.margin_ms(2500, now=WINDOW_S + 1) == pytest.approx(PRIOR * CAP * 2500)  # the prior again
    for _ in range(MIN_SAMPLES):
        m.observe(1700, 1600, 2500, now=WINDOW_S + 1)  # a quiet spell's samples: over-predicted, no margin
    assert m.margin_ms(2500, now=WINDOW_S + 2) == 0.0
    m.floor = FLOOR
    assert m.margin_ms(2500, now=WINDOW_S + 2) == pytest.approx(FLOOR * 2500)  # the default floor


@pytest.mark.parametrize("floor", [-0.1, 0.6, True, "0.1", None])
def test_a_floor_outside_0_to_the_cap_is_refused(floor):
    with pytest.raises(ValueError, match="miss_floor"):
        MissMargin(0.9, floor=floor)


@pytest.mark.parametrize("threshold,expected", [
    (2500, 900.0),   # 1700 is within 0.5-1.5 x 2500
    (1200, 600.0),   # within 0.5-1.5 x 1200 too; capped at half the new threshold
    (4000, PRIOR * CAP * 4000),  # 1700 < 0.5 x 4000: not near the new threshold, which has the prior
])
def test_a_new_threshold_uses_the_samples_near_it(threshold, expected):
    m = MissMargin(0.9)
    for _ in range(MIN_SAMPLES):
        m.observe(1700, 2600, 2500, now=0.0)
    assert m.margin_ms(threshold, now=1.0) == pytest.approx(expected)


def test_no_quantile_learns_nothing_and_a_bad_one_is_refused():
    m = MissMargin(None)
    for _ in range(20):
        m.observe(1700, 5000, 2500, now=0.0)
    assert m.margin_ms(2500, now=1.0) == 0.0
    with pytest.raises(ValueError, match="quantile"):
        MissMargin(1.0)


@pytest.mark.parametrize("estimate,margin,threshold,expected", [
    (1700, 900, 2500, 900),     # queued near the threshold: the margin applies
    (1250, 900, 2500, 900),     # the band's edge
    (1000, 1250, 2500, 0),      # a free slot, or an idle engine after a burst: stays local on its estimate
    (300, 1250, 2500, 0),
    (4000, 900, 2500, 900),     # above the threshold anyway
    (1700, 0, 2500, 0),         # nothing learned
])
def test_the_margin_applies_to_estimates_in_its_band(estimate, margin, threshold, expected):
    assert applied_margin_ms(estimate, margin, threshold) == expected

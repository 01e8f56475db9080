"""Error statistics of the predicted local wait, on pairs whose answers are known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmfleet.overflow.estimate_error import (
    EstimateError,
    EstimateSample,
    estimate_error,
    estimate_errors,
    percentile,
    samples_from_rows,
)


@pytest.mark.parametrize("pairs, expected", [
    # exact predictions
    ([(100, 100), (200, 200)], EstimateError("m", 2, 0.0, 0.0, 0.0, 1.0)),
    # always 50 ms too low: bias +50, ratio 1.5 / 1.25 -> median 1.375
    ([(100, 150), (200, 250)], EstimateError("m", 2, 50.0, 50.0, 50.0, 1.375)),
    # always too high: negative bias
    ([(1000, 500), (1000, 700), (1000, 900)], EstimateError("m", 3, 300.0, 460.0, -300.0, 0.7)),
    # errors 0..100 in steps of 10 (11 values): median 50, P90 90
    ([(0, float(e)) for e in range(0, 101, 10)], EstimateError("m", 11, 50.0, 90.0, 50.0, None)),
    # one pair
    ([(400, 1275)], EstimateError("m", 1, 875.0, 875.0, 875.0, 1275 / 400)),
])
def test_estimate_error_table(pairs, expected):
    got = estimate_error("m", pairs)
    assert (got.model, got.count) == (expected.model, expected.count)
    for f in ("median_abs_error_ms", "p90_abs_error_ms", "bias_ms"):
        assert getattr(got, f) == pytest.approx(getattr(expected, f)), f
    if expected.median_ratio is None:
        assert got.median_ratio is None
    else:
        assert got.median_ratio == pytest.approx(expected.median_ratio)


def test_per_model_and_share_of_threshold():
    samples = [EstimateSample("b", 100, 400), EstimateSample("a", 1000, 1000), EstimateSample("b", 100, 100)]
    a, b = estimate_errors(samples)
    assert (a.model, a.count, a.p90_abs_error_ms) == ("a", 1, 0.0)
    assert (b.model, b.count, b.median_abs_error_ms) == ("b", 2, 150.0)
    assert b.as_dict(2500)["p90_abs_error_pct_of_threshold"] == round(100 * b.p90_abs_error_ms / 2500, 1)
    assert estimate_errors([]) == []


def test_no_pairs_is_an_error():
    with pytest.raises(ValueError, match="no \\(predicted, actual\\) pairs"):
        estimate_error("m", [])


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [1.0, 9.0, 2.0, 7.0, 7.5, 0.1]])
@pytest.mark.parametrize("p", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_samples_from_ledger_rows_need_both_waits():
    rows = [
        {"model": "m", "served_by": "local/m", "predicted_wait_ms": 100.0, "realised_wait_ms": 250.0},
        {"model": "m", "served_by": "local/m", "predicted_wait_ms": 100.0, "realised_wait_ms": None},  # not streamed
        {"model": "m", "served_by": "provider/p", "predicted_wait_ms": None, "realised_wait_ms": None},
        {"model": "m", "served_by": "local/m"},  # a row from before the columns
        {"model": "n", "served_by": "local/n", "predicted_wait_ms": 0.0, "realised_wait_ms": 40.0},
    ]
    assert samples_from_rows(rows) == [EstimateSample("m", 100.0, 250.0), EstimateSample("n", 0.0, 40.0)]


def test_report_dict_with_and_without_threshold():
    e = estimate_error("m", [(1000, 500), (1000, 700), (1000, 900)])
    d = e.as_dict(2500.0)
    assert d == {"model": "m", "requests": 3, "median_abs_error_ms": 300.0, "p90_abs_error_ms": 460.0,
                 "median_abs_error_pct_of_threshold": 12.0, "p90_abs_error_pct_of_threshold": 18.4,
                 "bias_ms": -300.0, "median_actual_over_predicted": 0.7, "threshold_ms": 2500.0,
                 "missed": None, "missed_pct": None}
    assert e.as_dict()["p90_abs_error_pct_of_threshold"] is None


@pytest.mark.parametrize("pairs, threshold_ms, missed, missed_pct", [
    ([(1000, 500), (1000, 700), (1000, 900)], 800.0, 1, 33.33),
    ([(1000, 800)], 800.0, 0, 0.0),                 # a wait equal to the threshold is not a miss
    ([(100, 3000), (100, 2600)], 2500.0, 2, 100.0),
    ([(100, 3000)], None, None, None),              # no threshold: unknown, not 0
])
def test_missed_counts_waits_past_the_threshold(pairs, threshold_ms, missed, missed_pct):
    e = estimate_error("m", pairs, threshold_ms)
    assert e.missed == missed
    assert e.as_dict(threshold_ms)["missed_pct"] == missed_pct


def test_estimate_errors_take_each_models_threshold():
    samples = [EstimateSample("a", 100, 400), EstimateSample("b", 100, 400), EstimateSample("c", 100, 400)]
    a, b, c = estimate_errors(samples, {"a": 300.0, "b": 500.0})
    assert (a.missed, b.missed, c.missed) == (1, 0, None)

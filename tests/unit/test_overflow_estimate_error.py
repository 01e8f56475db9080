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
    assert b.p90_share_of(2500) == pytest.approx(b.p90_abs_error_ms / 2500)
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

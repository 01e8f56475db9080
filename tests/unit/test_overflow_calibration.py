"""The live calibration window of the wait estimate: expiry, miss share, P90 error, empty windows."""

from __future__ import annotations

import pytest

from lmfleet.overflow.calibration import Calibration, CalibrationBook, CalibrationWindow, Sample, calibrate


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("samples, expected", [
    # exact predictions, nothing over the threshold
    ([Sample(0, 100, 100, 1000), Sample(1, 200, 200, 1000)], Calibration("m", 60, 2, 0, 0.0, 0.0, 1000, 0.0)),
    # one of four waited past the threshold (a wait equal to it is not a miss); |errors| 0, 0, 100, 600:
    # P90 at rank 2.7 = 100 + 0.7 x 500
    ([Sample(0, 900, 1500, 1000), Sample(1, 900, 1000, 1000), Sample(2, 100, 100, 1000), Sample(3, 100, 100, 1000)],
     Calibration("m", 60, 4, 1, 0.25, 450.0, 1000, 0.45)),
    # errors 0..100 ms in steps of 10: P90 90 ms = 3.6 % of 2500
    ([Sample(i, 0, 10 * i, 2500) for i in range(11)], Calibration("m", 60, 11, 0, 0.0, 90.0, 2500, 0.036)),
    # too high or too low counts alike: |error|
    ([Sample(0, 1000, 400, 2000), Sample(1, 400, 1000, 2000)], Calibration("m", 60, 2, 0, 0.0, 600.0, 2000, 0.3)),
    # no threshold known: no miss share, no share of it; the P90 still stands
    ([Sample(0, 100, 400, None)], Calibration("m", 60, 1, None, None, 300.0, None, None)),
    # misses judged against each sample's own threshold; the share uses the newest one
    ([Sample(0, 100, 1500, 1000), Sample(1, 100, 1500, 2000)], Calibration("m", 60, 2, 1, 0.5, 1400.0, 2000, 0.7)),
    # samples without a threshold are left out of the miss share only
    ([Sample(0, 100, 1500, None), Sample(1, 100, 1500, 1000)], Calibration("m", 60, 2, 1, 1.0, 1400.0, 1000, 1.4)),
])
def test_calibrate_table(samples, expected):
    got = calibrate("m", samples, 60)
    assert got is not None
    assert (got.model, got.window_s, got.count, got.missed, got.threshold_ms) == \
        (expected.model, expected.window_s, expected.count, expected.missed, expected.threshold_ms)
    for f in ("miss_ratio", "p90_abs_error_ms", "p90_share_of_threshold"):
        want = getattr(expected, f)
        assert getattr(got, f) == (None if want is None else pytest.approx(want)), f


def test_empty_window_is_none_not_zero():
    assert calibrate("m", [], 60) is None
    book = CalibrationBook(clock=Clock())
    assert book.summary("m") is None  # never seen
    assert book.models() == []


@pytest.mark.parametrize("ages, window_s, kept", [
    ([0, 10, 59], 60, 3),
    ([0, 10, 61], 60, 2),            # older than the window: gone
    ([100, 200], 60, 0),             # everything expired: the window is empty again
    ([60], 60, 1),                   # exactly the window's length: still in
])
def test_window_forgets_old_samples(ages, window_s, kept):
    clock = Clock()
    book = CalibrationBook(window_s, clock=clock, threshold_of=lambda m: 1000.0)
    for age in sorted(ages, reverse=True):  # oldest first
        clock.t = 1000.0 - age
        book.add("m", 100, 200)
    clock.t = 1000.0
    got = book.summary("m")
    assert (got.count if got is not None else 0) == kept
    assert book.models() == ["m"]


def test_window_keeps_the_newest_max_samples_and_expires_on_add():
    w = CalibrationWindow(window_s=10, max_samples=3)
    for t in range(5):
        w.add(Sample(t, 0, t, None))
    assert [s.t for s in w.samples(4)] == [2, 3, 4]
    w.add(Sample(20, 0, 0, None))  # adding expires the old ones too
    assert [s.t for s in w.samples(20)] == [20]


def test_book_per_model_with_threshold_at_the_time_of_the_sample():
    clock, thresholds = Clock(), {"a": 1000.0, "b": 500.0}
    book = CalibrationBook(60, clock=clock, threshold_of=thresholds.get)
    book.add("a", 900, 1200)
    thresholds["a"] = 2000.0  # the operator raised it: later samples are judged against the new one
    book.add("a", 900, 1200)
    book.add("b", 100, 100)
    a, b = book.summary("a"), book.summary("b")
    assert (a.count, a.missed, a.miss_ratio, a.threshold_ms) == (2, 1, 0.5, 2000.0)
    assert (b.count, b.missed, b.p90_abs_error_ms) == (1, 0, 0.0)
    assert book.models() == ["a", "b"]
    assert a.as_dict() == {"window_s": 60, "requests": 2, "missed": 1, "miss_ratio": 0.5, "p90_abs_error_ms": 300.0,
                           "threshold_ms": 2000.0, "p90_abs_error_share_of_threshold": 0.15}


@pytest.mark.parametrize("window_s, max_samples", [(0, 10), (-1, 10), (60, 0)])
def test_window_settings_are_checked(window_s, max_samples):
    with pytest.raises(ValueError, match="window_s="):
        CalibrationWindow(window_s, max_samples)


def test_figures_are_reused_for_refresh_s():
    clock = Clock(0.0)
    book = CalibrationBook(60, refresh_s=1.0, clock=clock, threshold_of=lambda m: 1000.0)
    book.add("m", 100, 100)
    assert book.summary("m").count == 1
    book.add("m", 100, 100)
    clock.t = 0.5
    assert book.summary("m").count == 1  # within a second of the last computation: the same figures
    clock.t = 1.0
    assert book.summary("m").count == 2
    assert CalibrationBook(60, refresh_s=0, clock=clock).summary("m") is None

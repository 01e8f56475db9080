"""How well the predicted local wait holds now: per model, over a rolling window of the requests kept local. Pure.

    book = CalibrationBook(threshold_of=lambda model: 2500.0)   # window_s: the last 10 minutes
    book.add("m", predicted_ms=800.0, realised_ms=950.0)         # each streamed request kept local: O(1) amortised
    book.summary("m")           # on read, at most once a second: a Calibration, or None (empty window)

A sample is one request kept local and answered with a stream: the wait predicted at admission, the wait it had
(arrival to first streamed token, measured at the gateway) and the model's overflow threshold at that time; a
local attempt that ended before its first token is not one. Over the samples of the last ``window_s`` seconds
(at most ``max_samples``, the newest), :func:`calibrate` gives:

* ``missed`` and ``miss_ratio``: how many, and what share, of the requests kept local waited longer than the
  threshold. Predictive overflow keeps a request local only when its predicted wait (plus the miss margin) is
  under the threshold, so each miss is one the estimate let through (or one no provider could take). Samples
  recorded without a threshold are left out of both; the ratio is None when no sample has one.
* ``p90_abs_error_ms``: the P90 of ``|realised - predicted|``, and ``p90_share_of_threshold``: it as a share of
  the newest sample's threshold (the target is <= 0.25).
* ``count``: the samples the figures rest on; a window without any gives no :class:`Calibration` at all (None),
  so an idle model never reads as well calibrated.

The figures are the ones ``lmfleet usage --estimate`` computes from the ledger's ``predicted_wait_ms`` and
``realised_wait_ms`` (:mod:`lmfleet.overflow.estimate_error`), over a rolling window instead of ``--since``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from lmfleet.overflow.estimate_error import percentile

__all__ = ["WINDOW_S", "Calibration", "CalibrationBook", "CalibrationWindow", "Sample", "calibrate"]

WINDOW_S = 600.0
"""The rolling window's length: 10 minutes, long enough for a P90 over a quiet model's traffic, short enough that
a drift shows within the alert's ``for:``."""
MAX_SAMPLES = 20_000
"""Samples kept per model, the newest: bounds the memory and the cost of a read (one sort) under heavy traffic."""
REFRESH_S = 1.0
"""A model's figures are computed at most this often (the /metrics page, /ready's gauge publishing and the
dashboard all read them): one second's requests barely move a 10-minute window."""


class Sample(NamedTuple):
    t: float
    """When the request's first token came (the book's clock, seconds)."""
    predicted_ms: float
    realised_ms: float
    threshold_ms: float | None
    """The model's overflow threshold then (None: not known to the book)."""


@dataclass(frozen=True)
class Calibration:
    """The wait estimate's figures over one model's window (module docstring)."""

    model: str
    window_s: float
    count: int
    missed: int | None
    """Samples whose realised wait exceeded their threshold (None: no sample has a threshold)."""
    miss_ratio: float | None
    p90_abs_error_ms: float
    threshold_ms: float | None
    """The newest sample's threshold."""
    p90_share_of_threshold: float | None

    def as_dict(self) -> dict[str, Any]:
        """The figures, rounded for the admin API and the dashboard."""
        return {"window_s": self.window_s, "requests": self.count, "missed": self.missed,
                "miss_ratio": None if self.miss_ratio is None else round(self.miss_ratio, 4),
                "p90_abs_error_ms": round(self.p90_abs_error_ms, 1), "threshold_ms": self.threshold_ms,
                "p90_abs_error_share_of_threshold": (None if self.p90_share_of_threshold is None
                                                     else round(self.p90_share_of_threshold, 3))}


def calibrate(model: str, samples: Sequence[Sample], window_s: float) -> Calibration | None:
    """The figures of ``samples`` (oldest first); None for no samples."""
    if not samples:
        return None
    judged = [s for s in samples if s.threshold_ms is not None]
    missed = sum(1 for s in judged if s.realised_ms > s.threshold_ms)  # type: ignore[operator]  # filtered above
    p90 = percentile([abs(s.realised_ms - s.predicted_ms) for s in samples], 90)
    threshold = samples[-1].threshold_ms
    return Calibration(model=model, window_s=window_s, count=len(samples),
                       missed=missed if judged else None, miss_ratio=missed / len(judged) if judged else None,
                       p90_abs_error_ms=p90, threshold_ms=threshold,
                       p90_share_of_threshold=p90 / threshold if threshold else None)


class CalibrationWindow:
    """One model's samples of the last ``window_s`` seconds, at most ``max_samples`` (the newest)."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES):
        if window_s <= 0 or max_samples < 1:
            raise ValueError(f"{window_s=} must be > 0 and {max_samples=} >= 1")
        self.window_s = window_s
        self._samples: deque[Sample] = deque(maxlen=max_samples)

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)
        self.expire(sample.t)

    def expire(self, now: float) -> None:
        """Forget the samples older than the window; each sample is dropped once, so adding stays O(1) amortised."""
        s = self._samples
        while s and s[0].t < now - self.window_s:
            s.popleft()

    def samples(self, now: float) -> list[Sample]:
        self.expire(now)
        return list(self._samples)


class CalibrationBook:
    """Per model, a :class:`CalibrationWindow`; ``threshold_of(model)`` gives each sample its threshold (None:
    unknown), ``clock`` its time (monotonic seconds); a model's figures are reused for ``refresh_s``."""

    def __init__(self, window_s: float = WINDOW_S, *, max_samples: int = MAX_SAMPLES, refresh_s: float = REFRESH_S,
                 threshold_of: Callable[[str], float | None] = lambda model: None,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.max_samples = max_samples
        self.refresh_s = refresh_s
        self.threshold_of = threshold_of
        self.clock = clock
        self._windows: dict[str, CalibrationWindow] = {}
        self._figures: dict[str, tuple[float, Calibration | None]] = {}

    def add(self, model: str, predicted_ms: float, realised_ms: float) -> None:
        """One request kept local whose first token has just come (``model``: a served model's name)."""
        w = self._windows.get(model)
        if w is None:
            w = self._windows[model] = CalibrationWindow(self.window_s, self.max_samples)
        w.add(Sample(self.clock(), predicted_ms, realised_ms, self.threshold_of(model)))

    def summary(self, model: str) -> Calibration | None:
        """``model``'s figures now (or up to ``refresh_s`` ago); None when its window holds no sample."""
        w = self._windows.get(model)
        if w is None:
            return None
        now = self.clock()
        last = self._figures.get(model)
        if last is not None and 0 <= now - last[0] < self.refresh_s:
            return last[1]
        c = calibrate(model, w.samples(now), self.window_s)
        self._figures[model] = (now, c)
        return c

    def models(self) -> list[str]:
        """The models that have had a sample since the gateway started."""
        return sorted(self._windows)

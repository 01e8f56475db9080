"""How wrong the predicted local wait was: error statistics per model. Pure.

For each request kept local the gateway knows what it predicted (``estimate_wait_ms`` at admission) and what
happened: the request's queue time to first token (arrival to first streamed token, measured at the gateway). The
ledger keeps both (``predicted_wait_ms``, ``realised_wait_ms``; :func:`samples_from_rows` reads them back). From
those pairs, per model:

* ``median_abs_error_ms`` and ``p90_abs_error_ms``: of ``|actual - predicted|``;
* ``bias_ms``: the median signed error ``actual - predicted`` (positive: the estimate was too low, requests
  waited longer than predicted, so the route kept local requests it should have spilled);
* ``median_ratio``: the median of ``actual / predicted`` (1.0 is unbiased; predictions of 0 are left out);
* ``missed``, given the model's overflow threshold: the requests kept local whose actual wait exceeded it (the
  misses predictive overflow exists to prevent).

Percentiles interpolate linearly between order statistics (numpy's default), so the figures match the
benchmark reports'.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EstimateError", "EstimateSample", "estimate_error", "estimate_errors", "percentile", "samples_from_rows"]


@dataclass(frozen=True)
class EstimateSample:
    """One request kept local: its model, the wait predicted for it and the one it had (milliseconds)."""

    model: str
    predicted_ms: float
    actual_ms: float


@dataclass(frozen=True)
class EstimateError:
    model: str
    count: int
    median_abs_error_ms: float
    p90_abs_error_ms: float
    bias_ms: float
    """Median of ``actual - predicted``: positive when requests waited longer than predicted."""
    median_ratio: float | None
    """Median of ``actual / predicted`` over predictions above 0; None when there is none."""
    missed: int | None = None
    """Requests whose actual wait exceeded the overflow threshold; None when no threshold was given."""

    def as_dict(self, threshold_ms: float | None = None) -> dict[str, Any]:
        """The figures, rounded for reports; with ``threshold_ms`` (the model's overflow threshold) also the
        absolute errors as a percentage of it (``None`` without one); ``missed_pct``: the share of the requests
        that waited past the threshold, in percent (``None`` when ``missed`` is)."""
        def pct(ms: float) -> float | None:
            return round(100 * ms / threshold_ms, 1) if threshold_ms else None

        return {"model": self.model, "requests": self.count,
                "median_abs_error_ms": round(self.median_abs_error_ms, 1),
                "p90_abs_error_ms": round(self.p90_abs_error_ms, 1),
                "median_abs_error_pct_of_threshold": pct(self.median_abs_error_ms),
                "p90_abs_error_pct_of_threshold": pct(self.p90_abs_error_ms),
                "bias_ms": round(self.bias_ms, 1),
                "median_actual_over_predicted": None if self.median_ratio is None else round(self.median_ratio, 3),
                "threshold_ms": threshold_ms, "missed": self.missed,
                "missed_pct": None if self.missed is None else round(100 * self.missed / self.count, 2)}


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by linear interpolation; ``nan`` for no values."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"{p=} must be within [0, 100]")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def estimate_error(model: str, pairs: Sequence[tuple[float, float]],
                   threshold_ms: float | None = None) -> EstimateError:
    """Statistics of ``(predicted_ms, actual_ms)`` pairs of one model (module docstring); ``missed`` needs the
    model's ``threshold_ms``."""
    if not pairs:
        raise ValueError(f"model {model!r}: no (predicted, actual) pairs to measure")
    signed = [actual - predicted for predicted, actual in pairs]
    ratios = [actual / predicted for predicted, actual in pairs if predicted > 0]
    return EstimateError(
        model=model,
        count=len(pairs),
        median_abs_error_ms=percentile([abs(e) for e in signed], 50),
        p90_abs_error_ms=percentile([abs(e) for e in signed], 90),
        bias_ms=percentile(signed, 50),
        median_ratio=percentile(ratios, 50) if ratios else None,
        missed=None if threshold_ms is None else sum(1 for _, actual in pairs if actual > threshold_ms),
    )


def estimate_errors(samples: Iterable[EstimateSample],
                    thresholds: Mapping[str, float] | None = None) -> list[EstimateError]:
    """One :class:`EstimateError` per model that has samples, by model name; ``thresholds``: each model's
    overflow threshold, for ``missed``."""
    by_model: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in samples:
        by_model[s.model].append((s.predicted_ms, s.actual_ms))
    thresholds = thresholds or {}
    return [estimate_error(m, pairs, thresholds.get(m)) for m, pairs in sorted(by_model.items())]


def samples_from_rows(rows: Iterable[Mapping[str, Any]]) -> list[EstimateSample]:
    """The ledger rows (``Ledger.rows()``) that carry both a predicted and a realised wait, as samples.

    Rows without them are left out: requests sent to a provider, written before the columns existed, answered
    without a stream (no first token the gateway could time), or ended before their first token.
    """
    out = []
    for r in rows:
        predicted, realised = r.get("predicted_wait_ms"), r.get("realised_wait_ms")
        if predicted is not None and realised is not None:
            out.append(EstimateSample(str(r["model"]), float(predicted), float(realised)))
    return out

"""How wrong the predicted local wait was: error statistics per model. Pure.

For each request kept local the gateway knows what it predicted (``estimate_wait_ms`` at admission) and what
happened: the request's queue time to first token (dispatch to first token, measured at the gateway). From
those pairs, per model:

* ``median_abs_error_ms`` and ``p90_abs_error_ms``: of ``|actual - predicted|``;
* ``bias_ms``: the median signed error ``actual - predicted`` (positive: the estimate was too low, requests
  waited longer than predicted, so the route kept local requests it should have spilled);
* ``median_ratio``: the median of ``actual / predicted`` (1.0 is unbiased; predictions of 0 are left out).

Percentiles interpolate linearly between order statistics (numpy's default), so the figures match the
benchmark reports'.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["EstimateError", "EstimateSample", "estimate_error", "estimate_errors", "percentile"]


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

    def p90_share_of(self, threshold_ms: float) -> float:
        """The P90 absolute error as a share of the overflow threshold (the issue's target: <= 0.25)."""
        return self.p90_abs_error_ms / threshold_ms


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


def estimate_error(model: str, pairs: Sequence[tuple[float, float]]) -> EstimateError:
    """Statistics of ``(predicted_ms, actual_ms)`` pairs of one model (module docstring)."""
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
    )


def estimate_errors(samples: Iterable[EstimateSample]) -> list[EstimateError]:
    """One :class:`EstimateError` per model that has samples, by model name."""
    by_model: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in samples:
        by_model[s.model].append((s.predicted_ms, s.actual_ms))
    return [estimate_error(m, pairs) for m, pairs in sorted(by_model.items())]

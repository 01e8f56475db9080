"""The median-regression line the gateway fits through (prompt tokens, seconds) samples: the prefill line (a
request's TTFT by the prefill work it waited for) and the prefill gate's service line (a gated prompt's time from
the gate to its first token), :mod:`lmfleet.overflow.signals`. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

__all__ = ["PREFILL_MIN_PAIRS", "PREFILL_MIN_SPREAD", "PrefillLine", "prefill_line", "prefill_slope"]

PREFILL_MIN_SPREAD = 256
"""Tokens of prefill work two samples must differ by for their slope to count (closer pairs are noise)."""
PREFILL_MIN_PAIRS = 3
"""Pairs that must count before the prefill line has a slope (fewer: the samples' median TTFT, no slope)."""


def prefill_slope(samples: list[tuple[float, float]], min_spread: float = PREFILL_MIN_SPREAD,
                  min_pairs: int = PREFILL_MIN_PAIRS) -> float | None:
    """Theil-Sen slope of ``(prefill_tokens, ttft_s)`` samples: the median of the pairwise slopes of pairs at least
    ``min_spread`` tokens apart, clamped at 0; None with fewer than ``min_pairs`` such pairs. Pure; O(n^2)."""
    slopes = [(yj - yi) / (xj - xi) for i, (xi, yi) in enumerate(samples) for xj, yj in samples[i + 1:]
              if abs(xj - xi) >= min_spread]
    if len(slopes) < min_pairs:
        return None
    return max(0.0, median(slopes))


@dataclass(frozen=True)
class PrefillLine:
    """``ttft = base_ttft_s + slope x (work - base_work)``, from :func:`prefill_line`."""

    base_ttft_s: float
    base_work: float
    slope: float | None
    """Seconds per token of prefill work; None: too little spread in work to measure one."""


def prefill_line(samples: list[tuple[float, float]], min_spread: float = PREFILL_MIN_SPREAD,
                 min_pairs: int = PREFILL_MIN_PAIRS, iterations: int = 30) -> PrefillLine | None:
    """The least-absolute-deviations line through ``(prefill_tokens, ttft_s)`` samples, anchored at their median
    work (module docstring): by iteratively reweighted least squares from the Theil-Sen line. No slope (None) and
    the median TTFT while fewer than ``min_pairs`` pairs lie ``min_spread`` tokens apart; a negative slope is
    clamped at 0 (the median TTFT again); None without samples. Pure; O(n^2) for the pairs."""
    if not samples:
        return None
    x0 = median(x for x, _ in samples)
    y0 = median(y for _, y in samples)
    k = prefill_slope(samples, min_spread, min_pairs)
    if not k:
        return PrefillLine(y0, x0, k)
    u = [x - x0 for x, _ in samples]
    y = [v for _, v in samples]
    a = median(yi - k * ui for ui, yi in zip(u, y))
    eps = 1e-6 * max(1e-3, y0)
    for _ in range(iterations):
        sw = swu = swuu = swy = swuy = 0.0
        for ui, yi in zip(u, y):
            w = 1.0 / max(abs(yi - a - k * ui), eps)
            sw += w
            swu += w * ui
            swuu += w * ui * ui
            swy += w * yi
            swuy += w * ui * yi
        det = sw * swuu - swu * swu
        if det <= 0:
            break
        a_new, k_new = (swuu * swy - swu * swuy) / det, (sw * swuy - swu * swy) / det
        done = abs(a_new - a) <= 1e-6 * max(abs(a), 1e-3) and abs(k_new - k) <= 1e-6 * max(abs(k), 1e-9)
        a, k = a_new, k_new
        if done:
            break
    if k <= 0:
        return PrefillLine(y0, x0, 0.0)
    return PrefillLine(max(0.0, a), x0, k)

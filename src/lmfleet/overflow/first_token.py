"""Time to first token once a request has a slot: a small linear model fitted on recent requests. Pure.

A request that did not queue still waits for prefill: its own prompt's and that of the requests ahead of it that
have not produced their first token yet (vLLM schedules prefills first come, first served), each engine step
shared with the decodes of the sequences already generating. So its TTFT grows with the prompt tokens to prefill
up to and including its own, and with the number of requests decoding beside it::

    ttft = base_s + per_prefill_token_s * prefill_tokens + per_decoding_s * decoding

One median over every unqueued request (what the estimate used before) is too high for a request on an idle
engine, too low for one that starts on a full engine after queueing, and gives a 3000-token prompt the TTFT of
the chat turns around it. Counting the requests ahead by their prompt tokens still to prefill, apart from those
already decoding, keeps a burst (many prompts prefilling at once, each waiting for the others') from teaching
the model that joining a running batch is slow.

The fit is ordinary least squares over the samples, with two guards: a slope that comes out negative (noise) is
dropped and the other regressor fitted alone -- more to prefill or a busier engine never predicts a shorter wait;
a regressor that did not vary is left out -- and with fewer than ``min_samples`` samples there is no model (the
caller falls back to the median TTFT). The fit reads only sums (:class:`Moments`), so it is O(1) per sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FirstTokenModel", "FirstTokenSample", "Moments", "fit_first_token"]


@dataclass(frozen=True)
class FirstTokenSample:
    """One request that found a free slot: the prompt tokens to prefill up to its own (its own included), the
    requests decoding when it started, its TTFT."""

    prefill_tokens: int
    decoding: int
    ttft_s: float


@dataclass(frozen=True)
class FirstTokenModel:
    base_s: float
    per_prefill_token_s: float
    per_decoding_s: float
    typical_prefill_tokens: float
    """The mean ``prefill_tokens`` of the fitted samples: assumed when a prediction is asked without a prompt."""

    def predict_s(self, prefill_tokens: int | None, decoding: int) -> float:
        """Seconds to the first token of a request with ``prefill_tokens`` to prefill up to its own (None: a
        typical figure) beside ``decoding`` requests generating."""
        p = self.typical_prefill_tokens if prefill_tokens is None else prefill_tokens
        return max(0.0, self.base_s + self.per_prefill_token_s * p + self.per_decoding_s * max(0, decoding))


@dataclass(frozen=True)
class Moments:
    """The sums a least-squares fit needs, so that adding or removing a sample costs O(1) (the gateway refits on
    every first token). ``x``: prefill tokens, ``k``: requests decoding, ``y``: TTFT seconds."""

    n: int = 0
    x: float = 0.0
    k: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    kk: float = 0.0
    xk: float = 0.0
    xy: float = 0.0
    ky: float = 0.0

    def add(self, s: FirstTokenSample, sign: int = 1) -> "Moments":
        x, k, y = float(s.prefill_tokens), float(max(0, s.decoding)), s.ttft_s
        return Moments(self.n + sign, self.x + sign * x, self.k + sign * k, self.y + sign * y,
                       self.xx + sign * x * x, self.kk + sign * k * k, self.xk + sign * x * k,
                       self.xy + sign * x * y, self.ky + sign * k * y)

    @classmethod
    def of(cls, samples: Iterable[FirstTokenSample]) -> "Moments":
        m = cls()
        for s in samples:
            m = m.add(s)
        return m


def fit_first_token(samples: Iterable[FirstTokenSample] | Moments, min_samples: int = 8) -> FirstTokenModel | None:
    """The model of the module docstring fitted on ``samples`` (or their :class:`Moments`); None with fewer than
    ``min_samples``."""
    m = samples if isinstance(samples, Moments) else Moments.of(samples)
    n = m.n
    if n < max(1, min_samples):
        return None
    mx, mk, my = m.x / n, m.k / n, m.y / n
    # centred (co)variances; a regressor that did not vary (relative to its scale) cannot be fitted
    sxx, skk, sxk = m.xx - n * mx * mx, m.kk - n * mk * mk, m.xk - n * mx * mk
    sxy, sky = m.xy - n * mx * my, m.ky - n * mk * my
    use_x = sxx > 1e-9 * max(1.0, m.xx)
    use_k = skk > 1e-9 * max(1.0, m.kk)
    bx = bk = 0.0
    if use_x and use_k:
        det = sxx * skk - sxk * sxk
        if det > 1e-9 * sxx * skk:
            bx, bk = (sxy * skk - sky * sxk) / det, (sky * sxx - sxy * sxk) / det
        if det <= 1e-9 * sxx * skk or bx < 0 or bk < 0:  # collinear, or a slope the wrong way: one regressor
            only_x, only_k = max(0.0, sxy / sxx), max(0.0, sky / skk)
            # keep the one that explains more of the variance
            bx, bk = (only_x, 0.0) if only_x * sxy >= only_k * sky else (0.0, only_k)
    elif use_x:
        bx = max(0.0, sxy / sxx)
    elif use_k:
        bk = max(0.0, sky / skk)
    return FirstTokenModel(my - bx * mx - bk * mk, bx, bk, mx)

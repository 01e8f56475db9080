"""The miss margin: how much longer than predicted the recent requests near the threshold waited.

The wait estimate (:mod:`lmfleet.overflow.estimator`) is a mean: a request that finds one or two requests queued
ahead of it is predicted to wait ``ahead / drain_rate``, but whether a slot frees in 0.2 s or in 3 s depends on
which running request finishes next, and on a few CPU or GPU cores a burst of prefills slows everyone down. A
request predicted at 1.7 s against a 2.5 s threshold is kept local, and a fair share of such requests then wait
3-4 s. The route therefore compares ``estimate + margin`` with the threshold, where the margin is learned from
what happened to the requests it kept local::

    errors = [realised - predicted for the recent local requests predicted within BAND x threshold]
    margin = clamp(quantile(errors, q), FLOOR x threshold, CAP x threshold)   once MIN_SAMPLES of them are in
    margin = PRIOR x CAP x threshold                                          until then

Only requests whose estimate was near the threshold count (an idle engine's requests, predicted at the prefill
time, say nothing about the queued ones; a request predicted far above it, kept local by a forced mode, says
little about the decision at the threshold), and only recent ones (``WINDOW_S``), so the margin follows the load
and an old burst does not keep spilling requests. The samples describe the estimate against this engine, not the
policy: they carry over when an operator switches the policy or mode, and the band is applied against the
threshold in force when the margin is asked for, so a new threshold uses the samples near it. A local request
cancelled before its first token (a hedge won, or the client left) counts with the time it had waited when
cancelled: a lower bound of its wait.
The margin is added only to estimates in the band it is learned on (``BAND[0] x threshold`` or more,
:func:`applied_margin_ms`): a request that would find a free slot, or an idle engine's, is predicted at the prefill
time and stays local on its own estimate, so new samples keep coming in even after a burst has pushed the margin
up (were it added to every estimate, a margin near the hysteresis bar would spill every request, and with none
kept local it could not learn that the burst had passed). It is capped at ``CAP x threshold``.

Until ``MIN_SAMPLES`` near-threshold requests were seen in the window (the first burst after a quiet spell, a new
gateway), the margin is a prior, ``PRIOR x CAP x threshold`` (0.3 x threshold): the first near-threshold requests
of a burst are the ones the samples have not seen yet, and with no margin they were the policy's misses on the
overflow benchmark (predicted at 0.74-0.98 x threshold, waited 1.2-1.6 x threshold). The prior spills a little more
at the start of a burst (a request predicted at 0.7 x threshold or more goes to the provider); once the samples are
in, they decide. A request to an idle engine (nothing in flight) gets no prior: it waits for no one, and it is what
keeps local samples coming (were every request spilled on the prior, the engine would go idle and the next one
would stay local), also on a new gateway whose cold estimate is near a low threshold. Once the engine's prefill line
is measured (``measured``: :attr:`~lmfleet.overflow.signals.QueueSignals.line_measured`), an idle engine gets the
floor instead: its estimate is the line's value for the prompt, and a long prompt predicted just under the threshold
often misses it (34 replays: 6 of the 8 idle requests within the floor of the threshold missed it), while short
prompts, predicted far below, keep the samples coming; a stale line gets nothing, so one request goes local and
measures it again.

``FLOOR`` is ``overflow.miss_floor`` (0.15 by default). The samples mix requests predicted near half the
threshold, which are many and rarely far off, with those predicted just under it, which are few and late more
often: on twelve replays with the prefill gate on (docs/benchmarks.md, the miss floor), the local requests
predicted at 0.8-1.0 x threshold waited a median 116 ms longer than predicted and 10 of 43 missed the threshold,
while the learned margin at those misses was 0-342 ms. The floor sends a request predicted within
``FLOOR x threshold`` of the threshold to a provider even when the samples say the estimate has been right.

``q`` is ``overflow.miss_quantile``: 0.9 keeps about one in ten of these near-threshold requests missing the
threshold by more than the margin; higher spends more on providers for fewer misses. The estimate itself (the
``x-lmfleet-queue-estimate-ms`` header, the ledger's ``predicted_wait_ms``) is unchanged: the margin moves the
decision, not the prediction.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from lmfleet.overflow.estimate_error import percentile
from lmfleet.overflow.signals import QueueSignals

__all__ = ["BAND", "CAP", "FLOOR", "MIN_SAMPLES", "PRIOR", "WINDOW_S", "MissMargin", "applied_margin_ms",
           "check_floor", "miss_margin_ms"]

BAND = (0.5, 1.5)
"""Requests predicted within these shares of the threshold inform the margin."""
CAP = 0.5
"""The margin is at most this share of the threshold."""
FLOOR = 0.15
"""The learned margin is at least this share of the threshold (``overflow.miss_floor``'s default)."""
MIN_SAMPLES = 8
"""The learned margin needs this many near-threshold requests in the window; until then the prior applies."""
PRIOR = 0.6
"""The margin before ``MIN_SAMPLES`` are in, as a share of the cap (0.6 x CAP = 0.3 x threshold)."""
WINDOW_S = 120.0
"""Samples older than this (seconds) are dropped."""
MAX_SAMPLES = 64


def miss_margin_ms(errors: Sequence[float], quantile: float | None, cap_ms: float,
                   min_samples: int = MIN_SAMPLES, idle: bool = False, floor_ms: float = 0.0,
                   measured: bool = False) -> float:
    """The margin (ms) from the recent ``realised - predicted`` errors (module docstring). Pure.

    0 with ``quantile`` None (no margin); with fewer than ``min_samples`` errors the prior, ``PRIOR x cap_ms``,
    except when ``idle`` (nothing in flight locally): then ``floor_ms`` where the estimate comes from a
    ``measured`` prefill line, else 0; with enough errors their ``quantile`` (0-1, linear interpolation), at
    least ``floor_ms`` (and 0) and at most ``cap_ms``.
    """
    if quantile is None:
        return 0.0
    cap_ms = max(0.0, cap_ms)
    if len(errors) < min_samples:
        if idle:
            return min(max(0.0, floor_ms), cap_ms) if measured else 0.0
        return PRIOR * cap_ms
    return min(max(0.0, floor_ms, percentile(errors, 100.0 * quantile)), cap_ms)


def applied_margin_ms(estimate_ms: float, margin_ms: float, threshold_ms: float) -> float:
    """What the route adds to ``estimate_ms``: the learned margin for an estimate in its band (at least
    ``BAND[0] x threshold_ms``), else 0 (module docstring). Pure."""
    return margin_ms if estimate_ms >= BAND[0] * threshold_ms else 0.0


class MissMargin:
    """The recent near-threshold errors of one model's estimate, and the margin they give (module docstring)."""

    def __init__(self, quantile: float | None = 0.9, floor: float = FLOOR, window_s: float = WINDOW_S,
                 max_samples: int = MAX_SAMPLES):
        if quantile is not None and not 0 < quantile < 1:
            raise ValueError(f"quantile={quantile} must be within (0, 1), or None for no margin")
        self.quantile = quantile
        self.floor = check_floor(floor)
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=max_samples)

    def observe(self, predicted_ms: float, realised_ms: float, threshold_ms: float, now: float | None = None) -> None:
        """One local request's predicted and realised wait before its first token (or, cancelled before it, the
        time it had waited). Kept only when it was predicted near ``threshold_ms`` (the one in force)."""
        if self.quantile is None or not _near(predicted_ms, threshold_ms):
            return
        self._samples.append((time.monotonic() if now is None else now, predicted_ms, realised_ms - predicted_ms))

    def margin_ms(self, threshold_ms: float, now: float | None = None, idle: bool = False,
                  measured: bool = False) -> float:
        """The margin to add to the estimate before it is compared with ``threshold_ms``; ``idle``: nothing is in
        flight locally (no prior); ``measured``: the estimate comes from a measured prefill line
        (:attr:`~lmfleet.overflow.signals.QueueSignals.line_measured`), so an idle engine gets the floor."""
        if self.quantile is None:
            return 0.0
        horizon = (time.monotonic() if now is None else now) - self.window_s
        s = self._samples
        while s and s[0][0] < horizon:
            s.popleft()
        return miss_margin_ms([e for _, p, e in s if _near(p, threshold_ms)], self.quantile, CAP * threshold_ms,
                              idle=idle, floor_ms=self.floor * threshold_ms, measured=measured)

    def margin_for(self, threshold_ms: float, signals: QueueSignals) -> float:
        """:meth:`margin_ms` for the model's load now: idle when nothing is in flight, the floor there once the
        prefill line is measured."""
        return self.margin_ms(threshold_ms, idle=signals.in_flight == 0, measured=signals.line_measured)

    def __len__(self) -> int:
        """Samples held (some may be older than the window until the next :meth:`margin_ms`)."""
        return len(self._samples)


def check_floor(floor: float) -> float:
    """``floor`` as a share of the threshold, within 0 to ``CAP``; ValueError otherwise."""
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor <= CAP:
        raise ValueError(f"miss_floor must be a number from 0 to {CAP} (a share of threshold_ms), got {floor!r}")
    return float(floor)


def _near(predicted_ms: float, threshold_ms: float) -> bool:
    return BAND[0] * threshold_ms <= predicted_ms <= BAND[1] * threshold_ms

"""Wait estimators as candidates of one prediction problem: fitted on recorded requests, compared on held-out ones.

A row is one request the local engines answered, as the ledger keeps it (``/admin/usage?estimate=1&features=1``,
:func:`lmfleet.overflow.admission.admission_rows`): ``admission`` (what the gateway knew when it predicted the wait,
:mod:`lmfleet.overflow.admission`) and ``realised_wait_ms`` (arrival to first token). A candidate is a pair of pure
functions::

    params = candidate.fit(rows)            # a dict of numbers, from the training rows (JSON-able)
    ms = candidate.predict(params, row)     # the wait the route would compare with the threshold

The route keeps a request local when the prediction is below the threshold, so a candidate that predicts a high
quantile of the wait (P90) misses the threshold less often than one that predicts its median, and spills more.
The candidates (:data:`CANDIDATES`):

* ``shipped``: the estimate as recorded (:func:`lmfleet.overflow.estimator.estimate_wait_ms`), nothing fitted.
* ``shipped+margin``: the estimate plus the miss margin the route applied (the live decision), nothing fitted.
* ``shipped+static``: the estimate plus one margin fitted on the training rows: the ``MARGIN_Q`` quantile of
  ``realised - estimate`` over the rows predicted within the margin's band (``lmfleet.overflow.margin.BAND``),
  added in that band only, as the live margin is.
* ``scaled``: the estimate times the training rows' median ``realised / estimate`` (a multiplicative correction).
* ``ratio-p90``: the estimate times the P90 of ``realised / estimate`` in the row's load bin (requests in flight per
  slot, :data:`LOAD_BINS`); a bin with fewer than ``MIN_BIN`` training rows uses all of them.
* ``linear-p50`` / ``linear-p90``: a linear quantile regression of the realised wait on :func:`features` (the
  estimate, its queue term, the load, the prefill work ahead, the prompt, the engine's waiting count), solved by
  iteratively reweighted least squares with numpy; the prediction is at least 0.

Rows are only the requests that were kept local (a spilled request has no local wait to learn from), so a replay
with overflow forced off (``local only``) gives the least biased sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmfleet.overflow.admission import Admission, parse_admission
from lmfleet.overflow.estimate_error import percentile
from lmfleet.overflow.estimator import queue_position
from lmfleet.overflow.margin import BAND

__all__ = ["CANDIDATES", "LOAD_BINS", "MARGIN_Q", "MIN_BIN", "Candidate", "admission_of", "features",
           "quantile_regression"]

Row = Mapping[str, Any]
Params = dict[str, Any]

MARGIN_Q = 0.9
"""The quantile of ``realised - estimate`` that ``shipped+static`` adds (the live margin's default quantile)."""
LOAD_BINS = (0.5, 1.0, 1.5, 2.0, 3.0)
"""Upper edges of the load bins (requests in flight per slot) of ``ratio-p90``; above the last: one more bin."""
MIN_BIN = 10
"""Training rows a load bin needs before ``ratio-p90`` uses its own quantile."""
FEATURES = ("1", "estimate_ms", "queue_ms", "load", "pending_prefill_ktok", "prompt_ktok", "engine_waiting")
"""The columns of :func:`features`, in order."""


@dataclass(frozen=True)
class Candidate:
    """One wait estimator: ``fit(rows) -> params``, ``predict(params, row) -> ms`` (module docstring)."""

    name: str
    describe: str
    fit: Callable[[Sequence[Row]], Params]
    predict: Callable[[Params, Row], float]


def admission_of(row: Row) -> Admission:
    """The row's :class:`Admission` (parsed once and cached in the row when it is a dict)."""
    a = row["admission"]
    if isinstance(a, Admission):
        return a
    parsed = parse_admission(a)
    if isinstance(row, dict):
        row["admission"] = parsed
    return parsed


def _estimate(row: Row) -> float:
    return float(admission_of(row).estimate_ms)


def _realised(row: Row) -> float:
    return float(row["realised_wait_ms"])


def _load(a: Admission) -> float:
    return a.signals.in_flight / max(1, a.capacity)


def features(row: Row) -> list[float]:
    """The row's regressors (:data:`FEATURES`): 1, the estimate (ms), its queue term (ms: requests ahead of a free
    slot over the drain rate, as :func:`~lmfleet.overflow.estimator.estimate_wait_ms` counts them; 0 without a
    measured rate), in-flight per slot, prompt tokens awaiting prefill and the request's prompt (thousands), and the
    engine's waiting count (0 unknown)."""
    a = admission_of(row)
    s = a.signals
    _, ahead = queue_position(s, a.capacity)
    queue_ms = 1000.0 * max(0, ahead) / s.drain_rps if s.drain_rps else 0.0
    return [1.0, a.estimate_ms, queue_ms, _load(a), s.pending_prefill_tokens / 1000, a.prompt_tokens / 1000,
            float(s.engine_waiting or 0)]


def quantile_regression(x: Sequence[Sequence[float]], y: Sequence[float], q: float, *, iterations: int = 60,
                        ridge: float = 1e-6) -> list[float]:
    """Coefficients ``b`` minimising the pinball loss of ``y ~ x @ b`` at quantile ``q`` (0-1), by iteratively
    reweighted least squares (each residual weighted by ``q`` or ``1 - q`` over its size); columns are scaled to
    unit size first and a small ``ridge`` keeps collinear ones solvable. Pure."""
    import numpy as np  # deferred: the gateway imports this package, numpy is needed only to fit

    if not 0 < q < 1:
        raise ValueError(f"{q=} must be within (0, 1)")
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xa.ndim != 2 or len(xa) != len(ya) or len(ya) == 0:
        raise ValueError(f"x {xa.shape} and y {ya.shape}: expected (n, k) and (n,) with n > 0")
    scale = np.maximum(np.abs(xa).max(axis=0), 1e-12)
    xs = xa / scale
    reg = ridge * np.eye(xs.shape[1])
    b = np.linalg.lstsq(xs, ya, rcond=None)[0]
    eps = max(1e-6, 1e-6 * float(np.abs(ya).mean()))
    for _ in range(iterations):
        r = ya - xs @ b
        w = np.where(r >= 0, q, 1 - q) / np.maximum(np.abs(r), eps)
        xw = xs * w[:, None]
        b_new = np.linalg.solve(xs.T @ xw + reg * float(w.mean()), xw.T @ ya)
        if np.allclose(b_new, b, rtol=1e-7, atol=1e-9):
            b = b_new
            break
        b = b_new
    return [float(v) for v in b / scale]


def _none(_rows: Sequence[Row]) -> Params:
    return {}


def _fit_static(rows: Sequence[Row]) -> Params:
    errs = [_realised(r) - _estimate(r) for r in rows
            if BAND[0] * admission_of(r).threshold_ms <= _estimate(r) <= BAND[1] * admission_of(r).threshold_ms]
    return {"margin_ms": max(0.0, percentile(errs, 100 * MARGIN_Q)) if errs else 0.0}


def _predict_static(p: Params, row: Row) -> float:
    est = _estimate(row)
    return est + (p["margin_ms"] if est >= BAND[0] * admission_of(row).threshold_ms else 0.0)


def _fit_scaled(rows: Sequence[Row]) -> Params:
    ratios = [_realised(r) / _estimate(r) for r in rows if _estimate(r) > 0]
    return {"k": percentile(ratios, 50) if ratios else 1.0}


def _bin(row: Row) -> int:
    load = _load(admission_of(row))
    return next((i for i, edge in enumerate(LOAD_BINS) if load < edge), len(LOAD_BINS))


def _fit_ratio(rows: Sequence[Row], q: float = 0.9) -> Params:
    by: list[list[float]] = [[] for _ in range(len(LOAD_BINS) + 1)]
    for r in rows:
        if _estimate(r) > 0:
            by[_bin(r)].append(_realised(r) / _estimate(r))
    every = [v for b in by for v in b]
    overall = percentile(every, 100 * q) if every else 1.0
    return {"k": [percentile(b, 100 * q) if len(b) >= MIN_BIN else overall for b in by]}


def _fit_linear(q: float) -> Callable[[Sequence[Row]], Params]:
    def fit(rows: Sequence[Row]) -> Params:
        return {"coef": quantile_regression([features(r) for r in rows], [_realised(r) for r in rows], q)}
    return fit


def _predict_linear(p: Params, row: Row) -> float:
    v = sum(c * f for c, f in zip(p["coef"], features(row)))
    return max(0.0, v) if math.isfinite(v) else _estimate(row)


CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("shipped", "the estimate as recorded", _none, lambda p, r: _estimate(r)),
    Candidate("shipped+margin", "the estimate plus the margin the route applied (live)", _none,
              lambda p, r: _estimate(r) + float(admission_of(r).applied_margin_ms)),
    Candidate("shipped+static", f"the estimate plus a fitted P{MARGIN_Q * 100:.0f} margin in the band", _fit_static,
              _predict_static),
    Candidate("scaled", "the estimate times the median realised/estimate", _fit_scaled,
              lambda p, r: p["k"] * _estimate(r)),
    Candidate("ratio-p90", "the estimate times the P90 realised/estimate of its load bin", _fit_ratio,
              lambda p, r: p["k"][_bin(r)] * _estimate(r)),
    Candidate("linear-p50", "linear median regression on the admission features", _fit_linear(0.5), _predict_linear),
    Candidate("linear-p90", "linear P90 regression on the admission features", _fit_linear(0.9), _predict_linear),
)}
"""Every candidate by name (module docstring), the shipped estimator first."""

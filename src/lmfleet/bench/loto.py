"""Leave-one-trace-out comparison of wait estimators (``benchmarks/estimator_loto.py``). Pure but for reading files.

The dataset: one row per request the local engines answered during a replay (``bench_overflow_policies.py
--dataset-out``, :func:`dataset_rows`): the trace or shape it came from, the policy and round, the ledger's
``predicted_wait_ms`` / ``realised_wait_ms`` and the ``admission`` record (:mod:`lmfleet.overflow.admission`).

For each trace held out, every candidate (:data:`lmfleet.overflow.estimators.CANDIDATES`) is fitted on the rows of
the other traces and judged on the held-out one (:func:`evaluate`):

* ``p90_abs_error_ms`` (and ``_pct`` of the threshold): the P90 of ``|realised - predicted|``, and
  ``kept_p90_abs_error_pct`` the same over the requests it would have kept local (the issue's target: <= 25 %);
* ``missed_share``: of the requests it would have kept local (prediction below the threshold), the share whose
  realised wait passed the threshold (the SLO misses it would have caused);
* ``needless_share``: of those it would have spilled, the share that would have met the threshold locally (spend
  it would have wasted).

The same candidates fitted on every trace and judged on each (``tuned on all``) show how much of a candidate's
figure is fitting the trace it is judged on. Only rows with a realised wait count (a request that ended before
its first token has none).
"""

from __future__ import annotations

import gzip
import json
import math
import random
from bisect import insort
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lmfleet.overflow.admission import Admission
from lmfleet.overflow.estimate_error import percentile
from lmfleet.overflow.estimator import estimate_wait_ms
from lmfleet.overflow.estimators import CANDIDATES, Candidate, admission_of
from lmfleet.overflow.margin import CAP, PRIOR, applied_margin_ms
from lmfleet.overflow.signals import (PREFILL_MIN_PAIRS, PREFILL_MIN_SPREAD, PREFILL_SAMPLES, PREFILL_TTL_S,
                                      QueueSignals, line_is_stale, prefill_line, prefill_slope)

__all__ = ["ALL", "LINES", "Score", "append_rows", "dataset_rows", "evaluate", "loto", "read_datasets",
           "scores_json", "synthetic_dataset", "table", "with_prefill_line", "worst"]

ALL = "tuned on all"
"""The ``fitted_on`` of the in-sample comparison (every trace, the held-out one included)."""


@dataclass(frozen=True)
class Score:
    """One candidate judged on one trace's rows (module docstring)."""

    candidate: str
    trace: str
    fitted_on: str
    """``others`` (leave-one-trace-out) or :data:`ALL`."""
    requests: int
    p90_abs_error_ms: float
    p90_abs_error_pct: float
    kept: int
    kept_p90_abs_error_pct: float | None
    """The P90 absolute error (% of the threshold) on the requests it would have kept local (None: none)."""
    missed_share: float | None
    """None: it would have kept none."""
    spilled: int
    needless_share: float | None
    """None: it would have spilled none."""


def dataset_rows(requests: Iterable[Mapping[str, Any]], trace: str, policy: str, round_: int) -> list[dict]:
    """The dataset's rows from ``/admin/usage?estimate=1&features=1``'s ``requests``: each tagged with its trace (or
    shape), policy and round; rows without a realised wait are kept (the file is the record), ``evaluate`` skips
    them."""
    return [{"trace": trace, "policy": policy, "round": round_, **r} for r in requests]


_STARTED: set[Path] = set()


def append_rows(path: Path | None, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append ``rows`` to the JSON-lines file at ``path`` (nothing for None); the first call of a process for a path
    starts the file afresh, so a rerun does not mix its rows with the last run's, and a run cut short keeps the
    rows of the replays it finished."""
    if path is None:
        return
    path = path.resolve()
    first = path not in _STARTED
    if first:
        path.parent.mkdir(parents=True, exist_ok=True)
        _STARTED.add(path)
    with path.open("w" if first else "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def read_datasets(paths: Sequence[Path], policies: Mapping[Path, str] | None = None) -> dict[str, list[dict]]:
    """Rows by trace from JSON-lines files, gzipped where the name ends in ``.gz`` (a row without ``trace`` takes
    its file's stem); only rows with an admission record and a realised wait, and, for a file in ``policies``, only
    that policy's rows: a ``ValueError`` names the policies the file has when none of its rows is that policy's."""
    by: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        only = (policies or {}).get(path)
        seen: set[str] = set()
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            seen.add(str(row.get("policy")))
            if only is not None and row.get("policy") != only:
                continue
            if row.get("admission") is not None and row.get("realised_wait_ms") is not None:
                by[str(row.get("trace") or path.stem)].append(row)
        if only is not None and only not in seen:
            raise ValueError(f"{path}: no row of policy {only!r} (policies in the file: {', '.join(sorted(seen))})")
    return dict(by)


def weighted_prefill_slope(samples: Sequence[tuple[float, float]]) -> float | None:
    """An alternative to the plain Theil-Sen prefill slope (:func:`lmfleet.overflow.signals.prefill_slope`),
    measured and not shipped (docs/benchmarks.md): the median of the pairwise slopes with each pair weighted by its spread in
    tokens, so the pairs spanning a long prompt outweigh the many close pairs of short chats. Same pairs (at least
    ``PREFILL_MIN_SPREAD`` tokens apart, at least ``PREFILL_MIN_PAIRS``), clamped at 0."""
    slopes = sorted(((yj - yi) / (xj - xi), abs(xj - xi)) for i, (xi, yi) in enumerate(samples)
                    for xj, yj in samples[i + 1:] if abs(xj - xi) >= PREFILL_MIN_SPREAD)
    if len(slopes) < PREFILL_MIN_PAIRS:
        return None
    half = sum(w for _, w in slopes) / 2
    return max(0.0, next(s for (s, _), seen in zip(slopes, accumulate(w for _, w in slopes)) if seen >= half))


REPLAY_MIN_SAMPLES = 8
"""Rebuilt samples :func:`with_prefill_line` needs before it replaces the recorded figures."""
Line = tuple[float | None, float | None, float | None]
"""(base TTFT s, base work tokens, slope s per token) as :class:`QueueSignals` carries them."""
LineRule = Callable[[Sequence[tuple[float, float, float]], QueueSignals], Line]
"""``rule(samples, recorded)``: samples ``(observed at, work, ttft s)``, oldest first; the recorded signals."""


def _fitted_line(samples: Sequence[tuple[float, float, float]], recorded: QueueSignals) -> Line:
    line = prefill_line([(w, y) for _, w, y in samples])
    return (None, None, None) if line is None else (line.base_ttft_s, line.base_work, line.slope)


def slope_only(slope: Callable[[Sequence[tuple[float, float]]], float | None]) -> LineRule:
    """A rule that replays only the slope, keeping the base TTFT and base work as recorded."""
    def rule(samples: Sequence[tuple[float, float, float]], recorded: QueueSignals) -> Line:
        return recorded.base_ttft_s, recorded.base_prefill_tokens, slope([(w, y) for _, w, y in samples])
    return rule


LINES: dict[str, LineRule | None] = {
    "recorded": None, "gateway": _fitted_line, "theil-sen": slope_only(prefill_slope),
    "weighted": slope_only(weighted_prefill_slope)}
"""The prefill rules :func:`with_prefill_line` replays: as recorded; the gateway's prefill line
(:func:`lmfleet.overflow.signals.prefill_line`, base and slope fitted together); and two slopes on the recorded
base TTFT (the median TTFT of the unqueued requests of the last 60 s, before the line replaced it): the plain
Theil-Sen slope and the one weighted by spread, both measured and not kept (docs/benchmarks.md)."""


def with_prefill_line(rows: Sequence[Mapping[str, Any]], rule: LineRule) -> list[dict]:
    """The rows of one trace as the gateway would have estimated them with another prefill ``rule``: the tracker's
    samples rebuilt from the rows themselves (every request that found a free slot: its prefill work, prompt plus
    the work ahead of it, against its realised wait, observed when its first token came; the last 64 of the last
    600 s before each admission, in the order of the admissions' clock), each admission's base TTFT, base work and
    slope recomputed from them, and its estimate moved by what that changes in :func:`estimate_wait_ms`. Pure.
    Rows of several runs of a trace may be mixed: their clocks lie apart by more than the 600 s. The replay has
    only the dataset's requests, while the gateway also had those of the run's warm-up (the capacity measurement):
    an admission with fewer than ``REPLAY_MIN_SAMPLES`` rebuilt samples keeps its recorded figures, and replays
    compare with each other (the gateway's rule replayed), not with the recorded figures."""
    order = sorted(range(len(rows)), key=lambda i: admission_of(rows[i]).signals.now)
    done: list[tuple[float, float, float]] = []  # (first token at, work, ttft s)
    out: list[dict] = [dict(r) for r in rows]
    for i in order:
        a = admission_of(rows[i])
        s = a.signals
        now = s.now
        samples = [d for d in done if now - PREFILL_TTL_S <= d[0] <= now][-PREFILL_SAMPLES:]
        if len(samples) < REPLAY_MIN_SAMPLES:
            base, work, k = s.base_ttft_s, s.base_prefill_tokens, s.prefill_s_per_token
        else:
            base, work, k = rule(samples, s)
        stale = line_is_stale(samples[-1][0] if samples else None, now, s.in_flight)
        new = replace(s, base_ttft_s=base, base_prefill_tokens=work, prefill_s_per_token=k, prefill_stale=stale)
        moved = (estimate_wait_ms(new, a.capacity, prompt_tokens=a.prompt_tokens)
                 - estimate_wait_ms(s, a.capacity, prompt_tokens=a.prompt_tokens))
        out[i]["admission"] = replace(a, signals=new, estimate_ms=a.estimate_ms + moved)
        out[i]["predicted_wait_ms"] = a.estimate_ms + moved
        if s.in_flight + 1 <= a.capacity:
            real_s = float(rows[i]["realised_wait_ms"]) / 1000
            insort(done, (now + real_s, a.prompt_tokens + s.pending_prefill_tokens, real_s))
    return out


def evaluate(name: str, trace: str, fitted_on: str, predicted: Sequence[float], rows: Sequence[Mapping]) -> Score:
    """Score predictions (ms) against the rows' realised waits and thresholds (module docstring)."""
    if len(predicted) != len(rows) or not rows:
        raise ValueError(f"{len(predicted)} predictions for {len(rows)} rows: expected as many, and at least one")
    real = [float(r["realised_wait_ms"]) for r in rows]
    thr = [float(admission_of(r).threshold_ms) for r in rows]
    errs = [abs(a - p) for a, p in zip(real, predicted)]
    kept = [a > t for a, p, t in zip(real, predicted, thr) if p < t]
    spilled = [a <= t for a, p, t in zip(real, predicted, thr) if p >= t]
    p90 = percentile(errs, 90)
    kept_errs = [100 * e / t for e, p, t in zip(errs, predicted, thr) if p < t]
    return Score(name, trace, fitted_on, len(rows), p90, 100 * p90 / (sum(thr) / len(thr)), len(kept),
                 percentile(kept_errs, 90) if kept_errs else None, sum(kept) / len(kept) if kept else None,
                 len(spilled),
                 sum(spilled) / len(spilled) if spilled else None)


def _judge(c: Candidate, train: Sequence[Mapping], test: Sequence[Mapping], trace: str, fitted_on: str) -> Score:
    params = c.fit(train)
    return evaluate(c.name, trace, fitted_on, [c.predict(params, r) for r in test], test)


def loto(datasets: Mapping[str, Sequence[Mapping]], candidates: Iterable[Candidate] = CANDIDATES.values()
         ) -> list[Score]:
    """Every candidate on every trace: fitted on the others (``others``), and on all of them (:data:`ALL`). Needs
    two traces or more."""
    if len(datasets) < 2:
        raise ValueError(f"leave-one-trace-out needs two traces or more, got {sorted(datasets)}")
    every = [r for rows in datasets.values() for r in rows]
    out = []
    for c in candidates:
        for trace, rows in datasets.items():
            others = [r for t, rs in datasets.items() if t != trace for r in rs]
            out.append(_judge(c, others, rows, trace, "others"))
            out.append(_judge(c, every, rows, trace, ALL))
    return out


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def table(scores: Sequence[Score]) -> str:
    """A markdown table, one line per candidate x held-out trace, the in-sample figures beside each."""
    lines = ["| candidate | held out | requests | P90 abs error ms (% of threshold) | kept: P90 error %, missed | "
             "spilled: needless | tuned on all: P90 error % / missed / needless |", "|---|---|---|---|---|---|---|"]
    ins = {(s.candidate, s.trace): s for s in scores if s.fitted_on == ALL}
    for s in (s for s in scores if s.fitted_on != ALL):
        a = ins.get((s.candidate, s.trace))
        tail = f"{a.p90_abs_error_pct:.0f} % / {_pct(a.missed_share)} / {_pct(a.needless_share)}" if a else "-"
        lines.append(f"| {s.candidate} | {s.trace} | {s.requests} | {s.p90_abs_error_ms:.0f} "
                     f"({s.p90_abs_error_pct:.0f} %) | {s.kept}: {_num(s.kept_p90_abs_error_pct)} %, "
                     f"{_pct(s.missed_share)} | {s.spilled}: "
                     f"{_pct(s.needless_share)} | {tail} |")
    return "\n".join(lines)


def worst(scores: Sequence[Score]) -> list[dict[str, Any]]:
    """Per candidate, its worst held-out figures over the traces (the targets hold on every trace, not on average)."""
    by: dict[str, list[Score]] = defaultdict(list)
    for s in scores:
        if s.fitted_on != ALL:
            by[s.candidate].append(s)
    return [{"candidate": c, "worst_p90_abs_error_pct": max(s.p90_abs_error_pct for s in ss),
             "worst_kept_p90_abs_error_pct": max((s.kept_p90_abs_error_pct for s in ss
                                                  if s.kept_p90_abs_error_pct is not None), default=None),
             "worst_missed_share": max((s.missed_share for s in ss if s.missed_share is not None), default=None),
             "worst_needless_share": max((s.needless_share for s in ss if s.needless_share is not None),
                                         default=None)} for c, ss in by.items()]


def scores_json(scores: Sequence[Score]) -> list[dict[str, Any]]:
    return [asdict(s) for s in scores]


def synthetic_dataset(seed: int = 1, per_trace: int = 300, threshold_ms: float = 2500.0) -> dict[str, list[dict]]:
    """Three made-up traces for ``--smoke`` and tests: random loads of an 8-slot engine, the shipped estimate from
    them, and a realised wait drawn around a true wait whose service rate differs per trace (0.8x, 1x, 1.3x the
    measured one) with log-normal noise. Deterministic for a seed; not a claim about any engine."""
    rnd = random.Random(seed)
    out: dict[str, list[dict]] = {}
    for trace, slow in (("synthetic-fast", 0.8), ("synthetic-even", 1.0), ("synthetic-slow", 1.3)):
        rows = []
        for _ in range(per_trace):
            in_flight = rnd.randint(0, 24)
            drain = rnd.uniform(1.0, 3.0)
            s = QueueSignals(now=0.0, in_flight=in_flight, drain_rps=drain, output_tps=drain * 60,
                             ttft_s=None, base_ttft_s=rnd.uniform(0.2, 0.6), completions_in_window=20,
                             pending_prefill_tokens=rnd.randint(0, 2000), prefill_s_per_token=0.0002,
                             base_prefill_tokens=300.0)
            prompt = rnd.randint(20, 1500)
            est = estimate_wait_ms(s, 8, prompt_tokens=prompt)
            margin = PRIOR * CAP * threshold_ms
            a = Admission(s, 8, prompt, None, est, margin, applied_margin_ms(est, margin, threshold_ms), threshold_ms)
            queue_ms = 1000 * max(0, in_flight - 7) / drain
            real = (slow * queue_ms + (est - queue_ms)) * math.exp(rnd.gauss(0, 0.35))
            rows.append({"trace": trace, "policy": "local only", "round": 1, "predicted_wait_ms": est,
                         "realised_wait_ms": real, "admission": asdict(a)})
        out[trace] = rows
    return out

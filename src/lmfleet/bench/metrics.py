"""Benchmark statistics: pure functions of request records.

Definitions are those of ``vllm bench serve`` (vllm/benchmarks/serve.py, ``calculate_metrics``):
- TTFT: time to the first streamed token event; TPOT (per request): (E2E - TTFT) / (output_tokens - 1),
  only for requests with more than one output token; ITL: every gap between consecutive token events,
  pooled over requests; E2E: from sending to the last token event.
- Percentiles: linear interpolation (``numpy.percentile``); an empty list reports 0.
- Throughputs divide successful requests' tokens by the measured duration; goodput counts requests
  meeting every given SLO (TPOT counts as 0 for requests with <= 1 output token, as in vLLM).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from lmfleet.bench.loadgen import RequestRecord
from lmfleet.provenance import is_external

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; ``None`` = not part of goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def percentile(values: Sequence[float], p: float) -> float:
    return float(np.percentile(values, p)) if len(values) else 0.0


def dist_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p95, p99, max of durations in seconds, reported in milliseconds."""
    if not len(values_s):
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}, "max": 0.0}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    out["max"] = float(arr.max())
    return out


def tpot(rec: RequestRecord) -> float | None:
    if rec.output_tokens > 1:
        return (rec.latency - rec.ttft) / (rec.output_tokens - 1)
    return None


def is_good(rec: RequestRecord, slo: SLO) -> bool:
    if not rec.ok:
        return False
    checks = ((slo.ttft_ms, rec.ttft), (slo.tpot_ms, tpot(rec) or 0.0), (slo.e2el_ms, rec.latency))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def status_label(rec: RequestRecord) -> str:
    if rec.status == 0:
        return "timeout" if rec.error == "timeout" else "no_response"
    if rec.status == 200:
        return "stream_error"  # 200 with an error event or no token
    return str(rec.status)


def measurement_window(records: Sequence[RequestRecord], warmup: float) -> float:
    """Seconds from the end of warm-up to the end of the last measured request."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        return 0.0
    start = warmup if warmup > 0 else min(r.start for r in measured)
    return max(0.0, max(r.end for r in measured) - start)


def summarize(records: Sequence[RequestRecord], duration: float, slo: SLO = SLO()) -> dict:
    """Figures for one group of (measured) records over ``duration`` seconds."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    itls = [g for r in ok for g in r.itl]
    good = sum(1 for r in ok if is_good(r, slo)) if slo.is_set else None
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "error_rate": len(failed) / len(records) if records else 0.0,
        "errors_by_status": dict(sorted(Counter(status_label(r) for r in failed).items())),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "duration_s": duration,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out),
        "ttft_ms": dist_ms([r.ttft for r in ok]),
        "tpot_ms": dist_ms(tpots),
        "itl_ms": dist_ms(itls),
        "e2el_ms": dist_ms([r.latency for r in ok]),
        "goodput_rps": per_s(good) if good is not None else None,
        "slo_attainment": (good / len(records) if records else 0.0) if good is not None else None,
    }


def group_by(records: Iterable[RequestRecord], key: Callable[[RequestRecord], str]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    return dict(sorted(groups.items()))


def timeseries(records: Sequence[RequestRecord], bin_s: float | None = None) -> dict[str, list[float]]:
    """Per time bin: output tokens/s (each request's tokens spread evenly from its first to its last
    token), mean requests in flight, completions, and the share of completions served externally."""
    if not records:
        return {"t": [], "output_tps": [], "in_flight": [], "completions": [], "external_share": []}
    t_end = max(r.end for r in records)
    bin_s = bin_s or max(1.0, t_end / 120)
    n = int(t_end // bin_s) + 1
    tokens = np.zeros(n)
    busy = np.zeros(n)
    done = np.zeros(n)
    external = np.zeros(n)
    for r in records:
        _spread(busy, r.start, r.end, r.latency, bin_s)  # seconds in flight per bin
        b = min(int(r.end // bin_s), n - 1)
        if r.ok:
            first = r.start + r.ttft
            _spread(tokens, first, r.end, r.output_tokens, bin_s)
            done[b] += 1
            external[b] += is_external(r.provider)
    share = np.divide(external, done, out=np.zeros(n), where=done > 0)
    return {
        "t": [float(i * bin_s) for i in range(n)],
        "output_tps": (tokens / bin_s).tolist(),
        "in_flight": (busy / bin_s).tolist(),
        "completions": done.tolist(),
        "external_share": share.tolist(),
    }


def _spread(arr: np.ndarray, a: float, b: float, amount: float, bin_s: float) -> None:
    """Add ``amount`` to ``arr`` spread uniformly over [a, b] (all at ``a`` if the interval is empty)."""
    n = len(arr)
    if b <= a:
        arr[min(int(a // bin_s), n - 1)] += amount
        return
    rate = amount / (b - a)
    i = int(a // bin_s)
    while i < n and i * bin_s < b:
        lo, hi = max(a, i * bin_s), min(b, (i + 1) * bin_s)
        if hi > lo:
            arr[i] += rate * (hi - lo)
        i += 1

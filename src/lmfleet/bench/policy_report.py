"""The per-trace table of overflow policies: one row per trace and arm, from ``bench_overflow_policies.py``'s
``summary.json`` files (pure: no I/O).

Every row names its trace (window and factors, from the summary's ``trace.describe``) and gives, per arm (each
lmfleet policy, and each LiteLLM arm when the run had them): TTFT-SLO attainment, TTFT P50/P95/P99, errors,
provider dollars, dollars against the oracle's, the share of prompt tokens sent twice, and the wait estimate's
P90 absolute error on the requests kept local (pooled over rounds, % of the threshold). :func:`targets` says, per
trace, which of issue 48's targets held.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmfleet.bench.overflow_figures import GATED, ORACLE_PLAN


@dataclass(frozen=True)
class Row:
    trace: str
    arm: str
    requests: int
    attainment: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    errors: int
    spend_usd: float
    x_oracle: float | None
    sent_twice_share: float
    estimate_p90_pct: float | None
    x_bound: float | None = None
    """Spend over the lower bound on the oracle's (:mod:`lmfleet.overflow.bound`; None: not measured): an upper
    bound on spend over the true oracle's."""


def trace_label(summary: dict[str, Any]) -> str:
    """A short name of the run's traffic: the shape's name, or the trace's window, pace and token factor."""
    t = summary.get("trace") or {}
    if t.get("kind") == "trace":
        p = t.get("params", t)
        start, length = float(p.get("start_s", 0)), float(p.get("length_s", 0))
        return (f"{Path(str(p.get('trace', 'trace'))).stem} {start:.0f}-{start + length:.0f} s, "
                f"{p.get('pace', '')}, tokens x{p.get('token_factor', 1)}")
    return str(t.get("name") or "?")


def attribution(summary: dict[str, Any]) -> str | None:
    """The credit a published figure from a real trace must carry (None for synthetic shapes)."""
    t = summary.get("trace") or {}
    return (t.get("params") or t).get("attribution")


def rows(summary: dict[str, Any]) -> list[Row]:
    """One :class:`Row` per arm of one run, in the run's order."""
    oracle = (summary.get("oracle") or {}).get("spend_usd") or 0.0
    bound = ((summary.get("oracle") or {}).get("bound") or {}).get("spend_usd") or 0.0
    pooled = summary.get("estimate_pooled_client") or {}
    out = []
    for arm, r in (summary.get("results") or {}).items():
        est = pooled.get(arm) or {}
        spend = float(r.get("spend_usd") or 0.0)
        out.append(Row(trace=trace_label(summary), arm=arm, requests=int(r.get("requests", 0)),
                       attainment=float(r.get("slo_attainment", 0.0)), ttft_p50_ms=float(r.get("ttft_p50_ms", 0.0)),
                       ttft_p95_ms=float(r.get("ttft_p95_ms", 0.0)), ttft_p99_ms=float(r.get("ttft_p99_ms", 0.0)),
                       errors=int(r.get("errors", 0)), spend_usd=spend,
                       x_oracle=spend / oracle if oracle > 0 and spend > 0 else None,
                       sent_twice_share=float(r.get("sent_twice_share", 0.0)),
                       estimate_p90_pct=est.get("p90_abs_error_pct_of_threshold"),
                       x_bound=spend / bound if bound > 0 and spend > 0 else None))
    return out


def targets(trace_rows: list[Row]) -> dict[str, bool | None]:
    """Issue 48's targets on one trace (None: the arm was not run, or nothing to compare with): predictive >= 99 %
    with 0 errors and nothing sent twice; predictive at <= 1.3x the oracle's spend (met when it is within 1.3x the
    lower bound on the oracle's spend, :mod:`lmfleet.overflow.bound`; else None when the oracle plan arm, replayed,
    met the SLO for less than 99 %: then the oracle's spend is no bound); hedge >= 99.5 %; the
    estimate's P90 error <= 25 % under predictive; predictive above every LiteLLM arm's attainment at no more
    than its spend; and, where the run had the ``predictive gated`` arm (``overflow.prefill_gate`` on), its
    attainment and estimate targets."""
    by = {r.arm: r for r in trace_rows}
    p, h, plan, g = by.get("predictive"), by.get("hedge"), by.get(ORACLE_PLAN), by.get(GATED)
    lite = [r for r in trace_rows if r.arm.startswith("litellm")]
    no_bound = plan is not None and plan.attainment < 0.99
    return {
        "predictive >= 99 %, 0 errors, 0 sent twice": None if p is None else (
            p.attainment >= 0.99 and p.errors == 0 and p.sent_twice_share == 0),
        "predictive <= 1.3x oracle": None if p is None else True if p.x_bound is not None and p.x_bound <= 1.3
            else None if p.x_oracle is None or no_bound else p.x_oracle <= 1.3,
        "hedge >= 99.5 %": None if h is None else h.attainment >= 0.995,
        "estimate P90 error <= 25 % (predictive)": None if p is None or p.estimate_p90_pct is None else
            p.estimate_p90_pct <= 25,
        "predictive beats every LiteLLM arm at <= its spend": None if p is None or not lite else all(
            p.attainment > r.attainment and p.spend_usd <= r.spend_usd for r in lite),
        "predictive gated >= 99 %, 0 errors, 0 sent twice": None if g is None else (
            g.attainment >= 0.99 and g.errors == 0 and g.sent_twice_share == 0),
        "estimate P90 error <= 25 % (predictive gated)": None if g is None or g.estimate_p90_pct is None else
            g.estimate_p90_pct <= 25,
    }


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def markdown(all_rows: list[Row]) -> str:
    lines = ["| trace | arm | requests | SLO attained | TTFT P50 / P95 / P99 ms | errors | $ | × oracle $ "
             "| × bound $ | prompt tokens sent twice | estimate P90 \\|error\\| (% of threshold) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        est = "–" if r.estimate_p90_pct is None else f"{r.estimate_p90_pct:.0f} %"
        lines.append(f"| {r.trace} | {r.arm} | {r.requests} | {r.attainment:.1%} | {r.ttft_p50_ms:.0f} / "
                     f"{r.ttft_p95_ms:.0f} / {r.ttft_p99_ms:.0f} | {r.errors} | {r.spend_usd:.5f} | {_x(r.x_oracle)} | "
                     f"{_x(r.x_bound)} | "
                     f"{r.sent_twice_share:.1%} | {est} |")
    return "\n".join(lines) + "\n"

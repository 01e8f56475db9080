"""The overflow-policies benchmark's figures (``benchmarks/bench_overflow_policies.py``): what the client saw of
each replayed request (:class:`Outcome`), and per policy or proxy the SLO attainment, TTFT percentiles, spend,
prompts sent twice, the estimate's error and the oracle's inputs. Pure: no I/O.

An arm is a policy of lmfleet's gateway, or the real LiteLLM proxy at one ``stream_timeout``
(:mod:`lmfleet.testing.litellm_proxy`), whose fallbacks carry the route reason :data:`LITELLM_FALLBACK`: the
prompt went to the engine, waited past the timeout and was sent again to the provider.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from lmfleet.config.models import ProviderPrice
from lmfleet.overflow.bound import bound_spill_nusd, demonstrated_rate
from lmfleet.overflow.estimate_error import estimate_error, percentile
from lmfleet.overflow.oracle import LocalServiceModel, ServiceSample, kept_ttfts_s, oracle_spill, spill_cost_nusd
from lmfleet.provenance import is_external

__all__ = ["GATED", "LITELLM_FALLBACK", "LOCAL_ONLY", "NO_FLOOR", "OLDLINE", "ORACLE_PLAN", "RATE_ARMS", "UNGATED",
           "Outcome", "estimate_line", "header_lines", "local_model", "plan_misses", "pooled_estimate",
           "provider_bill_usd", "refit_oracle", "rounds_from_lines", "service_samples", "spend_bound", "summarize",
           "table"]

LOCAL_ONLY = "local only"
"""The arm with overflow forced off: the oracle's decode rate is measured on it."""
ORACLE_PLAN = "oracle plan"
"""The arm that replays the oracle's spill set (spilled requests straight to the provider, the rest local only):
below 99 % attainment the oracle's model was optimistic."""
GATED = "predictive gated"
"""The arm of predictive with ``overflow.prefill_gate`` true (on whatever the engine)."""
UNGATED = "predictive ungated"
"""The arm of predictive with ``overflow.prefill_gate`` false. The ``predictive`` arm runs the default, ``auto``
(on for the CPU engine with a provider); runs recorded before ``auto`` had the gate off in it."""
OLDLINE = "predictive prefill line"
"""The arm of predictive whose gated requests are priced on the prefill line (``gate_line`` false), not the
gate's service line."""
NO_FLOOR = "predictive no floor"
"""The arm of predictive with ``overflow.miss_floor`` 0 (the learned margin alone); the others run the default."""
LITELLM_FALLBACK = "litellm_fallback"
"""The route reason of a request the LiteLLM proxy answered from its fallback (the provider)."""


@dataclass
class Outcome:
    """One replayed request, as the client saw it."""

    index: int
    prompt_tokens: int
    output_tokens: int
    sent_s: float
    """Seconds after the run's start when it was sent (its arrival)."""
    ttft_s: float | None
    e2e_s: float | None
    status: int
    served_by: str = ""
    route_reason: str = ""
    hedged: bool = False
    estimate_ms: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft_s is not None

    @property
    def external(self) -> bool:
        return is_external(self.served_by) if self.served_by else False

    @property
    def both_sent(self) -> bool:
        """The prompt went to the local engine and to a provider."""
        return self.hedged or self.route_reason in ("ttft_timeout", LITELLM_FALLBACK)

    @property
    def after_cancel(self) -> bool:
        """Answered by a provider after the local attempt was cancelled."""
        return self.route_reason in ("ttft_timeout", "hedge_won", LITELLM_FALLBACK)


def summarize(outcomes: list[Outcome], slo_s: float, spend_usd: float) -> dict:
    """One arm's figures (rounds pooled); the benchmark's docstring says what each means."""
    n = len(outcomes)
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s * 1000 for o in ok]  # type: ignore[operator]
    tokens = sum(o.prompt_tokens + o.output_tokens for o in ok)
    prompt = sum(o.prompt_tokens for o in outcomes)
    twice = sum(o.prompt_tokens for o in outcomes if o.both_sent)
    return {
        "requests": n, "errors": n - len(ok),
        "slo_attainment": sum(1 for t in ttfts if t <= slo_s * 1000) / n if n else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p95_ms": percentile(ttfts, 95),
        "ttft_p99_ms": percentile(ttfts, 99),
        "kept_local_ttft_p99_ms": percentile([o.ttft_s * 1000 for o in ok if not o.external], 99),  # type: ignore[operator]
        "external_share": sum(1 for o in ok if o.external) / len(ok) if ok else 0.0,
        "spend_usd": spend_usd, "usd_per_1m_tokens": spend_usd / tokens * 1e6 if tokens else None,
        "prompt_tokens": prompt, "prompt_tokens_sent_twice": twice,
        "sent_twice_share": twice / prompt if prompt else 0.0,
        "answered_after_cancel": sum(1 for o in ok if o.after_cancel),
        "hedged": sum(1 for o in outcomes if o.hedged),
    }


def pooled_estimate(outcomes: list[Outcome], threshold_ms: float, model: str = "smollm2") -> dict | None:
    """The estimate's error over every round of one policy, client-measured: the ``x-lmfleet-queue-estimate-ms``
    header against the client's TTFT, of the requests answered locally (None: none). The per-round figures come
    from the ledger (the gateway's TTFT); the client's adds its own few milliseconds."""
    pairs = [(o.estimate_ms, o.ttft_s * 1000) for o in outcomes  # type: ignore[operator]
             if o.ok and not o.external and o.estimate_ms is not None]
    return estimate_error(model, pairs).as_dict(threshold_ms) if pairs else None


def service_samples(rounds: list[list[Outcome]], slots: int) -> list[ServiceSample]:
    """The oracle's inputs: the local answers of each round; one is queued when ``slots`` earlier local answers of
    its round still streamed, or one of them was still before its first token, as it was sent (each round's
    ``sent_s`` counts from that round's start, so rounds are never mixed)."""
    out = []
    for outcomes in rounds:
        done = sorted((o for o in outcomes if o.ok and o.e2e_s is not None and not o.external),
                      key=lambda o: o.sent_s)
        for i, o in enumerate(done):
            ahead = [p for p in done[:i] if p.sent_s + p.e2e_s > o.sent_s]  # type: ignore[operator]
            prefilling = any(p.sent_s + p.ttft_s > o.sent_s for p in ahead)  # type: ignore[operator]
            out.append(ServiceSample(o.prompt_tokens, o.output_tokens, o.ttft_s, o.e2e_s,  # type: ignore[arg-type]
                                     len(ahead) >= slots or prefilling))
    return out


def local_model(rounds_of: Mapping[str, list[list[Outcome]]], policies: list[str], slots: int) -> LocalServiceModel:
    """The oracle's local model (:mod:`lmfleet.overflow.oracle`): the prefill line on the local answers of every
    policy's rounds, the decode rate on the ``local only`` rounds. Raises ValueError when they are too few."""
    every = [res for name in policies for res in rounds_of.get(name, [])]
    return LocalServiceModel.fit(service_samples(every, slots), slots,
                                 decode_samples=service_samples(list(rounds_of.get(LOCAL_ONLY, [])), slots))


def rounds_from_lines(records: list[dict]) -> dict[str, list[list[Outcome]]]:
    """``outcomes.jsonl``'s records (``{"policy", "round", **Outcome}``) back into per-arm rounds; records without
    ``round`` start a new round where ``index`` restarts at 0."""
    out: dict[str, list[list[Outcome]]] = {}
    for rec in records:
        rec = dict(rec)
        arm, rnd = rec.pop("policy"), rec.pop("round", None)
        rounds = out.setdefault(arm, [])
        if (rnd is None and (rec["index"] == 0 or not rounds)) or (rnd is not None and rnd > len(rounds)):
            rounds.append([])
        rounds[-1 if rnd is None else rnd - 1].append(Outcome(**rec))
    return out


@dataclass(frozen=True)
class _Traced:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def plan_misses(rounds: list[list[Outcome]], model: LocalServiceModel, slo_s: float) -> list[dict]:
    """Per round of the ``oracle plan`` arm: its local answers, how many missed the SLO, and how many ``model``
    predicts to miss (those requests alone on the modelled replica, at their send times and lengths)."""
    out = []
    for n, res in enumerate(rounds, 1):
        local = [o for o in res if o.ok and not o.external]
        trace = [_Traced(o.sent_s, o.prompt_tokens, o.output_tokens) for o in local]
        predicted = kept_ttfts_s(trace, range(len(trace)), model)
        missed = sum(o.ttft_s > slo_s for o in local)  # type: ignore[operator]
        out.append({"round": n, "local": len(local), "missed": missed, "predicted": sum(t > slo_s for t in predicted)})
    return out


RATE_ARMS = ("predictive", OLDLINE, GATED, UNGATED, NO_FLOOR, "on_error", LOCAL_ONLY, ORACLE_PLAN)
"""The arms whose local answers are every prompt that reached the engine (no hedge or timeout cancelled one after
it started): :func:`spend_bound` measures the engine's prefill rate on their rounds."""


def spend_bound(rounds_of: Mapping[str, list[list[Outcome]]], trace: list, price: ProviderPrice,
                slo_s: float) -> dict:
    """The lower bound on the oracle's spend per round (:mod:`lmfleet.overflow.bound`): the engine's demonstrated
    prefill rate on the :data:`RATE_ARMS` rounds, and the relaxed engine's cheapest spill set on ``trace``.
    Raises ValueError when those rounds have no local answer."""
    answered = [[(_Traced(o.sent_s, o.prompt_tokens, o.output_tokens), o.ttft_s) for o in res
                 if o.ok and not o.external] for arm in RATE_ARMS for res in rounds_of.get(arm, [])]
    rate = demonstrated_rate(answered)
    spend = bound_spill_nusd(trace, rate, slo_s, [spill_cost_nusd(r, price) for r in trace])
    return {"rate_tps": rate, "spend_nusd": spend}


def refit_oracle(summary: Mapping, records: list[dict]) -> dict:
    """A saved run's oracle fitted again with :func:`local_model` from its ``outcomes.jsonl`` records: the trace is
    each request's earliest send time and the ``local only`` arm's token counts (the engine's, chat template
    included), priced at the summary's ``price`` (the benchmark's default, 0.5 / 1.5 $ per 1M, when it has none).
    With an ``oracle plan`` arm, ``plan_check`` checks the refitted model on it (:func:`plan_misses`); ``bound`` is the
    lower bound on the oracle's spend (:func:`spend_bound`, dollars over every round), when the run measured one.
    Raises ValueError when the run has no ``local only`` arm or too few samples."""
    rounds_of = rounds_from_lines(records)
    if not rounds_of.get(LOCAL_ONLY):
        raise ValueError("the run has no local only arm")
    slots = int(summary.get("max_num_seqs") or 8)
    policies = [a for a in rounds_of if a in summary.get("results", {}) and not a.startswith("litellm")
                and a != ORACLE_PLAN]
    model = local_model(rounds_of, policies, slots)
    first = {o.index: o for o in rounds_of[LOCAL_ONLY][0]}
    sent = {}
    for rounds in rounds_of.values():
        for res in rounds:
            for o in res:
                sent[o.index] = min(sent.get(o.index, o.sent_s), o.sent_s)
    trace = [_Traced(sent[i], first[i].prompt_tokens, first[i].output_tokens) for i in sorted(first)]
    price = ProviderPrice(**(summary.get("price") or {"input_per_1m": 0.5, "output_per_1m": 1.5}))
    res = oracle_spill(trace, model, float(summary["threshold_ms"]), price)
    out = {"model": asdict(model), "spilled": len(res.spilled), "of": len(trace),
           "spend_usd": res.spend_nusd / 1e9 * int(summary.get("rounds") or 1), "refit": True}
    if rounds_of.get(ORACLE_PLAN):
        out["plan_check"] = plan_misses(rounds_of[ORACLE_PLAN], model, float(summary["threshold_ms"]) / 1000.0)
    try:
        b = spend_bound(rounds_of, trace, price, float(summary["threshold_ms"]) / 1000.0)
    except ValueError:
        pass
    else:
        out["bound"] = {"rate_tps": round(b["rate_tps"], 1),
                        "spend_usd": b["spend_nusd"] / 1e9 * int(summary.get("rounds") or 1)}
    return out


def table(results: dict[str, dict], oracle_usd: float | None) -> str:
    head = ("| policy | requests | SLO attained | TTFT P50 | P95 | P99 | kept-local P99 | external | $ spent | "
            "$/1M tok | x oracle $ | prompt tok sent twice | answered after cancel | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        ratio = (f"{r['spend_usd'] / oracle_usd:.2f}" if oracle_usd else "n/a")
        per = f"{r['usd_per_1m_tokens']:.3f}" if r["usd_per_1m_tokens"] is not None else "n/a"
        lines.append(
            f"| {name} | {r['requests']} | {r['slo_attainment']:.1%} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} "
            f"| {r['ttft_p99_ms']:.0f} | {r['kept_local_ttft_p99_ms']:.0f} | {r['external_share']:.0%} | "
            f"{r['spend_usd']:.5f} | {per} | {ratio} | {r['prompt_tokens_sent_twice']} "
            f"({r['sent_twice_share']:.1%}) | {r['answered_after_cancel']} | {r['errors']} |")
    return "\n".join(lines)


def estimate_line(name: str, label: str, e: dict) -> str:
    return (f"  {name:12s} {label}: n={e['requests']} median |err| {e['median_abs_error_ms']:.0f} ms, P90 |err| "
            f"{e['p90_abs_error_ms']:.0f} ms ({e['p90_abs_error_pct_of_threshold']:.0f} % of threshold), bias "
            f"{e['bias_ms']:+.0f} ms, median actual/predicted {e['median_actual_over_predicted']}")


def provider_bill_usd(outcomes: list[Outcome], price: ProviderPrice) -> float:
    """What the provider billed for the answers it gave (its usage: prompt and output tokens at its price): the
    spend of an arm without lmfleet's ledger (LiteLLM). A fallback after a timeout is billed once, by the provider;
    the engine's cancelled attempt costs nothing extra."""
    return sum(o.prompt_tokens * price.input_per_1m + o.output_tokens * price.output_per_1m
               for o in outcomes if o.ok and o.external) / 1e6


def header_lines(workload: Mapping[str, object]) -> list[str]:
    """The workload's description for a report's header: its ``describe`` line, and its attribution if any."""
    lines = [str(workload.get("describe", ""))]
    if workload.get("attribution"):
        lines.append(f"trace credit: {workload['attribution']}")
    return lines

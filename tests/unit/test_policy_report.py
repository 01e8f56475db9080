"""The per-trace table of overflow policies (lmfleet.bench.policy_report): rows from a run's summary and the
targets each trace met, as tables of cases."""

from __future__ import annotations

import pytest

from lmfleet.bench.policy_report import Row, attribution, markdown, rows, targets, trace_label


def row(arm: str, att: float, spend: float = 0.01, x: float | None = 1.0, errors: int = 0, twice: float = 0.0,
        est: float | None = 10.0, xb: float | None = None) -> Row:
    return Row("t", arm, 10, att, 1, 2, 3, errors, spend, x, twice, est, xb)


GOOD = [row("predictive", 0.995), row("hedge", 1.0, twice=0.1), row("litellm 2500ms", 0.5, spend=0.02)]


@pytest.mark.parametrize("trace_rows,key,expected", [
    (GOOD, "predictive >= 99 %, 0 errors, 0 sent twice", True),
    ([row("predictive", 0.98)], "predictive >= 99 %, 0 errors, 0 sent twice", False),
    ([row("predictive", 1.0, errors=1)], "predictive >= 99 %, 0 errors, 0 sent twice", False),
    ([row("predictive", 1.0, twice=0.001)], "predictive >= 99 %, 0 errors, 0 sent twice", False),
    ([row("hedge", 0.996)], "predictive >= 99 %, 0 errors, 0 sent twice", None),
    (GOOD, "predictive <= 1.3x oracle", True),
    ([row("predictive", 1.0, x=1.31)], "predictive <= 1.3x oracle", False),
    ([row("predictive", 1.0, x=None)], "predictive <= 1.3x oracle", None),
    ([row("predictive", 1.0, x=1.31), row("oracle plan", 0.99)], "predictive <= 1.3x oracle", False),
    ([row("predictive", 1.0, x=4.5), row("oracle plan", 0.135)], "predictive <= 1.3x oracle", None),  # the oracle's $ is no bound
    # within 1.3x the lower bound on the oracle's spend: met, whatever the oracle's model or its plan
    ([row("predictive", 1.0, x=1.1, xb=1.2), row("oracle plan", 0.8)], "predictive <= 1.3x oracle", True),
    ([row("predictive", 1.0, x=1.4, xb=1.3)], "predictive <= 1.3x oracle", True),
    ([row("predictive", 1.0, x=1.1, xb=1.5), row("oracle plan", 0.8)], "predictive <= 1.3x oracle", None),
    ([row("predictive", 1.0, x=1.1, xb=1.5)], "predictive <= 1.3x oracle", True),  # the model's reference
    (GOOD, "hedge >= 99.5 %", True),
    ([row("hedge", 0.994)], "hedge >= 99.5 %", False),
    (GOOD, "estimate P90 error <= 25 % (predictive)", True),
    ([row("predictive", 1.0, est=25.1)], "estimate P90 error <= 25 % (predictive)", False),
    ([row("predictive", 1.0, est=None)], "estimate P90 error <= 25 % (predictive)", None),
    (GOOD, "predictive beats every LiteLLM arm at <= its spend", True),
    ([row("predictive", 1.0, spend=0.03), row("litellm 1500ms", 0.8, spend=0.02)],
     "predictive beats every LiteLLM arm at <= its spend", False),
    ([row("predictive", 0.8), row("litellm 1500ms", 0.8, spend=0.02)],
     "predictive beats every LiteLLM arm at <= its spend", False),
    ([row("predictive", 1.0)], "predictive beats every LiteLLM arm at <= its spend", None),
    (GOOD, "estimate P90 error <= 25 % (predictive gated)", None),  # the arm was not run
    ([row("predictive gated", 0.995, est=12.0)], "estimate P90 error <= 25 % (predictive gated)", True),
    ([row("predictive gated", 0.995, est=26.0)], "estimate P90 error <= 25 % (predictive gated)", False),
    ([row("predictive gated", 0.995)], "predictive gated >= 99 %, 0 errors, 0 sent twice", True),
    ([row("predictive gated", 0.985)], "predictive gated >= 99 %, 0 errors, 0 sent twice", False),
])
def test_targets(trace_rows, key, expected):
    assert targets(trace_rows)[key] is expected


SUMMARY = {
    "trace": {"kind": "trace", "trace": "AzureLLMInferenceTrace_code.csv", "start_s": 600.0, "length_s": 9.6,
              "pace": "2 x capacity 0.88 req/s", "token_factor": 0.25, "attribution": "Azure ..., CC-BY 4.0"},
    "oracle": {"spend_usd": 0.01},
    "results": {"predictive": {"requests": 200, "slo_attainment": 0.99, "ttft_p50_ms": 500, "ttft_p95_ms": 1500,
                               "ttft_p99_ms": 2400, "errors": 0, "spend_usd": 0.012, "sent_twice_share": 0.0},
                "local only": {"requests": 200, "slo_attainment": 0.1, "spend_usd": 0}},
    "estimate_pooled_client": {"predictive": {"p90_abs_error_pct_of_threshold": 21.0}},
}


def test_rows_from_a_summary():
    rs = rows(SUMMARY)
    assert [r.arm for r in rs] == ["predictive", "local only"]
    assert rs[0].x_oracle == pytest.approx(1.2) and rs[0].estimate_p90_pct == 21.0
    assert rs[1].x_oracle is None and rs[1].estimate_p90_pct is None and rs[1].errors == 0
    assert trace_label(SUMMARY) == "AzureLLMInferenceTrace_code 600-610 s, 2 x capacity 0.88 req/s, tokens x0.25"
    assert attribution(SUMMARY) == "Azure ..., CC-BY 4.0"
    assert trace_label({"trace": {"name": "onoff"}}) == "onoff" and attribution({"trace": {"name": "onoff"}}) is None
    table = markdown(rs)
    assert table.count("\n") == 4 and "| 1.20 |" in table and "| – |" in table

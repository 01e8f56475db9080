"""The wait-estimator candidates and the leave-one-trace-out scoring: tables of cases."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math

import pytest

from lmfleet.bench.loto import ALL, append_rows, dataset_rows, evaluate, loto, read_datasets, synthetic_dataset, table
from lmfleet.overflow.admission import Admission
from lmfleet.overflow.estimators import CANDIDATES, features, quantile_regression
from lmfleet.overflow.signals import QueueSignals

THR = 2500.0


def sig(**kw) -> QueueSignals:
    base = dict(now=0.0, in_flight=0, drain_rps=2.0, output_tps=100.0, ttft_s=None, base_ttft_s=0.4,
                completions_in_window=10)
    return QueueSignals(**{**base, **kw})


def row(estimate_ms: float, realised_ms: float | None, *, in_flight: int = 0, applied_ms: float = 0.0,
        **signals) -> dict:
    a = Admission(sig(in_flight=in_flight, **signals), 8, 100, None, estimate_ms, applied_ms, applied_ms, THR)
    return {"trace": "t", "predicted_wait_ms": estimate_ms, "realised_wait_ms": realised_ms,
            "admission": dataclasses.asdict(a)}


# --- the candidates --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q, expect", [(0.5, (1.0, 2.0)), (0.9, (1.0, 2.0))])
def test_quantile_regression_recovers_an_exact_line(q, expect):
    x = [[1.0, float(i)] for i in range(20)]
    y = [1.0 + 2.0 * i for i in range(20)]
    assert quantile_regression(x, y, q) == pytest.approx(expect, abs=1e-3)


def test_quantile_regression_p90_lies_above_p50():
    x = [[1.0] for _ in range(100)]
    y = [float(i) for i in range(100)]
    (p50,) = quantile_regression(x, y, 0.5)
    (p90,) = quantile_regression(x, y, 0.9)
    assert p50 == pytest.approx(49.5, abs=1.5) and p90 == pytest.approx(89.5, abs=1.5)


@pytest.mark.parametrize("q", [0.0, 1.0, 1.5])
def test_quantile_regression_refuses_a_quantile_outside_0_1(q):
    with pytest.raises(ValueError):
        quantile_regression([[1.0]], [1.0], q)


@pytest.mark.parametrize("signals, in_flight, queue_ms", [
    ({}, 0, 0.0),                                         # a free slot: no queue term
    ({}, 9, 1000.0),                                      # 2 ahead of a slot at 2/s
    ({"engine_running": 6, "engine_waiting": 1}, 7, 1000.0),  # the engine holds 6: 7 - 6 + 1 = 2 ahead
    ({"drain_rps": None}, 12, 0.0),                       # no measured rate: no queue feature
])
def test_features_count_the_queue_as_the_estimator_does(signals, in_flight, queue_ms):
    f = features(row(1000.0, 900.0, in_flight=in_flight, **signals))
    assert f[0] == 1.0 and f[1] == 1000.0 and f[2] == pytest.approx(queue_ms) and f[3] == in_flight / 8


TRAIN = [row(1000.0, 1500.0), row(2000.0, 3000.0), row(400.0, 600.0), row(1600.0, 2400.0)]


@pytest.mark.parametrize("name, test_row, expect", [
    ("shipped", row(1000.0, None), 1000.0),
    ("shipped+margin", row(1500.0, None, applied_ms=300.0), 1800.0),
    ("scaled", row(1000.0, None), 1500.0),                  # median realised/estimate 1.5
    ("shipped+static", row(1400.0, None), 1400.0 + 980.0),  # in band: P90 of the errors (1000, 800) in 1250..3750
    ("shipped+static", row(1000.0, None), 1000.0),          # below the band: no margin
    ("ratio-p90", row(1000.0, None), 1500.0),               # too few rows per bin: every ratio is 1.5
])
def test_candidates_fit_and_predict(name, test_row, expect):
    c = CANDIDATES[name]
    assert c.predict(c.fit(TRAIN), test_row) == pytest.approx(expect)


def test_linear_candidates_fit_on_features_and_predict_no_negative_wait():
    rows = [row(100.0 * i, 150.0 * i, in_flight=i % 12) for i in range(1, 40)]
    for name in ("linear-p50", "linear-p90"):
        c = CANDIDATES[name]
        p = c.fit(rows)
        assert json.loads(json.dumps(p)) == p  # params are plain numbers
        assert c.predict(p, row(2000.0, None, in_flight=5)) == pytest.approx(3000.0, rel=0.05)
        assert c.predict({"coef": [-1e6] + [0.0] * 6}, row(10.0, None)) == 0.0


# --- leave-one-trace-out scoring -------------------------------------------------------------------------------

@pytest.mark.parametrize("predicted, realised, kept, missed, spilled, needless", [
    ([1000, 1000], [1200, 3000], 2, 0.5, 0, None),     # both kept, one missed the threshold
    ([3000, 3000], [1200, 3000], 0, None, 2, 0.5),     # both spilled, one did not need it
    ([1000, 3000], [2000, 2600], 1, 0.0, 1, 0.0),
])
def test_evaluate_counts_misses_and_needless_spills(predicted, realised, kept, missed, spilled, needless):
    rows = [row(p, r) for p, r in zip(predicted, realised)]
    s = evaluate("c", "t", "others", predicted, rows)
    assert (s.kept, s.missed_share, s.spilled, s.needless_share) == (kept, missed, spilled, needless)


def test_evaluate_p90_error_in_ms_and_percent_of_threshold():
    rows = [row(0.0, float(e)) for e in range(0, 1001, 100)]  # errors 0..1000 ms
    s = evaluate("c", "t", "others", [0.0] * len(rows), rows)
    assert s.p90_abs_error_ms == pytest.approx(900.0) and s.p90_abs_error_pct == pytest.approx(36.0)
    assert s.kept_p90_abs_error_pct == pytest.approx(36.0)
    with pytest.raises(ValueError):
        evaluate("c", "t", "others", [1.0], rows)


def test_loto_fits_on_the_other_traces_only():
    """A trace whose waits are 3x the estimate, held out, is judged by a correction learned on 1x traces."""
    data = {t: [row(1000.0, 1000.0 * k) for _ in range(n)] for t, k, n in (("a", 1.0, 5), ("b", 1.0, 5), ("c", 3.0, 3))}
    scores = {(s.candidate, s.trace, s.fitted_on): s for s in loto(data, [CANDIDATES["scaled"]])}
    assert scores["scaled", "c", "others"].p90_abs_error_ms == pytest.approx(2000.0)   # k = 1 from a and b
    assert scores["scaled", "a", "others"].p90_abs_error_ms == pytest.approx(0.0)      # k = 1: five 1s, three 3s
    assert scores["scaled", "c", ALL].p90_abs_error_ms == pytest.approx(2000.0)
    with pytest.raises(ValueError, match="two traces"):
        loto({"a": data["a"]})


def test_synthetic_loto_runs_every_candidate_and_tables_it():
    data = synthetic_dataset(per_trace=60)
    scores = loto(data)
    assert len(scores) == 2 * len(CANDIDATES) * len(data)
    assert all(math.isfinite(s.p90_abs_error_ms) for s in scores)
    text = table(scores)
    assert text.count("\n") == 1 + len(CANDIDATES) * len(data) and "| shipped | synthetic-slow |" in text


def test_dataset_rows_written_then_read_by_trace(tmp_path):
    path = tmp_path / "ds" / "x.jsonl"
    reqs = [row(1000.0, 900.0), row(500.0, None)]  # the second has no realised wait: written, not read
    for r in reqs:
        r.pop("trace")
    append_rows(path, dataset_rows(reqs, "gamma", "predictive", 1))
    append_rows(path, dataset_rows(reqs[:1], "ramp", "hedge", 2))
    append_rows(None, reqs)  # no file asked for
    assert len(path.read_text().splitlines()) == 3
    got = read_datasets([path])
    assert {t: len(rs) for t, rs in got.items()} == {"gamma": 1, "ramp": 1}
    assert got["ramp"][0]["policy"] == "hedge" and got["ramp"][0]["round"] == 2
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_datasets([tmp_path / "bad.jsonl"])


def test_read_datasets_reads_gzip_and_takes_one_policy_of_a_file(tmp_path):
    rows = [{**row(900.0, 1000.0), "trace": None, "policy": "predictive"},
            {**row(500.0, 400.0), "trace": None, "policy": "hedge"}]
    gz = tmp_path / "run.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    got = read_datasets([gz])
    assert [r["policy"] for r in got["run.jsonl"]] == ["predictive", "hedge"]  # no trace: the file's stem
    assert [r["policy"] for r in read_datasets([gz], {gz: "hedge"})["run.jsonl"]] == ["hedge"]
    with pytest.raises(ValueError, match=r"no row of policy 'ttft_timeout' \(policies in the file: hedge, predictive"):
        read_datasets([gz], {gz: "ttft_timeout"})


# --- replaying another prefill rule ------------------------------------------------------------------------------

def replay_rows(slope: float | None) -> list[dict]:
    """Unqueued requests 2 s apart whose TTFT is 0.1 s + 1 ms per prompt token, recorded with ``slope`` on a base of
    0.4 s at 150 tokens; one queued request (8 in flight, a slot-full engine) whose 9 s wait is no prefill sample;
    and a last 2,000-token prompt."""
    out = []
    prompts = [100, 1100, 300, 2100, 150, 1600, 120, 900, 200, 1300]
    for i, p in enumerate(prompts):
        r = row(400.0, 100.0 + p, now=2.0 * i, prefill_s_per_token=slope, base_prefill_tokens=150.0)
        r["admission"]["prompt_tokens"] = p
        out.append(r)
    out.append(row(5000.0, 9000.0, in_flight=8, now=21.0, prefill_s_per_token=slope, base_prefill_tokens=150.0))
    last = row(400.0, 2100.0, in_flight=1, now=30.0, prefill_s_per_token=slope, base_prefill_tokens=150.0)
    last["admission"]["prompt_tokens"] = 2000
    return [*out, last]


@pytest.mark.parametrize("rule, want_ms", [
    # the slope on the recorded base: 0.4 s + 1 ms per token beyond its 150 tokens
    ("theil-sen", 400.0 + 1850.0),
    ("weighted", 400.0 + 1850.0),
    # the gateway's line, fitted on the samples: 0.1 s + 1 ms per token
    ("gateway", 100.0 + 2000.0),
])
def test_with_prefill_line_rebuilds_the_samples_and_moves_the_estimate(rule, want_ms):
    from lmfleet.bench.loto import LINES, REPLAY_MIN_SAMPLES, with_prefill_line
    from lmfleet.overflow.estimators import admission_of

    rows = replay_rows(None)
    out = with_prefill_line(rows, LINES[rule])
    got = [admission_of(r).signals.prefill_s_per_token for r in out]
    assert got[:REPLAY_MIN_SAMPLES] == [None] * REPLAY_MIN_SAMPLES  # too few rebuilt samples: as recorded
    assert got[-1] == pytest.approx(0.001)  # the queued request's 9 s is not a sample
    assert admission_of(out[-1]).estimate_ms == pytest.approx(want_ms)
    assert out[-1]["predicted_wait_ms"] == admission_of(out[-1]).estimate_ms
    assert admission_of(rows[-1]).estimate_ms == 400.0  # the input rows are not changed


def test_with_prefill_line_as_recorded_changes_nothing():
    from lmfleet.bench.loto import with_prefill_line
    from lmfleet.overflow.estimators import admission_of

    rows = replay_rows(0.001)
    out = with_prefill_line(rows, lambda samples, recorded: (recorded.base_ttft_s, recorded.base_prefill_tokens,
                                                             0.001))
    assert [admission_of(r).estimate_ms for r in out] == [admission_of(r).estimate_ms for r in rows]


def test_weighted_slope_lets_the_pairs_spanning_a_long_prompt_decide():
    """Short chats at 0.5 ms per token and one long prompt that cost more per token: the three pairs spanning the
    long prompt (8,100 tokens of spread) outweigh the three short ones (1,200); the plain median of the six slopes
    lies between (0.8 ms)."""
    from lmfleet.bench.loto import weighted_prefill_slope
    from lmfleet.overflow.signals import prefill_slope

    samples = [(100, 0.20), (400, 0.35), (700, 0.50), (3100, 3.5)]
    assert weighted_prefill_slope(samples) == pytest.approx(3.15 / 2700)
    assert prefill_slope(samples) == pytest.approx(0.0008)
    assert weighted_prefill_slope(samples[:2]) is None  # one pair: fewer than PREFILL_MIN_PAIRS

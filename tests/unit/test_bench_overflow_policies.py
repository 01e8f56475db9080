"""benchmarks/bench_overflow_policies.py: its figures from replayed requests, as tables (no fleet)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overflow_policies",
                                                  ROOT / "benchmarks" / "bench_overflow_policies.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def outcome(bench, i, ttft, *, served="local/smollm2", reason="local_ok", hedged=False, est=None, status=200,
            prompt=100, output=10, sent=0.0, e2e=None):
    return bench.Outcome(i, prompt, output, sent, ttft, e2e if e2e is not None else (ttft or 0) + 1, status,
                         served, reason, hedged, est)


@pytest.mark.parametrize("reason,hedged,both,after_cancel", [
    ("local_ok", False, False, False),
    ("queue_estimate_above_threshold", False, False, False),
    ("ttft_timeout", False, True, True),
    ("hedge_won", True, True, True),
    ("hedge_local_won", True, True, False),
])
def test_paths(bench, reason, hedged, both, after_cancel):
    o = outcome(bench, 0, 1.0, reason=reason, hedged=hedged)
    assert (o.both_sent, o.after_cancel) == (both, after_cancel)


def test_summarize(bench):
    outs = [
        outcome(bench, 0, 0.5),
        outcome(bench, 1, 3.0),  # kept local, missed the 2.5 s SLO
        outcome(bench, 2, 0.4, served="provider/backup", reason="queue_estimate_above_threshold"),
        outcome(bench, 3, 2.9, served="provider/backup", reason="ttft_timeout", prompt=300),
        outcome(bench, 4, 1.8, served="provider/backup", reason="hedge_won", hedged=True, prompt=200),
        outcome(bench, 5, None, status=503),
    ]
    r = bench.summarize(outs, slo_s=2.5, spend_usd=0.002)
    assert r["requests"] == 6 and r["errors"] == 1
    assert r["slo_attainment"] == pytest.approx(3 / 6)  # an error misses the SLO
    assert r["external_share"] == pytest.approx(3 / 5)
    assert r["prompt_tokens"] == 900 and r["prompt_tokens_sent_twice"] == 500
    assert r["sent_twice_share"] == pytest.approx(500 / 900)
    assert r["answered_after_cancel"] == 2 and r["hedged"] == 1
    tokens = sum(o.prompt_tokens + o.output_tokens for o in outs if o.ok)
    assert r["usd_per_1m_tokens"] == pytest.approx(0.002 / tokens * 1e6)
    assert r["ttft_p50_ms"] == pytest.approx(1800)
    assert r["kept_local_ttft_p99_ms"] == pytest.approx(500 + (3000 - 500) * 0.99)


def test_summarize_nothing(bench):
    r = bench.summarize([], slo_s=2.5, spend_usd=0.0)
    assert r["requests"] == 0 and r["slo_attainment"] == 0.0 and math.isnan(r["ttft_p99_ms"])
    assert r["usd_per_1m_tokens"] is None


def test_estimate_line(bench):
    e = {"requests": 4, "median_abs_error_ms": 120.0, "p90_abs_error_ms": 600.0, "p90_abs_error_pct_of_threshold": 24.0,
         "bias_ms": -50.0, "median_actual_over_predicted": 0.9}
    assert bench.estimate_line("predictive", "round 2", e) == (
        "  predictive   round 2: n=4 median |err| 120 ms, P90 |err| 600 ms "
        "(24 % of threshold), bias -50 ms, median actual/predicted 0.9")


def test_pooled_estimate_counts_local_answers_with_an_estimate(bench):
    outs = [outcome(bench, 0, 1.0, est=800.0), outcome(bench, 1, 0.5, est=1000.0),
            outcome(bench, 2, 3.0, est=900.0, served="provider/backup"),  # spilled: no local wait
            outcome(bench, 3, 2.0),  # no estimate header
            outcome(bench, 4, None, est=500.0, status=503)]  # not answered
    e = bench.pooled_estimate(outs, threshold_ms=2500)
    assert e["requests"] == 2 and e["median_abs_error_ms"] == pytest.approx(350.0)  # |+200|, |-500|
    assert e["p90_abs_error_pct_of_threshold"] == pytest.approx(round(100 * (200 + 0.9 * 300) / 2500, 1))
    assert bench.pooled_estimate(outs[2:], threshold_ms=2500) is None


def test_service_samples_mark_queued(bench):
    # two slots: the third request arrives while the first two still stream, the fourth after they end
    outs = [outcome(bench, 0, 0.2, sent=0.0, e2e=5.0), outcome(bench, 1, 0.2, sent=1.0, e2e=5.0),
            outcome(bench, 2, 4.0, sent=2.0, e2e=8.0), outcome(bench, 3, 0.3, sent=9.0, e2e=1.0),
            outcome(bench, 4, None, status=503, sent=2.5)]
    samples = bench.service_samples([outs], slots=2)
    assert [s.queued for s in samples] == [False, False, True, False]
    assert samples[2].ttft_s == 4.0
    # a second round of the same trace starts again at 0 s: its requests do not queue behind the first round's
    again = bench.service_samples([outs, outs], slots=2)
    assert [s.queued for s in again] == [False, False, True, False] * 2


def test_service_samples_behind_a_prefill_or_from_a_provider(bench):
    # a free slot, but the first request is still before its first token: the second's TTFT includes that wait;
    # a provider's answer is no sample and holds no slot
    outs = [outcome(bench, 0, 2.0, sent=0.0, e2e=3.0), outcome(bench, 1, 0.3, sent=1.0, e2e=2.0),
            outcome(bench, 2, 0.1, sent=1.5, e2e=9.0, served="provider/backup"),
            outcome(bench, 3, 0.3, sent=2.5, e2e=2.0)]
    samples = bench.service_samples([outs], slots=4)
    assert [(s.ttft_s, s.queued) for s in samples] == [(2.0, False), (0.3, True), (0.3, False)]


def test_table_lists_every_policy(bench):
    r = bench.summarize([outcome(bench, 0, 0.5)], slo_s=2.5, spend_usd=0.0)
    text = bench.table({"predictive": r, "local only": r}, oracle_usd=None)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].count("---") == lines[0].count("|") - 1
    assert "| predictive |" in lines[2] and "n/a" in lines[2]


def args_for(bench, **kw):
    import argparse

    base = dict(trace=None, shape="gamma", duration=90.0, seed=1, smoke=False, max_model_len=4096)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("smoke,spec", [
    (False, dict(duration_s=90.0, burst_s=8.0, burst_every_s=45.0)),
    (True, dict(duration_s=8.0, burst_s=2.0, burst_every_s=12.0, long_prompt=(200, 600))),
])
def test_the_default_workload_is_the_bursty_trace(bench, smoke, spec):
    from lmfleet.bench.trace import TraceSpec, bursty_trace

    a = args_for(bench, smoke=smoke, duration=spec["duration_s"])
    trace, info = bench.workload(a, 0.8)
    assert trace == bursty_trace(TraceSpec(capacity_rps=0.8, **spec), 1)
    assert bench.workload(a, None)[0] == bursty_trace(TraceSpec(capacity_rps=1.0, **spec), 2)  # calibration
    assert info["kind"] == "shape" and info["name"] == "gamma" and "burst_load 3.5" in info["describe"]


EXCERPT = ROOT / "tests" / "unit" / "data" / "azure_trace" / "AzureLLMInferenceTrace_code_excerpt.csv"


@pytest.mark.parametrize("option,smoke,n,load", [("", False, 20, 1.3), ("", True, 12, 1.3),
                                                 (":requests=5:load=2", False, 5, 2.0)])
def test_a_trace_replay_defaults_to_a_window_and_a_load(bench, option, smoke, n, load):
    a = args_for(bench, trace=f"azure:{EXCERPT}{option}", smoke=smoke)
    trace, info = bench.workload(a, 0.5)
    assert len(trace) == n and info["kind"] == "trace" and info["load"] == load
    assert info["mean_rps"] == pytest.approx(load * 0.5) and "CC-BY 4.0" in info["attribution"]
    assert info["max_model_len"] == 4096 - bench.CONTEXT_MARGIN
    cal, cal_info = bench.workload(a, None)  # calibration: the same requests, unpaced
    assert [r.prompt_tokens for r in cal] == [r.prompt_tokens for r in trace] and cal_info["time_factor"] == 1.0


def test_a_bad_trace_fails_before_the_fleet_starts(bench, tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_overflow_policies.py"), "--trace",
                           f"azure:{tmp_path / 'none.csv'}", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "does not exist" in done.stderr and "fleet" not in done.stdout


@pytest.mark.parametrize("shape", ["onoff", "ramp", "prefill", "output"])
@pytest.mark.parametrize("smoke", [False, True])
def test_every_shape_builds_a_trace_and_names_its_knobs(bench, shape, smoke):
    import json

    a = args_for(bench, shape=shape, smoke=smoke, duration=8.0 if smoke else 90.0)
    trace, info = bench.workload(a, 2.0)
    assert trace and all(r.prompt_tokens + r.output_tokens <= 4096 for r in trace)
    assert info["name"] == shape and info["params"] and shape in info["describe"]
    json.dumps(info)  # summary.json


def _records(arm, rnd, rows):
    return [{"policy": arm, **({"round": rnd} if rnd else {}), "index": i, "prompt_tokens": p, "output_tokens": 5,
             "sent_s": sent, "ttft_s": ttft, "e2e_s": ttft + 4 * 0.1, "status": 200, "served_by": served,
             "route_reason": "", "hedged": False, "estimate_ms": None, "error": ""}
            for i, (p, sent, ttft, served) in enumerate(rows)]


def test_rounds_from_lines_with_and_without_round_numbers():
    from lmfleet.bench.overflow_figures import rounds_from_lines

    rows = [(100, 0.0, 0.2, "local/m"), (300, 5.0, 0.4, "local/m")]
    numbered = _records("local only", 1, rows) + _records("local only", 2, rows)
    unnumbered = _records("local only", None, rows) + _records("local only", None, rows)
    for recs in (numbered, unnumbered):
        got = rounds_from_lines(recs)
        assert list(got) == ["local only"] and [len(r) for r in got["local only"]] == [2, 2]
        assert got["local only"][1][1].prompt_tokens == 300


def test_refit_oracle_from_a_saved_run():
    # prefill 0.1 s + 1 ms/token, 0.1 s per output token; one slot; SLO 1 s: the second request arrives while the
    # first holds the slot until 0.7 s, so its 0.4 s prefill would end at 1.1 s: spilling the cheaper first one
    # lets it meet the SLO
    from lmfleet.bench.overflow_figures import refit_oracle

    local = [(100, 0.0, 0.2, "local/m"), (300, 0.05, 0.4, "local/m"), (200, 10.0, 0.3, "local/m")]
    recs = _records("local only", 1, local) + _records("predictive", 1, local)
    summary = {"threshold_ms": 1000, "rounds": 1, "max_num_seqs": 1, "results": {"local only": {}, "predictive": {}},
               "price": {"input_per_1m": 1.0, "output_per_1m": 2.0}}
    o = refit_oracle(summary, recs)
    assert o["model"]["prefill_base_s"] == pytest.approx(0.1) and o["model"]["prefill_s_per_token"] == pytest.approx(
        0.001)
    assert o["model"]["decode_s_per_token"] == pytest.approx(0.1)
    assert (o["spilled"], o["of"], o["refit"]) == (1, 3, True)
    assert o["spend_usd"] == pytest.approx((100 * 1.0 + 5 * 2.0) / 1e6)
    assert "plan_check" not in o
    # the lower bound: the engine prefilled 400 tokens in the 0.45 s to the second first token (889 tokens/s), at
    # which every request fits the 1 s SLO: nothing need be spilled
    assert o["bound"] == {"rate_tps": pytest.approx(888.9), "spend_usd": 0.0}
    # an oracle plan arm: the first request spilled; the last one missed the SLO, which the model does not predict
    plan = [(100, 0.0, 0.3, "provider/x"), (300, 0.05, 0.4, "local/m"), (200, 10.0, 1.2, "local/m")]
    checked = refit_oracle(summary, recs + _records("oracle plan", 1, plan))
    assert checked["plan_check"] == [{"round": 1, "local": 2, "missed": 1, "predicted": 0}]
    with pytest.raises(ValueError, match="no local only arm"):
        refit_oracle(summary, _records("predictive", 1, local))


@pytest.mark.parametrize("states,polls", [
    ([(0, 0, 0)], 1),  # idle at once
    ([(None, None, 0)], 1),  # no engine counts (metrics off, or an idle engine's series expired): idle
    ([(8, 0, 0), (8, 3, 0), (1, 0, 0), (0, 0, 0)], 4),  # requests that reached the engine past the gateway
    ([(0, 0, 2), (0, 0, 0)], 2),  # the gateway's own streams still open
])
def test_each_arm_starts_on_idle_engines(bench, monkeypatch, states, polls):
    """Between arms the bench waits for the engines to finish what earlier arms left (LiteLLM's abandoned
    requests keep running past the gateway) so the next arm does not start behind an unseen backlog."""
    seen = []

    def admin(url, method, path, body=None):
        running, waiting, in_flight = states[min(len(seen), len(states) - 1)]
        seen.append(path)
        return {"models": {bench.MODEL: {"engine_running": running, "engine_waiting": waiting,
                                         "in_flight": in_flight}}}

    monkeypatch.setattr(bench, "admin", admin)
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    bench.wait_engines_idle("http://gw", 300)
    assert seen == ["/admin/state"] * polls


def test_a_smoke_run_reads_the_engines_once_and_goes_on(bench, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "admin", lambda *a, **k: seen.append(a) or {
        "models": {bench.MODEL: {"engine_running": 8, "engine_waiting": 0, "in_flight": 0}}})
    bench.wait_engines_idle("http://gw", 0)
    assert len(seen) == 1

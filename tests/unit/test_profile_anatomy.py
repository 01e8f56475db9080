"""The request-anatomy arithmetic (lmfleet profile): histogram sums in, per-model split of end-to-end time out."""

from __future__ import annotations

import pytest

from lmfleet.profile.anatomy import (
    Sums,
    anatomies,
    anatomy,
    diff,
    engine_settled,
    engine_source,
    engine_sums,
    from_json,
    gateway_sums,
    render_table,
    to_json,
)

RAY_PAGE = """\
# HELP ray_vllm_request_queue_time_seconds queue
# TYPE ray_vllm_request_queue_time_seconds histogram
ray_vllm_request_queue_time_seconds_bucket{le="0.3",model_name="m",WorkerId="a"} 2.0
ray_vllm_request_queue_time_seconds_sum{model_name="m",WorkerId="a"} 0.5
ray_vllm_request_queue_time_seconds_count{model_name="m",WorkerId="a"} 2.0
ray_vllm_request_queue_time_seconds_sum{model_name="m",WorkerId="b"} 0.25
ray_vllm_request_queue_time_seconds_count{model_name="m",WorkerId="b"} 1.0
ray_vllm_request_prefill_time_seconds_sum{model_name="m",WorkerId="a"} 0.3
ray_vllm_request_prefill_time_seconds_count{model_name="m",WorkerId="a"} 3.0
ray_vllm_e2e_request_latency_seconds_sum{model_name="m",WorkerId="a"} 3.0
ray_vllm_e2e_request_latency_seconds_count{model_name="m",WorkerId="a"} 3.0
ray_vllm_num_requests_running{model_name="m",WorkerId="a"} 1.0
ray_vllm_request_decode_time_seconds_sum{WorkerId="a"} 9.0
"""

BARE_PAGE = """\
vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 1.5
vllm:request_decode_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="other"} 2.0
vllm:request_decode_time_seconds_count{engine="0",model_name="other"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} NaN
"""


@pytest.mark.parametrize("pages, expected", [
    ([], {}),
    ([RAY_PAGE], {"m": {"queue": Sums(0.75, 3), "prefill": Sums(0.3, 3), "e2e": Sums(3.0, 3)}}),
    ([BARE_PAGE], {"m": {"decode": Sums(1.5, 3)}, "other": {"decode": Sums(2.0, 1)}}),
    ([RAY_PAGE, BARE_PAGE], {"m": {"queue": Sums(0.75, 3), "prefill": Sums(0.3, 3), "e2e": Sums(3.0, 3),
                                   "decode": Sums(1.5, 3)}, "other": {"decode": Sums(2.0, 1)}}),
    (["ray_vllm_request_queue_time_seconds_sum{model_name=\"m\" 1\n", BARE_PAGE],  # malformed page: skipped
     {"m": {"decode": Sums(1.5, 3)}, "other": {"decode": Sums(2.0, 1)}}),
    (["ray_vllm_num_requests_running{model_name=\"m\"} 4\n"], {}),
], ids=["none", "ray-two-workers", "bare-two-models", "two-pages", "malformed", "gauges-only"])
def test_engine_sums(pages, expected):
    assert engine_sums(pages) == expected


@pytest.mark.parametrize("samples, expected", [
    ([("lmfleet_request_latency_seconds_sum", {"model": "m", "served_by": "local/m"}, 2.0),
      ("lmfleet_request_latency_seconds_count", {"model": "m", "served_by": "local/m"}, 4.0),
      ("lmfleet_request_latency_seconds_count", {"model": "m", "served_by": "provider/p"}, 9.0),
      ("lmfleet_gateway_prepare_seconds_sum", {"model": "m"}, 0.01),
      ("lmfleet_gateway_prepare_seconds_count", {"model": "m"}, 5.0),
      ("lmfleet_gateway_prepare_seconds_bucket", {"model": "m", "le": "0.001"}, 5.0),
      ("lmfleet_time_to_first_token_seconds_sum", {"model": "m", "served_by": "local/m"}, 0.4),
      ("lmfleet_time_to_first_token_seconds_count", {"model": "m", "served_by": "local/m"}, 4.0)],
     {"m": {"e2e": Sums(2.0, 4), "prepare": Sums(0.01, 5), "ttft": Sums(0.4, 4)}}),
    ([("lmfleet_requests_total", {"model": "m", "served_by": "local/m", "status": "200"}, 3.0)], {}),
    ([("lmfleet_request_latency_seconds_sum", {"served_by": "local/m"}, 1.0)], {}),
], ids=["local-only-e2e", "other-metric", "no-model-label"])
def test_gateway_sums(samples, expected):
    assert gateway_sums(samples) == expected


def test_diff_subtracts_and_restarts_count_from_zero():
    before = {"m": {"queue": Sums(1.0, 10), "decode": Sums(5.0, 10)}}
    after = {"m": {"queue": Sums(1.5, 12), "decode": Sums(0.5, 1)}, "n": {"queue": Sums(0.2, 1)}}
    assert diff(after, before) == {"m": {"queue": Sums(0.5, 2), "decode": Sums(0.5, 1)},
                                   "n": {"queue": Sums(0.2, 1)}}


def _g(e2e=(1.0, 4), prepare=(0.008, 4), ttft=(0.4, 4)):
    return {"e2e": Sums(*e2e), "prepare": Sums(*prepare), "ttft": Sums(*ttft)}


def _e(queue=(0.04, 4), prefill=(0.2, 4), decode=(0.6, 4), e2e=(0.84, 4), ttft=(0.3, 4)):
    return {"queue": Sums(*queue), "prefill": Sums(*prefill), "decode": Sums(*decode), "e2e": Sums(*e2e),
            "ttft": Sums(*ttft)}


# (gateway window sums, engine window sums) -> (phase ms: gateway, queue, prefill, decode, relay), note fragment
ANATOMY_CASES = [
    (_g(), _e(), (2.0, 10.0, 50.0, 150.0, 38.0), None),
    (_g(e2e=(0.8, 4)), _e(), (2.0, 10.0, 50.0, 150.0, 0.0), "Ray's bucket-midpoint approximations) add up"),
    (_g(e2e=(0.8, 4)), _e(), (2.0, 10.0, 50.0, 150.0, 0.0), "add up to more than"),
    (_g(), {}, (2.0, None, None, None, None), "no engine figures"),
    (_g(), _e(e2e=(1.0, 5)), (2.0, 10.0, 50.0, 150.0, 38.0), "the engines finished 5 requests"),
    ({"prepare": Sums(0.002, 2)}, {}, (1.0, None, None, None, None), "no locally served request"),
]


@pytest.mark.parametrize("gw, eng, phases_ms, note", ANATOMY_CASES,
                         ids=["split", "ray-exceeds", "engine-exceeds", "no-engine", "other-traffic", "no-local"])
def test_anatomy_split(gw, eng, phases_ms, note):
    a = anatomy("m", gw, eng, engine_approximate=note is not None and "Ray" in note)
    got = tuple(None if a.phase_s(p) is None else round(a.phase_s(p) * 1000, 6) for p in a.PHASES)
    assert got == phases_ms
    if note is None:
        assert a.notes == ()
        assert sum(a.phase_s(p) for p in a.PHASES) == pytest.approx(a.e2e_s)
        assert sum(a.share(p) for p in a.PHASES) == pytest.approx(100.0)
    else:
        assert any(note in n for n in a.notes), a.notes


def test_anatomy_as_dict_and_table():
    rows = anatomies({"m": _g()}, {"m": _e(), "z": {"queue": Sums(0.1, 1)}})
    assert [r.model for r in rows] == ["m", "z"]
    d = rows[0].as_dict()
    assert d["requests"] == 4 and d["e2e_ms"] == 250.0 and d["ttft_ms"] == 100.0 and d["engine_ttft_ms"] == 75.0
    assert d["phases_ms"] == {"gateway": 2.0, "queue": 10.0, "prefill": 50.0, "decode": 150.0, "relay": 38.0}
    assert d["phases_pct"] == {"gateway": 0.8, "queue": 4.0, "prefill": 20.0, "decode": 60.0, "relay": 15.2}
    assert d["exact_ms"] == {"gateway": 2.0, "to_first_token": 98.0, "streaming": 150.0}
    assert not d["engine_approximate"] and d["notes"] == []
    approx = anatomies({"m": _g()}, {"m": _e()}, engine_approximate=True)[0]
    assert approx.engine_approximate and any("bucket-midpoint" in n for n in approx.notes)
    approx_line = render_table([approx]).splitlines()[2]
    assert "~10.0 (4%)" in approx_line and " 2.0 (1%)" in approx_line
    table = render_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["model", "requests", "e2e"]
    assert "150.0 (60%)" in lines[2] and lines[2].startswith("m ")
    assert lines[3].startswith("z ") and "-" in lines[3]


@pytest.mark.parametrize("gw, eng, settled", [
    ({"m": {"e2e": Sums(1, 4)}}, {"m": {"e2e": Sums(1, 4)}}, True),
    ({"m": {"e2e": Sums(1, 4)}}, {"m": {"e2e": Sums(1, 3)}}, False),
    ({"m": {"e2e": Sums(1, 4)}}, {}, False),
    ({"m": {"prepare": Sums(1, 4)}}, {}, True),  # nothing served locally: nothing to wait for
    ({}, {}, True),
], ids=["caught-up", "behind", "no-engine", "no-local", "empty"])
def test_engine_settled(gw, eng, settled):
    assert engine_settled(gw, eng) is settled


def test_json_round_trip_and_malformed_entries():
    snap = {"m": {"queue": Sums(0.5, 2)}, "n": {"e2e": Sums(1.0, 1)}}
    assert from_json(to_json(snap)) == snap
    assert from_json({"m": {"queue": [1, "x"], "decode": [1, 2]}, "n": "bad"}) == {"m": {"decode": Sums(1, 2)}}
    assert from_json(None) == {}


@pytest.mark.parametrize("pages, source", [([RAY_PAGE], "ray"), ([BARE_PAGE], None),
                                           (["vllm:request_queue_time_seconds_count{model_name=\"m\"} 1\n"], "vllm"),
                                           ([], None)])
def test_engine_source(pages, source):
    assert engine_source(pages) == source

"""Per-replica load and prefix-cache hit rate from Ray's metrics pages, in /admin/state and /metrics."""

from __future__ import annotations

import httpx
import pytest

from lmfleet.gateway.routing.pollers import EngineStatsPoller
from lmfleet.overflow.engine_stats import (ReplicaStats, imbalance, merge_replicas, parse_replica_pages,
                                          parse_replica_stats, since)
from lmfleet.testing.gateway_fakes import make_gateway

# the shape of a Ray node's page (labels trimmed): counters with Prometheus' _total suffix, and _created samples
RAY = """# TYPE ray_vllm_num_requests_running gauge
ray_vllm_num_requests_running{ReplicaId="r1",engine="0",model_name="m"} 3.0
ray_vllm_num_requests_running{ReplicaId="r2",engine="0",model_name="m"} 1.0
ray_vllm_num_requests_waiting{ReplicaId="r1",engine="0",model_name="m"} 2.0
ray_vllm_num_requests_waiting_by_reason{ReplicaId="r1",engine="0",model_name="m",reason="capacity"} 2.0
ray_vllm_prefix_cache_hits_total{ReplicaId="r1",engine="0",model_name="m"} 900.0
ray_vllm_prefix_cache_queries_total{ReplicaId="r1",engine="0",model_name="m"} 1000.0
ray_vllm_prefix_cache_queries_created{ReplicaId="r1",engine="0",model_name="m"} 1.7e9
ray_vllm_prefix_cache_hits_total{ReplicaId="r2",engine="0",model_name="m"} 0.0
ray_vllm_prefix_cache_queries_total{ReplicaId="r2",engine="0",model_name="m"} 500.0
ray_vllm_request_success_total{ReplicaId="r1",engine="0",finished_reason="length",model_name="m"} 7.0
ray_vllm_request_success_total{ReplicaId="r1",engine="0",finished_reason="stop",model_name="m"} 3.0
ray_vllm_request_success_total{ReplicaId="r2",engine="0",finished_reason="stop",model_name="m"} 2.0
ray_vllm_prefix_cache_hits_total{ReplicaId="x",engine="0"} 5.0
ray_vllm_prefix_cache_hits_total{ReplicaId="y",engine="0",model_name="m2"} NaN
"""

BARE = """vllm:num_requests_running{engine="0",model_name="b"} 2.0
vllm:prefix_cache_hits_total{engine="0",model_name="b"} 30.0
vllm:prefix_cache_queries_total{engine="0",model_name="b"} 120.0
"""

NO_SUFFIX = """ray_vllm_prefix_cache_hits{ReplicaId="r1",engine="0",model_name="m"} 10.0
ray_vllm_prefix_cache_queries{ReplicaId="r1",engine="0",model_name="m"} 40.0
ray_vllm_prefix_cache_hits{ReplicaId="r1",engine="1",model_name="m"} 10.0
ray_vllm_prefix_cache_queries{ReplicaId="r1",engine="1",model_name="m"} 40.0
"""


@pytest.mark.parametrize("text, expected", [
    (RAY, {"m": {"r1": ReplicaStats(3, 2, 900, 1000, 10), "r2": ReplicaStats(1, 0, 0, 500, 2)}}),
    (BARE, {"b": {"": ReplicaStats(2, 0, 30, 120, 0)}}),  # a bare vLLM server: one replica without an id
    (NO_SUFFIX, {"m": {"r1": ReplicaStats(0, 0, 20, 80, 0)}}),  # two engines of one replica add up
    ("", {}),
    ('ray_vllm_prefix_cache_hits_total{model_name="m"} oops\n', {}),  # a malformed page gives nothing
])
def test_parse_replica_stats(text, expected):
    assert parse_replica_stats(text) == expected


@pytest.mark.parametrize("stats, rate, load", [
    (ReplicaStats(3, 2, 900, 1000, 10), 0.9, 5),
    (ReplicaStats(1, 0, 0, 500, 2), 0.0, 1),
    (ReplicaStats(), None, 0),  # no prompt yet: no rate (not 0)
])
def test_hit_rate_and_load(stats, rate, load):
    assert stats.prefix_cache_hit_rate == rate and stats.load == load


@pytest.mark.parametrize("loads, expected", [([], 0), ([5], 0), ([5, 1], 4), ([0, 9, 3], 9)])
def test_imbalance(loads, expected):
    assert imbalance({str(i): ReplicaStats(running=n) for i, n in enumerate(loads)}) == expected


def test_since_counts_counters_between_two_polls_and_restarts_from_zero():
    before = {"r1": ReplicaStats(0, 0, 100, 200, 5), "r2": ReplicaStats(0, 0, 50, 100, 9)}
    after = {"r1": ReplicaStats(4, 1, 160, 300, 8), "r2": ReplicaStats(0, 0, 10, 20, 1), "r3": ReplicaStats(0, 0, 1, 2, 1)}
    assert since(before, after) == {"r1": ReplicaStats(4, 1, 60, 100, 3),
                                    "r2": ReplicaStats(0, 0, 10, 20, 1),  # restarted engine: counts from zero
                                    "r3": ReplicaStats(0, 0, 1, 2, 1)}  # new replica


def test_pages_of_several_nodes_merge():
    assert parse_replica_pages([RAY, BARE]) == merge_replicas([parse_replica_stats(RAY), parse_replica_stats(BARE)])
    assert set(parse_replica_pages([RAY, BARE])) == {"m", "b"}


async def test_admin_state_and_metrics_show_replicas(tmp_path):
    app = make_gateway(tmp_path, lambda req: httpx.Response(500), extra={"models": [
        {"name": "m", "source": "builtin:tiny-random",
         "deployment": {"replicas": 2, "request_router": "prefix_aware"}}]})
    gw = app.state.gateway
    gw.engine_stats = EngineStatsPoller({"m": gw.models["m"].local.tracker}, fetch=lambda: [RAY])
    gw.engine_stats.apply([RAY])
    auth = {"authorization": "Bearer adm"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        state = (await c.get("/admin/state", headers=auth)).json()["models"]["m"]
        metrics = (await c.get("/metrics", headers=auth)).text
    assert state["request_router"] == "prefix_aware"
    assert state["load_imbalance"] == 4  # r1: 3 running + 2 waiting, r2: 1 running
    assert state["prefix_cache_hit_rate"] == 0.6  # 900 of 1500 prompt tokens
    assert state["replicas"]["r1"] == {"running": 3, "waiting": 2, "requests_finished": 10, "prefix_cache_hits": 900,
                                       "prefix_cache_queries": 1000, "prefix_cache_hit_rate": 0.9}
    assert 'lmfleet_replica_requests_finished{model="m",replica="r2"} 2.0' in metrics
    assert 'lmfleet_replica_prefix_cache_hit_tokens{model="m",replica="r1"} 900.0' in metrics
    assert 'lmfleet_replica_load_imbalance{model="m"} 4.0' in metrics
    assert 'model="m2"' not in metrics  # models this gateway does not serve are left out


async def test_admin_state_without_engine_figures(tmp_path):
    app = make_gateway(tmp_path, lambda req: httpx.Response(500))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        state = (await c.get("/admin/state", headers={"authorization": "Bearer adm"})).json()["models"]["m"]
    assert (state["request_router"], state["replicas"], state["prefix_cache_hit_rate"], state["load_imbalance"]) == (
        "default", {}, None, 0)


def test_cluster_status_shows_each_replica_of_admin_state():
    from lmfleet.cluster.status import ClusterStatus, parse_gateway_state, render_status

    state = {"models": {"m": {"in_flight": 6, "request_router": "prefix_aware", "replicas": {
        "r1": {"running": 3, "waiting": 2, "requests_finished": 10, "prefix_cache_hit_rate": 0.9},
        "r2": {"running": 1, "waiting": 0, "requests_finished": 2, "prefix_cache_hit_rate": None}}}}}
    text = render_status(ClusterStatus([], [], load=parse_gateway_state(state)))
    lines = text.splitlines()
    assert "Replicas (engines, from Ray's metrics pages)" in lines
    assert any(line.split() == ["m", "prefix_aware", "r1", "3", "2", "10", "90%"] for line in lines), text
    assert any(line.split() == ["m", "prefix_aware", "r2", "1", "0", "2", "-"] for line in lines), text
    assert "Replicas" not in render_status(ClusterStatus([], [], load=parse_gateway_state({"models": {"m": {}}})))

"""vLLM's queue gauges read from a Ray node's metrics page (recorded from a real fleet) or a vLLM /metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmfleet.gateway.routing.pollers import EngineStatsPoller
from lmfleet.overflow.engine_stats import EngineQueue, merge, parse_engine_queues
from lmfleet.overflow.signals import LoadTracker

RAY_PAGE = (Path(__file__).parent / "data" / "ray_node_metrics_vllm.txt").read_text()

BARE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 5.0
"""

TWO_REPLICAS = """ray_vllm_num_requests_running{ReplicaId="a",engine="0",model_name="big"} 8.0
ray_vllm_num_requests_running{ReplicaId="b",engine="0",model_name="big"} 6.0
ray_vllm_num_requests_waiting{ReplicaId="a",engine="0",model_name="big"} 4.0
ray_vllm_num_requests_waiting{ReplicaId="b",engine="0",model_name="big"} 0.0
ray_vllm_num_requests_running{ReplicaId="c",engine="0",model_name="small"} 1.0
ray_vllm_num_requests_running{ReplicaId="d",engine="0"} 9.0
ray_vllm_num_requests_waiting{ReplicaId="e",engine="0",model_name="small"} NaN
"""


@pytest.mark.parametrize("text,expected", [
    (RAY_PAGE, {"smollm2": EngineQueue(32, 0)}),  # recorded: 32 streams running, waiting_by_reason ignored
    (BARE, {"m": EngineQueue(3, 5)}),
    (TWO_REPLICAS, {"big": EngineQueue(14, 4), "small": EngineQueue(1, 0)}),  # no model_name / NaN: skipped
    ("", {}),
    ("ray_vllm_num_requests_running{model_name=\"x\"} not-a-number\n", {}),
    ("# only comments\nray_serve_deployment_queued_queries{a=\"b\"} 3\n", {}),
])
def test_parse_engine_queues(text, expected):
    assert parse_engine_queues(text) == expected


def test_pages_of_several_nodes_add_up():
    assert merge([parse_engine_queues(TWO_REPLICAS), parse_engine_queues(BARE.replace('"m"', '"big"'))]) == {
        "big": EngineQueue(17, 9), "small": EngineQueue(1, 0)}


def test_poller_sets_the_trackers_of_models_it_saw():
    clock = [100.0]
    big, other = LoadTracker(8, clock=lambda: clock[0]), LoadTracker(8, clock=lambda: clock[0])
    poller = EngineStatsPoller({"big": big, "other": other}, fetch=lambda: [TWO_REPLICAS])
    poller.apply([TWO_REPLICAS])
    s = big.snapshot()
    assert (s.engine_running, s.engine_waiting) == (14, 4)
    assert other.snapshot().engine_running is None  # no figures for it: the estimate keeps gateway signals
    clock[0] += 60  # the figures age out when scrapes stop
    assert big.snapshot().engine_running is None

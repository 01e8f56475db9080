"""``serving_capacity``: a model's capacity while fewer replicas run than configured (a rollout, a lost node)."""

from __future__ import annotations

import pytest

from lmfleet.config import parse_config
from lmfleet.overflow.estimator import local_capacity, serving_capacity


def model(deployment: dict, engine: dict | None = None):
    return parse_config({"models": [{"name": "m", "source": "builtin:tiny-random", "deployment": deployment,
                                     "engine": engine or {}}]}).models[0]


# (deployment, engine, running Serve replicas, capacity counted)
CASES = [
    ({"replicas": 2, "max_ongoing_requests": 8}, None, 2, 16),
    ({"replicas": 2, "max_ongoing_requests": 8}, None, 1, 8),      # one of two replaced: half
    ({"replicas": 2, "max_ongoing_requests": 8}, None, 3, 16),     # a surge replica: no more than configured
    ({"replicas": 2, "max_ongoing_requests": 8}, None, 0, 16),     # unknown (starting, or no status): as configured
    ({"replicas": 3, "max_ongoing_requests": 1}, None, 1, 1),      # never below 1
    ({"replicas": 1, "max_ongoing_requests": 8}, None, 1, 8),
    ({"replicas": 2, "max_ongoing_requests": 8}, {"data_parallel_size": 2}, 2, 16),  # 4 ranks, 2 running
    ({"autoscaling": {"min_replicas": 2, "max_replicas": 4}, "max_ongoing_requests": 8}, None, 1, 8),
    ({"autoscaling": {"min_replicas": 2, "max_replicas": 4}, "max_ongoing_requests": 8}, None, 4, 16),
    ({"disaggregation": {"kv_connector": "NixlConnector", "decode": {"replicas": 2}}}, None, 1, 128),
]


@pytest.mark.parametrize(("deployment", "engine", "running", "capacity"), CASES)
def test_serving_capacity(deployment: dict, engine: dict | None, running: int, capacity: int) -> None:
    m = model(deployment, engine)
    assert serving_capacity(m, local_capacity(m), running) == capacity

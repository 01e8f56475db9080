"""GatewayMetrics' per-request helpers: the same histogram figures as ``labels(model).observe``, one child per model."""

from __future__ import annotations

import pytest

from lmfleet.gateway.observe.metrics import GatewayMetrics


def sample(metrics: GatewayMetrics, name: str, model: str) -> tuple[float, float]:
    """(observations, those at or below 1 s): a histogram with negative buckets exposes no ``_sum``."""
    reg = metrics.registry
    return (reg.get_sample_value(f"{name}_count", {"model": model}),
            reg.get_sample_value(f"{name}_bucket", {"model": model, "le": "1.0"}))


@pytest.mark.parametrize("observe,name", [
    ("observe_estimate_error", "lmfleet_queue_estimate_error_seconds"),
    ("observe_prepare", "lmfleet_gateway_prepare_seconds"),
])
def test_helpers_observe_per_model(observe, name):
    m = GatewayMetrics()
    for model, seconds in (("a", 0.5), ("a", -0.25), ("b", 2.0)):
        getattr(m, observe)(model, seconds)
    assert sample(m, name, "a") == (2.0, 2.0)
    assert sample(m, name, "b") == (1.0, 0.0)

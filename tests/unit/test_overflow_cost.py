"""Cost functions: provider prices, local hourly cost, $/token spreading and the meter."""

import pytest

from lmfleet.config.models import ModelConfig, ProviderPrice
from lmfleet.overflow.cost import LocalCostMeter, external_cost_usd, local_hourly_cost_usd, local_usd_per_token


@pytest.mark.parametrize(
    "inp, out, pin, pout, expected",
    [
        (0, 0, 1.0, 2.0, 0.0),
        (1_000_000, 0, 0.15, 0.60, 0.15),
        (0, 1_000_000, 0.15, 0.60, 0.60),
        (1000, 500, 0.15, 0.60, 1000 * 0.15e-6 + 500 * 0.60e-6),
        (1000, 500, 0.0, 0.0, 0.0),
    ],
)
def test_external_cost(inp, out, pin, pout, expected):
    assert external_cost_usd(inp, out, ProviderPrice(input_per_1m=pin, output_per_1m=pout)) == pytest.approx(expected)


@pytest.mark.parametrize(
    "engine, deployment, cost, uses_gpus, replicas, expected",
    [
        ({}, {"replicas": 1}, {"gpu_hour_usd": 2.0}, True, None, 2.0),
        ({"tensor_parallel_size": 2}, {"replicas": 3}, {"gpu_hour_usd": 2.0}, True, None, 12.0),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {"replicas": 1}, {"gpu_hour_usd": 1.5}, True, None, 6.0),
        ({}, {"replicas": 2}, {"node_hour_usd": 0.1, "gpu_hour_usd": 9.0}, False, None, 0.2),
        ({}, {"autoscaling": {"min_replicas": 1, "max_replicas": 4}}, {"gpu_hour_usd": 1.0}, True, 3, 3.0),
        # data parallel: D x TP x PP GPUs per replica
        ({"data_parallel_size": 8, "tensor_parallel_size": 2}, {"replicas": 2}, {"gpu_hour_usd": 1.0}, True, None, 32.0),
        # prefill/decode split: both pools (prefill 2 x DP 4, decode 1 x DP 8)
        ({}, {"disaggregation": {"kv_connector": "NixlConnector", "prefill": {"replicas": 2, "engine": {
            "data_parallel_size": 4}}, "decode": {"replicas": 1, "engine": {"data_parallel_size": 8}}}},
         {"gpu_hour_usd": 2.0}, True, None, 32.0),
    ],
)
def test_local_hourly_cost(engine, deployment, cost, uses_gpus, replicas, expected):
    m = ModelConfig(name="m", source="builtin:tiny-random", engine=engine, deployment=deployment, cost=cost)
    assert local_hourly_cost_usd(m, uses_gpus=uses_gpus, replicas=replicas) == pytest.approx(expected)


@pytest.mark.parametrize(
    "hourly, interval, tokens, floor, expected",
    [
        (3.6, 3600, 3_600_000, 0, 1e-6),
        (3.6, 1800, 1_800_000, 0, 1e-6),  # half an hour: half the cost over half the tokens
        (3.6, 3600, 0, 0, 0.0),  # nothing served and no floor: nothing to charge
        (3.6, 3600, 100, 10_000, 3.6 / 10_000),  # idle hour: the floor caps the per-token price
        (3.6, 3600, 50_000, 10_000, 3.6 / 50_000),  # busy: measured throughput wins
        (0.0, 3600, 1000, 0, 0.0),
    ],
)
def test_local_usd_per_token(hourly, interval, tokens, floor, expected):
    assert local_usd_per_token(hourly, interval, tokens, floor) == pytest.approx(expected)


def test_local_usd_per_token_rejects_empty_interval():
    with pytest.raises(ValueError):
        local_usd_per_token(1.0, 0, 10)


def test_meter_spreads_hourly_cost_over_steady_load():
    t = [0.0]
    meter = LocalCostMeter(3.6, window_s=3600, min_tokens_per_hour=1, clock=lambda: t[0])
    total = 0.0
    for _ in range(7200):  # two hours, 1000 output tokens every second
        t[0] += 1.0
        meter.record(1000)
        total += meter.request_cost_usd(1000)
    # steady state: each hour's requests add up to the hour's cost
    assert total == pytest.approx(2 * 3.6, rel=1e-3)


@pytest.mark.parametrize("age_s, tokens, expected", [(10.0, 1000, 3.6 * 10 / 3600 / 1000), (0.0, 1000, 3.6 / 3600 / 1000)])
def test_meter_young_window(age_s, tokens, expected):
    t = [0.0]
    meter = LocalCostMeter(3.6, window_s=3600, min_tokens_per_hour=1, clock=lambda: t[0])
    t[0] = age_s
    meter.record(tokens)
    assert meter.usd_per_output_token() == pytest.approx(expected)


def test_meter_window_forgets_old_tokens():
    meter = LocalCostMeter(3.6, window_s=100, min_tokens_per_hour=36_000, clock=lambda: 0.0)
    meter.record(10**9, now=1.0)
    assert meter.usd_per_output_token(now=50.0) < 1e-9
    # after the window: floor of 36,000 tokens/h -> 1e-4 $/token
    assert meter.usd_per_output_token(now=500.0) == pytest.approx(1e-4)


def test_meter_for_model_uses_cost_config():
    m = ModelConfig(name="m", source="builtin:tiny-random",
                    cost={"node_hour_usd": 0.5, "attribution_window_s": 600, "min_output_tokens_per_hour": 5000})
    meter = LocalCostMeter.for_model(m, uses_gpus=False, clock=lambda: 0.0)
    assert (meter.hourly_cost_usd, meter.window_s, meter.min_tokens_per_hour) == (0.5, 600, 5000)

"""engine.log_metrics: Ray Serve LLM's log_engine_metrics and vLLM's disable_log_stats from one switch."""

from __future__ import annotations

import pytest

from lmfleet.config import ConfigError, parse_config
from lmfleet.engine.app import llm_config_kwargs


def _model(engine: dict):
    return parse_config({"models": [{"name": "m", "source": "builtin:tiny-random", "engine": engine}]}).models[0]


@pytest.mark.parametrize("engine, log_engine_metrics, disable_log_stats", [
    ({}, True, None),  # the default: Ray's metrics on (the gateway's engine queue counts come from them)
    ({"log_metrics": True}, True, None),
    ({"log_metrics": False}, False, True),  # no statistics at all; Ray refuses disable_log_stats with its metrics on
])
def test_log_metrics_sets_both_switches(engine, log_engine_metrics, disable_log_stats):
    kw = llm_config_kwargs(_model(engine), "/weights")
    assert kw["log_engine_metrics"] is log_engine_metrics
    assert kw["engine_kwargs"].get("disable_log_stats") is disable_log_stats
    assert "log_metrics" not in kw["engine_kwargs"]


def test_ray_accepts_what_log_metrics_builds():
    from ray.serve.llm import LLMConfig

    for flag in (True, False):
        LLMConfig(**llm_config_kwargs(_model({"log_metrics": flag}), "/weights"))


def test_log_metrics_must_be_a_boolean():
    with pytest.raises(ConfigError, match="log_metrics"):
        _model({"log_metrics": "sometimes"})

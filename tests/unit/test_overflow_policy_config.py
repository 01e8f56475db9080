"""``overflow.policy`` and its timers: each policy's required key, keys of another policy, a provider."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lmfleet.config.models import FleetConfig, OverflowPolicyConfig

PROVIDER = {"name": "p", "base_url": "http://x/v1", "model_map": {"m": "remote-m"}}


def _fleet(overflow: dict, providers: list | None = None) -> FleetConfig:
    return FleetConfig.model_validate({
        "models": [{"name": "m", "source": "builtin:tiny-random", "overflow": overflow}],
        "providers": [PROVIDER] if providers is None else providers})


@pytest.mark.parametrize("overflow", [
    {},
    {"policy": "predictive"},
    {"policy": "on_error"},
    {"policy": "ttft_timeout", "ttft_timeout_ms": 2500},
    {"policy": "hedge", "hedge_after_ms": 2000},
])
def test_valid_policies(overflow):
    cfg = _fleet(overflow).models[0].overflow
    assert cfg.policy == overflow.get("policy", "predictive")


@pytest.mark.parametrize("overflow, words", [
    ({"policy": "ttft_timeout"}, ["needs overflow.ttft_timeout_ms"]),
    ({"policy": "hedge"}, ["needs overflow.hedge_after_ms"]),
    ({"policy": "predictive", "hedge_after_ms": 100}, ["hedge_after_ms=100", "'predictive'"]),
    ({"policy": "hedge", "hedge_after_ms": 100, "ttft_timeout_ms": 100}, ["ttft_timeout_ms=100", "'hedge'"]),
    ({"policy": "ttft_timeout", "ttft_timeout_ms": 60_000}, ["local_first_token_timeout_s=60.0 s (60000 ms)"]),
    ({"policy": "ttft_timeout", "ttft_timeout_ms": 0}, ["greater than 0"]),
    ({"policy": "retry"}, ["predictive", "hedge"]),
])
def test_invalid_policy_settings_say_what_to_change(overflow, words):
    with pytest.raises(ValidationError) as e:
        OverflowPolicyConfig.model_validate(overflow)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("policy, extra", [("on_error", {}), ("hedge", {"hedge_after_ms": 2000}),
                                           ("ttft_timeout", {"ttft_timeout_ms": 2500})])
def test_policies_that_spill_need_a_provider_for_the_model(policy, extra):
    with pytest.raises(ValidationError, match="no provider's model_map names this model"):
        _fleet({"policy": policy, **extra}, providers=[])
    with pytest.raises(ValidationError, match="no provider's model_map names this model"):
        _fleet({"policy": policy, "providers": ["q"], **extra},
               providers=[PROVIDER, {**PROVIDER, "name": "q", "model_map": {"other": "x"}}])


def test_predictive_without_a_provider_is_fine():
    assert _fleet({}, providers=[]).models[0].overflow.policy == "predictive"

"""The LiteLLM arm's pure parts: its proxy config, which backend answered, and the provider's bill."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmfleet.bench.overflow_figures import LITELLM_FALLBACK, Outcome, provider_bill_usd, summarize
from lmfleet.config.models import ProviderPrice
from lmfleet.testing.litellm_proxy import MASTER_KEY_ENV, answered_by_provider, arm_model, litellm_bin, litellm_config

SERVE = "http://127.0.0.1:8001/smollm2/v1"
PROVIDER = "http://127.0.0.1:9000/v1"


@pytest.mark.parametrize("timeout_s,name", [(2.5, "smollm2-litellm-2500ms"), (1.5, "smollm2-litellm-1500ms"),
                                            (0.25, "smollm2-litellm-250ms")])
def test_arm_model(timeout_s, name):
    assert arm_model("smollm2", timeout_s) == name


def test_config_routes_each_timeout_to_serve_with_a_fallback_to_the_provider():
    cfg = litellm_config("smollm2", SERVE, PROVIDER, "smollm2-remote", "BENCH_PROVIDER_KEY", [2.5, 1.5])
    groups = {m["model_name"]: m["litellm_params"] for m in cfg["model_list"]}
    assert list(groups) == ["smollm2-litellm-2500ms", "smollm2-litellm-2500ms-provider",
                            "smollm2-litellm-1500ms", "smollm2-litellm-1500ms-provider"]
    for t in (2.5, 1.5):
        local, remote = groups[arm_model("smollm2", t)], groups[f"{arm_model('smollm2', t)}-provider"]
        assert local["api_base"] == SERVE and local["model"] == "openai/smollm2" and local["stream_timeout"] == t
        assert remote["api_base"] == PROVIDER and remote["model"] == "openai/smollm2-remote"
        assert remote["api_key"] == "os.environ/BENCH_PROVIDER_KEY" and "stream_timeout" not in remote
        assert local["max_retries"] == remote["max_retries"] == 0
    assert cfg["router_settings"]["fallbacks"] == [{"smollm2-litellm-2500ms": ["smollm2-litellm-2500ms-provider"]},
                                                   {"smollm2-litellm-1500ms": ["smollm2-litellm-1500ms-provider"]}]
    assert cfg["router_settings"]["num_retries"] == cfg["litellm_settings"]["num_retries"] == 0
    assert cfg["general_settings"]["master_key"] == f"os.environ/{MASTER_KEY_ENV}"
    assert yaml.safe_load(yaml.safe_dump(cfg)) == cfg  # what the proxy reads


@pytest.mark.parametrize("timeouts", [[], [0.0], [1.0, -1.0]])
def test_config_needs_positive_timeouts(timeouts):
    with pytest.raises(ValueError, match="stream_timeouts_s"):
        litellm_config("m", SERVE, PROVIDER, "r", "K", timeouts)


@pytest.mark.parametrize("headers,expected", [
    ({"x-litellm-model-api-base": PROVIDER, "x-litellm-attempted-fallbacks": "1"}, True),
    ({"x-litellm-model-api-base": PROVIDER + "/"}, True),
    ({"x-litellm-model-api-base": SERVE, "x-litellm-attempted-fallbacks": "0"}, False),
    ({"x-litellm-attempted-fallbacks": "1"}, True),  # no api base: the fallback count says it
    ({"x-litellm-attempted-fallbacks": "x"}, False),
    ({}, False),
])
def test_answered_by_provider(headers, expected):
    assert answered_by_provider(headers, PROVIDER) is expected


def test_litellm_bin_says_how_to_install_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="make litellm"):
        litellm_bin(tmp_path)
    exe = tmp_path / ".venv-litellm" / "bin" / "litellm"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert litellm_bin(tmp_path) == exe and isinstance(exe, Path)


def test_the_bill_counts_the_providers_answers_and_a_fallback_sent_the_prompt_twice():
    def o(i, served, reason, status=200, ttft=1.0):
        return Outcome(i, 1000, 100, 0.0, ttft, 2.0, status, served, reason)

    outs = [o(0, "local/smollm2", "local_ok"), o(1, "provider/litellm-fallback", LITELLM_FALLBACK),
            o(2, "provider/litellm-fallback", LITELLM_FALLBACK, status=0, ttft=None)]  # failed: not billed
    price = ProviderPrice(input_per_1m=0.5, output_per_1m=1.5)
    assert provider_bill_usd(outs, price) == pytest.approx((1000 * 0.5 + 100 * 1.5) / 1e6)
    assert outs[1].both_sent and outs[1].after_cancel and not outs[0].both_sent
    r = summarize(outs, slo_s=2.5, spend_usd=provider_bill_usd(outs, price))
    assert r["prompt_tokens_sent_twice"] == 2000 and r["answered_after_cancel"] == 1 and r["errors"] == 1

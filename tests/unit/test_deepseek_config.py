"""DeepSeek patterns in fleet.yaml: data/expert parallelism and prefill/decode disaggregation, validated with key paths."""

from __future__ import annotations

from typing import Any

import pytest

from lmfleet.config import ConfigError, parse_config
from lmfleet.engine.app import kv_transfer_config, llm_config_kwargs, pool_llm_config_kwargs

FOUR_BY_EIGHT = {"head": {"address": "10.0.0.10"}, "workers": [{"address": f"10.0.0.1{i}"} for i in (1, 2, 3)],
                 "gpus_per_node": 8}


def _fleet(engine: dict[str, Any] | None = None, deployment: dict[str, Any] | None = None,
           cluster: dict[str, Any] | None = None):
    return parse_config({"cluster": cluster or {}, "models": [{
        "name": "ds", "source": "deepseek-ai/DeepSeek-V3", "engine": {"device": "gpu", **(engine or {})},
        "deployment": deployment or {}}]})


@pytest.mark.parametrize("engine,deployment,cluster,match", [
    # DP x TP x PP GPUs of one replica against the GPUs the cluster section describes
    ({"data_parallel_size": 64}, {}, FOUR_BY_EIGHT,
     r"models\[0\] \(ds\): engine.data_parallel_size=64 x tensor_parallel_size=1 x pipeline_parallel_size=1 = 64 "
     r"GPUs .* 32 GPUs on 4 node"),
    ({"data_parallel_size": 8, "tensor_parallel_size": 8}, {}, FOUR_BY_EIGHT, "= 64 GPUs"),
    ({}, {"disaggregation": {"kv_connector": "NixlConnector", "decode": {"engine": {"data_parallel_size": 40}}}},
     FOUR_BY_EIGHT, r"deployment.disaggregation.decode.engine.data_parallel_size=40"),
    # a split needs a connector, and its pools' engine options are engine options
    ({}, {"disaggregation": {"prefill": {"replicas": 2}}}, {}, r"deployment.disaggregation.kv_connector"),
    ({}, {"disaggregation": {"kv_connector": "FooConnector"}}, {}, r"deployment.disaggregation.kv_connector"),
    ({}, {"disaggregation": {"kv_connector": "NixlConnector", "prefill": {"engine": {"tensor_parallel": 8}}}}, {},
     r"prefill.engine.*unknown engine options \['tensor_parallel'\]"),
    ({}, {"disaggregation": {"kv_connector": "NixlConnector", "decode": {"engine": {"data_parallel_size": 0}}}}, {},
     r"deployment.disaggregation.decode.engine: data_parallel_size"),
    ({}, {"disaggregation": {"kv_connector": "NixlConnector", "decode": {"engine": {"device": "cpu"}}}}, {},
     r"decode.engine.*engine.device"),
    ({}, {"disaggregation": {"kv_connector": "NixlConnector"}, "autoscaling": {"max_replicas": 2}}, {},
     r"deployment.autoscaling and deployment.disaggregation"),
    ({"data_parallel_size": 0}, {}, {}, r"engine.data_parallel_size"),
    ({"all2all_backend": "deepep"}, {}, {}, r"engine.all2all_backend"),
])
def test_invalid_deepseek_configs_name_the_key(engine, deployment, cluster, match):
    with pytest.raises(ConfigError, match=match):
        _fleet(engine, deployment, cluster)


@pytest.mark.parametrize("engine,deployment,cluster", [
    ({"data_parallel_size": 32, "enable_expert_parallel": True}, {}, FOUR_BY_EIGHT),  # exactly the cluster
    ({"data_parallel_size": 64}, {}, {}),  # no nodes described: nothing to compare with
    ({"data_parallel_size": 64, "device": "cpu"}, {}, FOUR_BY_EIGHT),  # CPU engines do not take GPUs
    ({"enable_expert_parallel": True}, {}, {}),  # EP on an unknown model is a check warning, not a config error
    ({}, {"disaggregation": {"kv_connector": "ExampleConnector"}}, {}),
])
def test_valid_deepseek_configs_load(engine, deployment, cluster):
    _fleet(engine, deployment, cluster)


def test_engines_without_dp_or_ep_get_the_same_vllm_kwargs_as_before():
    kw = _fleet().models[0].engine.vllm_kwargs()
    assert not {"data_parallel_size", "enable_expert_parallel", "enable_eplb", "all2all_backend",
                "expert_placement_strategy"} & set(kw)


def test_dp_and_ep_options_reach_vllm():
    e = _fleet({"data_parallel_size": 8, "enable_expert_parallel": True, "enable_eplb": True,
                "all2all_backend": "deepep_low_latency", "expert_placement_strategy": "round_robin"}).models[0].engine
    want = {"data_parallel_size": 8, "enable_expert_parallel": True, "enable_eplb": True,
            "all2all_backend": "deepep_low_latency", "expert_placement_strategy": "round_robin"}
    assert e.vllm_kwargs().items() >= want.items()


SPLIT = {"max_ongoing_requests": 32, "disaggregation": {
    "kv_connector": "NixlConnector", "kv_connector_options": {"backends": ["UCX"]}, "kv_buffer_device": "cuda",
    "prefill": {"replicas": 3, "engine": {"tensor_parallel_size": 8, "max_num_batched_tokens": 16384}},
    "decode": {"replicas": 2, "max_ongoing_requests": 128, "engine": {"data_parallel_size": 4}}}}


@pytest.mark.parametrize("role,replicas,max_ongoing,engine", [
    ("prefill", 3, 32, {"tensor_parallel_size": 8, "max_num_batched_tokens": 16384, "max_model_len": 8192}),
    ("decode", 2, 128, {"tensor_parallel_size": 2, "data_parallel_size": 4, "max_model_len": 8192}),
])
def test_each_pool_is_the_model_with_its_overrides(role, replicas, max_ongoing, engine):
    m = _fleet({"tensor_parallel_size": 2, "max_model_len": 8192}, SPLIT).models[0]
    kw = pool_llm_config_kwargs(m, "/w", role)
    assert kw["deployment_config"]["num_replicas"] == replicas
    assert kw["deployment_config"]["max_ongoing_requests"] == max_ongoing
    assert kw["engine_kwargs"].items() >= engine.items()
    assert kw["engine_kwargs"]["kv_transfer_config"] == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": {"backends": ["UCX"]}, "kv_buffer_device": "cuda"}
    assert len(kw["placement_group_config"]["bundles"]) == engine["tensor_parallel_size"]


def test_unsplit_models_have_no_kv_transfer_config():
    m = _fleet().models[0]
    assert "kv_transfer_config" not in llm_config_kwargs(m, "/w")["engine_kwargs"]
    with pytest.raises(ValueError, match="no deployment.disaggregation"):
        kv_transfer_config(m, "prefill")

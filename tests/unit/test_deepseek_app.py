"""DeepSeek serving patterns as Ray builds them: our config -> Ray Serve LLM's real builders -> the application graph.

No deploy and no GPU: ``bind_app`` calls ``build_dp_openai_app`` / ``build_pd_openai_app`` for real and the tests read
the resulting deployments (names, replica counts, gang scheduling, placement bundles, engine kwargs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmfleet.config import parse_config
from lmfleet.engine.app import bind_app, model_llm_configs, resolve_model, serving_pattern

WEIGHTS = "/weights/deepseek-v3"  # never read: LLMConfig only records the path


pytestmark = pytest.mark.usefixtures("driver_runtime_env")  # tests/unit/conftest.py


def _model(engine: dict[str, Any], deployment: dict[str, Any] | None = None, device: str = "gpu"):
    cfg = parse_config({"models": [{"name": "ds", "source": "deepseek-ai/DeepSeek-V3",
                                    "engine": {"device": device, **engine}, "deployment": deployment or {}}]})
    return cfg.models[0]


def _deployments(app) -> dict[str, Any]:
    """Every deployment of an application graph by name (the ingress, and each bound deployment under it)."""
    from ray.serve.deployment import Application

    out: dict[str, Any] = {}

    def walk(node: Any) -> None:
        if isinstance(node, Application):
            d = node._bound_deployment
            out[d.name] = d
            for v in [*d.init_args, *d.init_kwargs.values()]:
                walk(v)
            if node._ingress_request_router is not None:
                walk(node._ingress_request_router)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)

    walk(app)
    return out


def _graph(m):
    llm, prefill = model_llm_configs(m, WEIGHTS)
    from dataclasses import replace

    return _deployments(bind_app(replace(resolve_model(m, WEIGHTS, llm_config=llm), prefill_llm_config=prefill)))


def _engine_kwargs(d) -> dict[str, Any]:
    return d.init_kwargs["llm_config"].engine_kwargs


@pytest.mark.parametrize("engine,deployment,pattern", [
    ({}, {}, "single"),
    ({"data_parallel_size": 8}, {}, "data_parallel"),
    ({"data_parallel_size": 8, "enable_expert_parallel": True}, {"replicas": 2}, "data_parallel"),
    ({}, {"disaggregation": {"kv_connector": "NixlConnector"}}, "prefill_decode"),
    ({"data_parallel_size": 4}, {"disaggregation": {"kv_connector": "NixlConnector"}}, "prefill_decode"),
])
def test_serving_pattern_follows_the_config(engine, deployment, pattern):
    assert serving_pattern(_model(engine, deployment)) == pattern


# ---- data-parallel attention + expert parallelism (wide EP) -------------------------------------------------
@pytest.mark.parametrize("dp,tp,replicas", [(8, 1, 1), (4, 2, 1), (8, 1, 2), (2, 4, 3)])
def test_dp_graph_is_a_gang_of_dp_serve_replicas_of_tp_gpus(dp, tp, replicas):
    m = _model({"data_parallel_size": dp, "tensor_parallel_size": tp, "enable_expert_parallel": True,
                "all2all_backend": "deepep_low_latency"}, {"replicas": replicas, "max_ongoing_requests": 32})
    graph = _graph(m)
    assert set(graph) == {"OpenAiIngress", "DPServer:ds"}
    d = graph["DPServer:ds"]
    cfg = d._deployment_config
    assert cfg.num_replicas == dp * replicas  # Ray counts DP ranks; our replicas are DP groups
    assert cfg.gang_scheduling_config.gang_size == dp
    assert cfg.max_ongoing_requests == 32
    # one rank = one replica = TP one-GPU bundles, the replica actor's CPU folded into the first
    assert d._replica_config.placement_group_bundles == [{"CPU": 1, "GPU": 1.0}] + [{"GPU": 1.0}] * (tp - 1)
    kw = _engine_kwargs(d)
    assert kw["data_parallel_size"] == dp and kw["tensor_parallel_size"] == tp
    assert kw["enable_expert_parallel"] is True and kw["all2all_backend"] == "deepep_low_latency"
    assert "kv_transfer_config" not in kw


def test_dp_autoscaling_bounds_count_dp_groups():
    m = _model({"data_parallel_size": 4},
               {"autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}})
    cfg = _graph(m)["DPServer:ds"]._deployment_config
    assert (cfg.autoscaling_config.min_replicas, cfg.autoscaling_config.max_replicas) == (4, 12)


def test_single_engine_models_keep_their_graph_and_kwargs():
    m = _model({"tensor_parallel_size": 8})
    graph = _graph(m)
    assert set(graph) == {"OpenAiIngress", "LLMServer:ds"}
    kw = _engine_kwargs(graph["LLMServer:ds"])
    assert not {"data_parallel_size", "enable_expert_parallel", "enable_eplb", "kv_transfer_config"} & set(kw)


# ---- prefill/decode disaggregation -----------------------------------------------------------------------
PD = {"disaggregation": {
    "kv_connector": "NixlConnector",
    "kv_connector_options": {"backends": ["UCX"]},
    "prefill": {"replicas": 2, "engine": {"tensor_parallel_size": 8, "max_num_batched_tokens": 16384}},
    "decode": {"replicas": 1, "max_ongoing_requests": 256,
               "engine": {"data_parallel_size": 8, "tensor_parallel_size": 1, "enable_expert_parallel": True}},
}}


def test_pd_graph_has_a_prefill_pool_behind_the_decode_pool():
    graph = _graph(_model({"tensor_parallel_size": 4, "max_model_len": 16384}, PD))
    assert set(graph) == {"OpenAiIngress", "Decode:ds", "Prefill:ds"}
    prefill, decode = graph["Prefill:ds"], graph["Decode:ds"]
    # decode orchestrates: it holds a handle to prefill (bound), the ingress only knows decode
    assert decode.init_kwargs["prefill_server"]._bound_deployment is prefill
    assert set(graph["OpenAiIngress"].init_kwargs["llm_deployments"]) == {"ds"}

    assert type(prefill.func_or_class).__name__ == "PDPrefillServer" or "PDPrefillServer" in str(prefill.func_or_class)
    assert prefill._deployment_config.num_replicas == 2
    assert prefill._replica_config.placement_group_bundles == [{"CPU": 1, "GPU": 1.0}] + [{"GPU": 1.0}] * 7
    pk = _engine_kwargs(prefill)
    assert pk["tensor_parallel_size"] == 8 and pk["max_num_batched_tokens"] == 16384 and pk["max_model_len"] == 16384
    assert pk["kv_transfer_config"] == {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                        "kv_connector_extra_config": {"backends": ["UCX"]}}

    # decode is a DP+EP pool: 8 gang-scheduled one-GPU ranks
    assert "DPPDDecodeServer" in str(decode.func_or_class)
    dc = decode._deployment_config
    assert dc.num_replicas == 8 and dc.gang_scheduling_config.gang_size == 8 and dc.max_ongoing_requests == 256
    assert decode._replica_config.placement_group_bundles == [{"CPU": 1, "GPU": 1.0}]
    dk = _engine_kwargs(decode)
    assert dk["data_parallel_size"] == 8 and dk["tensor_parallel_size"] == 1 and dk["enable_expert_parallel"] is True
    assert dk["kv_transfer_config"]["kv_role"] == "kv_consumer"


def test_pd_on_cpu_uses_cpu_bundles_and_the_shared_storage_connector():
    m = _model({}, {"disaggregation": {"kv_connector": "ExampleConnector",
                                       "kv_connector_options": {"shared_storage_path": "/tmp/kv"}}}, device="cpu")
    graph = _graph(m)
    for name, role in (("Prefill:ds", "kv_producer"), ("Decode:ds", "kv_consumer")):
        d = graph[name]
        assert d._replica_config.placement_group_bundles == [{"CPU": 2.0, "GPU": 0}]  # one CPU bundle + the actor
        assert _engine_kwargs(d)["kv_transfer_config"] == {
            "kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}


# ---- the shipped examples -----------------------------------------------------------------------------------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name,expect", [
    ("deepseek-v3-wide-ep.yaml", {"DPServer:deepseek-v3": (32, 32)}),
    ("deepseek-v3-pd.yaml", {"Prefill:deepseek-v3": (16, 8), "Decode:deepseek-v3": (16, 16)}),
])
def test_shipped_deepseek_examples_build_their_graphs(name, expect):
    from lmfleet.config import load_config

    graph = _graph(load_config(EXAMPLES / name).models[0])
    assert set(graph) == {"OpenAiIngress", *expect}
    for dep, (serve_replicas, gang) in expect.items():
        cfg = graph[dep]._deployment_config
        assert (cfg.num_replicas, cfg.gang_scheduling_config.gang_size) == (serve_replicas, gang)
        kw = _engine_kwargs(graph[dep])
        assert kw["enable_expert_parallel"] is True and kw["quantization"] == "fp8"

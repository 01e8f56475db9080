"""deployment.request_router: what each choice becomes for Ray Serve, and the combinations refused."""

from __future__ import annotations

import pytest

from lmfleet.config import ConfigError, parse_config
from lmfleet.config.models import DeploymentConfig, FleetConfig, ModelConfig
from lmfleet.engine.app import llm_config_kwargs, serve_deployment_options
from lmfleet.engine.routing import (FORWARD_BODY, RouterUnavailable, check_router_available, prefix_aware_kwargs,
                                    routing_env)

PREFIX = "lmfleet.engine.prefix_router.PrefixAffinityRouter"
DEFAULT_PREFIX_KWARGS = {"imbalanced_threshold": 4, "match_rate_threshold": 0.1, "do_eviction": True,
                         "eviction_threshold_chars": 400_000, "eviction_target_chars": 360_000,
                         "eviction_interval_secs": 10}


def fleet(deployment: dict | None = None, engine: dict | None = None, serve_proxy: str = "haproxy") -> dict:
    model = {"name": "m", "source": "builtin:tiny-random", "deployment": deployment or {}, "engine": engine or {}}
    return {"gateway": {"serve_proxy": serve_proxy}, "models": [model]}


@pytest.mark.parametrize("deployment, router_config", [
    ({}, None),
    ({"request_router": "default", "replicas": 2}, None),
    ({"request_router": "prefix_aware", "replicas": 2}, {"request_router_class": PREFIX,
                                                         "request_router_kwargs": DEFAULT_PREFIX_KWARGS}),
    ({"request_router": "prefix_aware", "prefix_aware": {"imbalance_threshold": 2, "match_rate_threshold": 0.5}},
     {"request_router_class": PREFIX, "request_router_kwargs": DEFAULT_PREFIX_KWARGS
      | {"imbalanced_threshold": 2, "match_rate_threshold": 0.5}}),
    ({"request_router": "prefix_aware", "prefix_aware": {"imbalance_threshold": None, "evict_above_chars": None}},
     {"request_router_class": PREFIX, "request_router_kwargs": {"match_rate_threshold": 0.1, "do_eviction": False}}),
    ({"request_router": "kv_aware"}, {"request_router_class": "ray.serve.llm.request_router.KVAwareRouter"}),
    ({"request_router": "round_robin"},
     {"request_router_class": "ray.serve.experimental.round_robin_router.RoundRobinRouter"}),
])
def test_router_choice_becomes_serve_request_router_config(deployment, router_config):
    cfg = parse_config(fleet(deployment), "fleet.yaml")
    opts = serve_deployment_options(cfg.models[0].deployment)
    assert opts.get("request_router_config") == router_config
    assert opts["num_replicas"] == cfg.models[0].deployment.replicas  # the rest of the options are untouched


@pytest.mark.parametrize("router, ray_class", [
    ("default", "PowerOfTwoChoicesRequestRouter"),
    ("prefix_aware", "PrefixAffinityRouter"),
    ("kv_aware", "KVAwareRouter"),
    ("round_robin", "RoundRobinRouter"),
])
def test_real_llm_config_resolves_to_rays_router_class(router, ray_class):
    """The kwargs build a real ``ray.serve.llm.LLMConfig`` and Ray's own config resolves the class we named."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig

    model = parse_config(fleet({"request_router": router, "replicas": 2}), "f").models[0]
    llm = LLMConfig(**llm_config_kwargs(model, "/weights"))
    rr = RequestRouterConfig(**llm.deployment_config.get("request_router_config", {}))
    assert rr.get_request_router_class().__name__ == ray_class
    if router == "prefix_aware":  # Ray's router (ours extends it) takes exactly these keyword arguments
        import inspect

        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        assert issubclass(rr.get_request_router_class(), PrefixCacheAffinityRouter)
        params = inspect.signature(PrefixCacheAffinityRouter.initialize_state).parameters
        assert set(rr.request_router_kwargs) <= set(params)


def test_kv_aware_is_what_rays_builder_detects():
    """Ray turns on engine KV events and pre-routing tokenization when its own ``is_kv_aware`` says so."""
    from ray.llm._internal.serve.routing_policies.kv_aware.kv_aware_router import is_kv_aware
    from ray.serve.llm import LLMConfig

    for router, expected in (("kv_aware", True), ("prefix_aware", False), ("default", False)):
        model = parse_config(fleet({"request_router": router}), "f").models[0]
        assert is_kv_aware(LLMConfig(**llm_config_kwargs(model, "/weights"))) is expected


@pytest.mark.parametrize("data, words", [
    (fleet({"request_router": "kv_aware"}, serve_proxy="serve"),
     ["models[0].deployment.request_router", "kv_aware", "gateway.serve_proxy", "'serve'"]),
    (fleet({"request_router": "prefix_aware"}, engine={"enable_prefix_caching": False}),
     ["models[0].deployment.request_router", "prefix_aware", "engine.enable_prefix_caching is false"]),
    (fleet({"request_router": "kv_aware"}, engine={"enable_prefix_caching": False}),
     ["kv_aware", "engine.enable_prefix_caching is false"]),
    (fleet({"request_router": "default", "prefix_aware": {"imbalance_threshold": 4}}),
     ["models[0].deployment", "prefix_aware options are set but request_router is 'default'"]),
    (fleet({"request_router": "least_loaded"}), ["models[0].deployment.request_router", "prefix_aware"]),
    (fleet({"request_router": "prefix_aware", "prefix_aware": {"imbalance_threshold": -1}}),
     ["prefix_aware.imbalance_threshold", "greater than or equal to 0"]),
    (fleet({"request_router": "prefix_aware", "prefix_aware": {"match_rate_threshold": 1.5}}),
     ["prefix_aware.match_rate_threshold", "less than or equal to 1"]),
    (fleet({"request_router": "prefix_aware", "prefix_aware": {"evict_above_chars": 5000, "evict_to_chars": 9000}}),
     ["evict_to_chars=9000 must be <= evict_above_chars=5000"]),
    (fleet({"request_router": "prefix_aware", "prefix_aware": {"imbalance": 4}}),
     ["prefix_aware.imbalance", "imbalance_threshold"]),  # did-you-mean
])
def test_invalid_router_configs_name_their_keys(data, words):
    with pytest.raises(ConfigError) as ei:
        parse_config(data, "fleet.yaml")
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


@pytest.mark.parametrize("data", [
    fleet({"request_router": "kv_aware"}),  # direct streaming is the default
    fleet({"request_router": "prefix_aware"}, serve_proxy="serve"),  # Serve's proxy reads the body itself
    fleet({"request_router": "prefix_aware"}, engine={"enable_prefix_caching": True}),
    fleet({"request_router": "round_robin"}, engine={"enable_prefix_caching": False}),
])
def test_valid_router_combinations(data):
    parse_config(data, "fleet.yaml")


@pytest.mark.parametrize("routers, serve_proxy, env", [
    (["default"], "haproxy", {}),
    (["round_robin"], "haproxy", {}),
    (["default", "prefix_aware"], "haproxy", {FORWARD_BODY: "1"}),
    (["kv_aware"], "haproxy", {FORWARD_BODY: "1"}),
    (["prefix_aware"], "serve", {}),  # no HAProxy: Serve's proxy hands the parsed request to the router
])
def test_routing_env_forwards_bodies_only_where_a_router_reads_them(routers, serve_proxy, env):
    models = [{"name": f"m{i}", "source": "builtin:tiny-random", "deployment": {"request_router": r}}
              for i, r in enumerate(routers)]
    assert routing_env(FleetConfig(gateway={"serve_proxy": serve_proxy}, models=models)) == env


@pytest.mark.parametrize("router, installed, raises", [
    ("kv_aware", False, True), ("kv_aware", True, False), ("prefix_aware", False, False), ("default", False, False),
])
def test_kv_aware_needs_ai_dynamo(router, installed, raises):
    model = ModelConfig(name="m", source="builtin:tiny-random", deployment={"request_router": router})
    find = (lambda name: object()) if installed else (lambda name: None)
    if raises:
        with pytest.raises(RouterUnavailable, match="ai-dynamo"):
            check_router_available(model, find_spec=find)
    else:
        check_router_available(model, find_spec=find)


def test_prefix_aware_defaults_bound_the_imbalance_where_ray_does_not():
    import inspect

    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

    ray_default = inspect.signature(PrefixCacheAffinityRouter.initialize_state).parameters["imbalanced_threshold"]
    assert ray_default.default == float("inf")  # if Ray starts bounding it, revisit our default and docs
    assert prefix_aware_kwargs(DeploymentConfig(request_router="prefix_aware"))["imbalanced_threshold"] == 4

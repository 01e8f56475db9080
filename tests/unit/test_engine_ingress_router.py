"""Under direct streaming a model with `request_router: default` is deployed without Serve's ingress request router.

HAProxy calls that router (LLMRouter, `POST /internal/route`) before every request only to learn a replica; with no
prompt-aware policy HAProxy's own balancing does the same job without the round trip (docs/benchmarks.md).
The real builders run here (no deploy, no Ray cluster).
"""

from __future__ import annotations

import pytest

from lmfleet.config import parse_config
from lmfleet.engine import app as engine_app
from lmfleet.engine.app import bind_app, model_llm_configs, resolve_model, skip_ingress_router

WEIGHTS = "/weights/smollm2"  # never read: LLMConfig only records the path


pytestmark = pytest.mark.usefixtures("driver_runtime_env")  # tests/unit/conftest.py


def _model(deployment: dict | None = None, engine: dict | None = None):
    cfg = parse_config({"models": [{"name": "m", "source": "builtin:smollm2", "engine": engine or {},
                                    "deployment": deployment or {}}]})
    return cfg.models[0]


@pytest.mark.parametrize("deployment, engine, direct, skip", [
    ({}, {}, True, True),                                          # default router, HAProxy: HAProxy balances
    ({}, {}, False, False),                                        # Serve's proxy: Ray's builder as is
    ({"request_router": "round_robin"}, {}, True, False),          # an explicit router keeps the router peer
    ({"request_router": "prefix_aware"}, {}, True, False),         # prompt-aware: needs the router
    ({"request_router": "prefix_aware"}, {}, False, False),
    ({}, {"data_parallel_size": 2, "device": "gpu"}, True, False),  # other patterns: Ray's builders as they are
])
def test_skip_ingress_router_table(deployment, engine, direct, skip):
    assert skip_ingress_router(_model(deployment, engine), direct_streaming=direct) is skip


def _bound(m):
    llm, _ = model_llm_configs(m, WEIGHTS)
    return bind_app(resolve_model(m, WEIGHTS, llm_config=llm))


def test_default_router_under_direct_streaming_has_no_router_peer(monkeypatch):
    monkeypatch.setattr(engine_app, "direct_streaming_enabled", lambda: True)
    app = _bound(_model())
    assert app._ingress_request_router is None
    d = app._bound_deployment
    assert d.name.startswith("LLMServer:")
    from ray.serve.llm import LLMServer

    assert issubclass(d.func_or_class, LLMServer)  # Ray's replica class, as its own builders deploy it
    # Serve refuses a request router class on an ingress deployment behind HAProxy: none is set
    rr = d._deployment_config.request_router_config
    assert rr.request_router_class.endswith("PowerOfTwoChoicesRequestRouter")


def test_prefix_aware_under_direct_streaming_keeps_the_router_peer(monkeypatch):
    monkeypatch.setattr(engine_app, "direct_streaming_enabled", lambda: True)
    m = _model({"request_router": "prefix_aware"})
    # Ray's builder reads the flag from its own constant: make it see direct streaming too
    import ray.llm._internal.serve.core.ingress.builder as ray_builder

    monkeypatch.setattr(ray_builder, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", True)
    app = _bound(m)
    assert app._ingress_request_router is not None

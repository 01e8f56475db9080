"""A model's Serve deployments carry lmfleet's version (:func:`lmfleet.engine.app.deployment_version`), so that a
redeploy keeps the replicas when only ``in place`` keys changed and replaces them, one at a time, when the engines
change. The real builders run and Ray Serve's own :class:`DeploymentVersion` decides (no deploy, no Ray cluster):
the test asks Serve what it would do with the running replicas of one build given the other."""

from __future__ import annotations

import pytest

from lmfleet.config import parse_config
from lmfleet.engine import app as engine_app
from lmfleet.engine.app import ROLLING_UPDATE_FRACTION, bind_app, deployment_version, model_llm_configs, resolve_model

WEIGHTS = "/weights/tiny"  # never read: LLMConfig only records the path


pytestmark = pytest.mark.usefixtures("driver_runtime_env")  # tests/unit/conftest.py


def _model(deployment: dict | None = None, engine: dict | None = None):
    data = {"models": [{"name": "m", "source": "builtin:tiny-random", "engine": {"device": "cpu", **(engine or {})},
                        "deployment": deployment or {}}]}
    return parse_config(data).models[0]


def _built(m) -> dict:
    """Deployment name -> Serve's DeploymentVersion of the model's application as ``serve.run`` would deploy it."""
    from ray.serve._private.build_app import build_app
    from ray.serve._private.version import DeploymentVersion

    llm, _ = model_llm_configs(m, WEIGHTS)
    built = build_app(bind_app(resolve_model(m, WEIGHTS, llm_config=llm)), name="lmfleet-m")
    out = {}
    for d in built.deployments:
        rc = d._replica_config
        out[d.name] = DeploymentVersion(d.version, d._deployment_config, rc.ray_actor_options,
                                        rc.placement_group_bundles, rc.placement_group_strategy,
                                        max_replicas_per_node=rc.max_replicas_per_node)
    return out


# (the running model's keys, the new file's, whether Serve restarts the replicas)
CASES = [
    (({}, {}), ({}, {}), False),
    (({"replicas": 1}, {}), ({"replicas": 2}, {}), False),
    (({"replicas": 2}, {}), ({"replicas": 1}, {}), False),
    (({}, {}), ({"autoscaling": {"min_replicas": 1, "max_replicas": 3}}, {}), False),
    (({"autoscaling": {"min_replicas": 1, "max_replicas": 3}}, {}),
     ({"autoscaling": {"min_replicas": 2, "max_replicas": 4}}, {}), False),
    (({}, {}), ({"max_ongoing_requests": 8}, {}), False),
    (({}, {}), ({}, {"max_num_seqs": 8}), True),
    (({}, {"max_num_seqs": 8}), ({"replicas": 2}, {"max_num_seqs": 4}), True),
    (({}, {}), ({}, {"max_model_len": 512}), True),
]


@pytest.mark.parametrize(("running", "new", "restart"), CASES)
@pytest.mark.parametrize("direct", [True, False])
def test_serve_keeps_the_replicas_unless_the_engines_change(monkeypatch, running, new, restart, direct):
    monkeypatch.setattr(engine_app, "direct_streaming_enabled", lambda: direct)
    before, after = _built(_model(*running)), _built(_model(*new))
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].requires_actor_restart(after[name]) is restart, name


def test_every_deployment_carries_the_version_and_is_replaced_one_at_a_time(monkeypatch):
    monkeypatch.setattr(engine_app, "direct_streaming_enabled", lambda: False)  # router + engine deployments
    m = _model()
    built = _built(m)
    assert len(built) >= 2
    for v in built.values():
        assert v.code_version == deployment_version(m)
        assert v.deployment_config.rolling_update_percentage == ROLLING_UPDATE_FRACTION
        assert v.deployment_config.max_surge_percent == 0  # the old replica stops first: no spare accelerator

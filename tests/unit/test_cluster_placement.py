"""Placement: Serve placement groups per model and the node plan for replicas / TP groups / PP stages."""

from __future__ import annotations

import pytest

from lmfleet.cluster.placement import NodeCapacity, nodes_from_cluster, placement_group_config, plan_placement
from lmfleet.config.models import ClusterConfig, ModelConfig


def model(name="m", tp=1, pp=1, replicas=1, strategy=None) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": name,
            "source": "builtin:tiny-random",
            "engine": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
            "deployment": {"replicas": replicas, "placement_strategy": strategy},
        }
    )


def gpu_nodes(*gpus: int) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", g) for i, g in enumerate(gpus)]


@pytest.mark.parametrize(
    ("m", "gpu", "expected"),
    [
        (model(), False, {"bundles": [{"CPU": 1}], "strategy": "STRICT_PACK"}),
        (model(tp=2), False, {"bundles": [{"CPU": 1}] * 2, "strategy": "STRICT_PACK"}),
        (model(tp=2, pp=2, strategy="SPREAD"), False, {"bundles": [{"CPU": 1}] * 4, "strategy": "STRICT_PACK"}),
        (model(), True, {"bundles": [{"GPU": 1}], "strategy": "STRICT_PACK"}),
        (model(tp=8), True, {"bundles": [{"GPU": 1}] * 8, "strategy": "STRICT_PACK"}),
        (model(tp=4, pp=2), True, {"bundles": [{"GPU": 1}] * 8, "strategy": "PACK"}),
        (model(tp=2, strategy="SPREAD"), True, {"bundles": [{"GPU": 1}] * 2, "strategy": "SPREAD"}),
    ],
)
def test_placement_group_config(m, gpu, expected):
    assert placement_group_config(m, gpu=gpu) == expected


@pytest.mark.parametrize("gpu", [False, True])
def test_placement_group_config_is_accepted_by_ray_serve_llm(gpu):
    from ray.llm._internal.common.placement import PlacementGroupConfig

    cfg = placement_group_config(model(tp=2, pp=2), gpu=gpu)
    assert PlacementGroupConfig(**cfg).model_dump(exclude_unset=True) == cfg


# (models, node GPUs, expected {model#replica: stage nodes}, problem substrings)
PLANS = [
    pytest.param([model(replicas=4)], (8, 8), {"m#0": ("n0",), "m#1": ("n1",), "m#2": ("n0",), "m#3": ("n1",)}, [],
                 id="replicas-spread"),
    pytest.param([model(tp=4, replicas=2)], (8, 8, 8, 8), {"m#0": ("n0",), "m#1": ("n1",)}, [], id="tp4-spread-4x8"),
    pytest.param([model(tp=8, replicas=4)], (8, 8, 8, 8),
                 {"m#0": ("n0",), "m#1": ("n1",), "m#2": ("n2",), "m#3": ("n3",)}, [], id="tp8-one-per-node"),
    pytest.param([model(tp=8, replicas=5)], (8, 8, 8, 8),
                 {f"m#{i}": (f"n{i}",) for i in range(4)}, ["replica 4: needs 1 group(s) of 8 GPUs"], id="tp8-too-many"),
    pytest.param([model(tp=8, pp=2)], (8, 8), {"m#0": ("n0", "n1")}, [], id="pp-spans-nodes"),
    pytest.param([model(tp=2, pp=2)], (8, 8), {"m#0": ("n0", "n0")}, [], id="pp-stays-when-it-fits"),
    pytest.param([model(tp=4, pp=3)], (8, 4, 4), {"m#0": ("n0", "n0", "n1")}, [], id="pp-packs-then-spills"),
    pytest.param([model(tp=16)], (8, 8), {}, ["tensor_parallel_size=16 needs 16 GPUs on one node", "never spans"],
                 id="tp-larger-than-node"),
    pytest.param([model(tp=4, pp=3)], (6, 6), {}, ["needs 3 group(s) of 4 GPUs (12 in all)"], id="tp-groups-cannot-split"),
    pytest.param([model("a", tp=4, replicas=2), model("b", tp=2, replicas=2)], (8, 8),
                 {"a#0": ("n0",), "a#1": ("n1",), "b#0": ("n0",), "b#1": ("n1",)}, [], id="two-models"),
    pytest.param([model()], (), {}, ["no nodes"], id="no-nodes"),
    pytest.param([model(replicas=3)], (0, 2, 1), {"m#0": ("n1",), "m#1": ("n2",), "m#2": ("n1",)}, [],
                 id="cpu-head-gpu-workers"),
]


@pytest.mark.parametrize(("models", "gpus", "expected", "problems"), PLANS)
def test_plan_placement_gpu(models, gpus, expected, problems):
    plan = plan_placement(models, gpu_nodes(*gpus), gpu=True)
    assert {f"{r.model}#{r.replica}": r.stage_nodes for r in plan.replicas} == expected
    assert plan.ok == (not problems)
    for want in problems:
        assert any(want in p for p in plan.problems), plan.problems
    for node, free in plan.free.items():
        assert free >= 0, (node, free)


@pytest.mark.parametrize(
    ("cpus", "replicas", "tp", "expected", "problem"),
    [
        ((1, 2, 2), 2, 1, {"m#0": ("n1",), "m#1": ("n2",)}, None),  # the e2e layout: head too small
        ((1, 2, 2), 3, 1, {"m#0": ("n1",), "m#1": ("n2",)}, "replica 2"),
        ((8,), 1, 2, {"m#0": ("n0",)}, None),
        ((2, 2), 1, 2, {}, "tp*pp+1=3 logical CPUs"),
    ],
)
def test_plan_placement_cpu(cpus, replicas, tp, expected, problem):
    nodes = [NodeCapacity(f"n{i}", 0, c) for i, c in enumerate(cpus)]
    plan = plan_placement([model(replicas=replicas, tp=tp)], nodes, gpu=False)
    assert {f"{r.model}#{r.replica}": r.stage_nodes for r in plan.replicas} == expected
    assert (problem is None) == plan.ok
    if problem:
        assert any(problem in p for p in plan.problems), plan.problems


def test_plan_explains_spans_and_free():
    plan = plan_placement([model(tp=8, pp=2)], gpu_nodes(8, 8, 8))
    text = plan.explain()
    assert "n0: m#0/pp0 (free 0)" in text and "n1: m#0/pp1 (free 0)" in text and "n2: - (free 8)" in text
    assert "pipeline stages span n0, n1" in text


def test_plan_is_deterministic():
    models = [model("a", tp=2, replicas=3), model("b", tp=1, replicas=5)]
    first = plan_placement(models, gpu_nodes(4, 4, 4))
    assert all(plan_placement(models, gpu_nodes(4, 4, 4)).replicas == first.replicas for _ in range(3))


def test_nodes_from_cluster_uses_per_node_gpus():
    c = ClusterConfig.model_validate(
        {"head": {"address": "h", "gpus": 0}, "workers": [{"address": "w1"}, {"address": "w2", "gpus": 4}],
         "gpus_per_node": 8}
    )
    assert [(n.name, n.gpus) for n in nodes_from_cluster(c)] == [("h", 0), ("w1", 8), ("w2", 4)]


@pytest.mark.parametrize(("device", "gpu", "resource"), [("cpu", None, "CPU"), ("gpu", None, "GPU"), ("cpu", True, "GPU")])
def test_serve_placement_follows_engine_device(device, gpu, resource):
    from lmfleet.cluster.placement import serve_placement

    m = ModelConfig.model_validate({"name": "m", "source": "builtin:tiny-random", "engine": {"device": device}})
    assert list(serve_placement(m, gpu=gpu)["bundles"][0]) == [resource]

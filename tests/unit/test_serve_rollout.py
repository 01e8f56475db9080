"""``lmfleet.serve.rollout``: which models a new fleet version redeploys, at what cost (a table), and the
``lmfleet serve`` process's follower handing them to Serve (fake build and deploy: no Ray)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from lmfleet.config import parse_config
from lmfleet.config.diff import diff_fleets
from lmfleet.serve.rollout import ServeFollower, describe, rollout_plan

BASE: dict[str, Any] = {
    "models": [{"name": "a", "source": "builtin:tiny-random", "overflow": {"providers": ["p"]}},
               {"name": "org/b:1", "source": "builtin:tiny-random"}],
    "providers": [{"name": "p", "base_url": "https://api.example.com/v1", "model_map": {"a": "pa"}}],
}


def fleet(**model_edits: dict[str, Any]) -> Any:
    """BASE with ``a={"deployment": {...}}``-style edits merged into the named model's sections."""
    data = copy.deepcopy(BASE)
    if "c" in model_edits:
        data["models"].append({"name": "c", "source": "builtin:tiny-random"})
    if "b" in model_edits and model_edits["b"] is None:
        data["models"] = [m for m in data["models"] if m["name"] != "org/b:1"]
    for m in data["models"]:
        for section, values in (model_edits.get(m["name"].removeprefix("org/").removesuffix(":1")) or {}).items():
            if isinstance(values, dict):
                m.setdefault(section, {}).update(values)
            else:
                m[section] = values
    return parse_config(data)


# (edits of the new file, the plan)
CASES = [
    ({}, {}),
    ({"a": {"overflow": {"threshold_ms": 900.0}}}, {}),  # gateway only
    ({"a": {"deployment": {"request_timeout_s": 30.0}}}, {}),  # read by the gateway
    ({"a": {"deployment": {"replicas": 2}}}, {"a": "in place"}),
    ({"a": {"deployment": {"autoscaling": {"min_replicas": 1, "max_replicas": 3}}}}, {"a": "in place"}),
    ({"a": {"deployment": {"max_ongoing_requests": 8}}}, {"a": "in place"}),
    ({"a": {"engine": {"max_num_seqs": 8}}}, {"a": "replica replacement"}),
    ({"a": {"source": "builtin:smollm2"}}, {"a": "replica replacement"}),
    ({"a": {"deployment": {"replicas": 2}, "engine": {"max_num_seqs": 8}}}, {"a": "replica replacement"}),
    ({"a": {"deployment": {"replicas": 2}}, "b": {"engine": {"max_num_seqs": 4}}},
     {"a": "in place", "org/b:1": "replica replacement"}),  # a name with a slash and a colon
    ({"c": {}}, {"c": "new model"}),
    ({"b": None}, {"org/b:1": "model removed"}),
    ({"b": None, "c": {}, "a": {"engine": {"max_num_seqs": 8}}},
     {"a": "replica replacement", "c": "new model", "org/b:1": "model removed"}),
]


@pytest.mark.parametrize(("edits", "plan"), CASES)
def test_rollout_plan(edits: dict, plan: dict) -> None:
    assert rollout_plan(diff_fleets(fleet(), fleet(**edits))) == plan


def test_describe() -> None:
    assert describe({"a": "in place", "b": "replica replacement"}) == "a (in place), b (replica replacement)"


async def test_the_follower_redeploys_only_the_changed_models_and_remembers_the_version() -> None:
    built: list[list[str]] = []
    deployed: list[list[str]] = []

    def build(f):
        built.append([m.name for m in f.models])
        return [f"app:{m.name}:{m.deployment.replicas}" for m in f.models]

    follower = ServeFollower(fleet(), build, deployed.append, progress=lambda line: None)
    assert await follower.follow(1, fleet()) == {} and built == [] and follower.deployed_version == 1
    plan = await follower.follow(2, fleet(a={"deployment": {"replicas": 2}}))
    assert plan == {"a": "in place"} and built == [["a"]] and deployed == [["app:a:2"]]
    assert follower.deployed_version == 2
    await follower.follow(3, fleet(a={"deployment": {"replicas": 2}}, b={"engine": {"max_num_seqs": 4}}))
    assert built[-1] == ["org/b:1"]  # compared with version 2, not with the fleet it started with


async def test_a_refused_redeploy_is_reported_and_the_gateway_goes_on() -> None:
    lines: list[str] = []

    def refuse(apps):
        raise RuntimeError("Ray Serve refused")

    follower = ServeFollower(fleet(), lambda f: list(f.models), refuse, progress=lines.append)
    plan = await follower.follow(2, fleet(a={"engine": {"max_num_seqs": 8}}))
    assert plan == {"a": "replica replacement"} and follower.deployed_version is None
    assert any("failed: Ray Serve refused" in line for line in lines)
    assert await follower.follow(3, fleet(a={"engine": {"max_num_seqs": 8}})) == {}  # not retried


class Tracker:
    def __init__(self, n: int) -> None:
        self.n = n

    def snapshot(self):
        from types import SimpleNamespace

        return SimpleNamespace(in_flight=self.n)


async def test_a_removed_model_is_deleted_once_its_requests_in_flight_end() -> None:
    import asyncio
    from types import SimpleNamespace

    tracker = Tracker(2)
    models = {"a": SimpleNamespace(local=SimpleNamespace(tracker=Tracker(0))),
              "org/b:1": SimpleNamespace(local=SimpleNamespace(tracker=tracker))}
    deleted: list[list[str]] = []
    built: list[list[str]] = []
    follower = ServeFollower(fleet(), lambda f: built.append([m.name for m in f.models]) or [], lambda apps: None,
                             progress=lambda line: None, delete=deleted.append, models=models, drain_grace_s=0.05)
    del models["org/b:1"]  # the gateway of this process stopped serving it before the follower runs
    plan = await follower.follow(2, fleet(b=None, c={}))
    assert plan == {"c": "new model", "org/b:1": "model removed"} and built == [["c"]]
    await asyncio.sleep(0.3)
    assert deleted == []  # two requests still in flight
    tracker.n = 0
    await asyncio.wait_for(follower.removals[0], 2)
    assert deleted == [["lmfleet-org-b-1"]]


def test_a_removal_waits_for_every_gateway_to_read_the_version() -> None:
    from lmfleet.gateway.routing.fleet_watch import FLEET_POLL_S
    from lmfleet.serve.rollout import DRAIN_GRACE_S

    assert DRAIN_GRACE_S >= 2 * FLEET_POLL_S

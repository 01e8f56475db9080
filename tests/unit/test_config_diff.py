"""``lmfleet.config.diff``: what changing a running fleet costs, key by key; every key classified."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from lmfleet.config import parse_config
from lmfleet.config.diff import (APPLIED_LIVE, CLASSIFICATION, COSTS, ENGINE_KEYS, SERVE_APPLIED, Change, applies_live,
                                 classify, diff_fleets, engine_fingerprint, needs_restart, schema_paths)
from lmfleet.config.redact import MASK

SECRET = "supersecret123"
BASE: dict[str, Any] = {
    "models": [{"name": "m", "source": "builtin:tiny-random", "overflow": {"providers": ["p"]}},
               {"name": "n", "source": "builtin:tiny-random"}],
    "providers": [{"name": "p", "base_url": "https://api.example.com/v1", "model_map": {"m": "pm"},
                   "api_key_env": "P_KEY", "price": {"input_per_1m": 1.0, "output_per_1m": 2.0}}],
    "tenants": [{"name": "acme", "api_keys_env": "ACME_KEYS", "limits": {"requests_per_minute": 60}}],
    "cluster": {"head": {"address": "10.0.0.1"}, "workers": [{"address": "10.0.0.2"}]},
}


def edited(path: str, value: Any, base: dict[str, Any] = BASE) -> dict[str, Any]:
    """``base`` with ``path`` (dots; a number picks a list item) set to ``value``; ``value`` DELETE removes it."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if value is DELETE:
        del node[int(last) if last.isdigit() else last]
    elif last.isdigit():
        node.insert(int(last), value)
    else:
        node[last] = value
    return data


DELETE = object()
NEW_PROVIDER = {"name": "q", "base_url": "https://q.example.com/v1", "model_map": {"n": "qn"}}

# (edit path, new value, the change's path, where, cost)
CASES = [
    ("providers.0.price.input_per_1m", 3.0, "providers[p].price.input_per_1m", "gateway", "none"),
    ("providers.1", NEW_PROVIDER, "providers[q]", "gateway", "none"),
    ("providers.0.api_key_env", "P_KEY_2", "providers[p].api_key_env", "gateway", "restart needed"),
    ("providers.0.timeouts.total_s", 60.0, "providers[p].timeouts.total_s", "gateway", "none"),
    ("providers.0.breaker.cooldown_s", 5.0, "providers[p].breaker.cooldown_s", "gateway", "none"),
    ("budget.hourly_usd", 5.0, "budget.hourly_usd", "gateway", "none"),
    ("budget.on_exhausted", "reject", "budget.on_exhausted", "gateway", "none"),
    ("tenants.0.limits.requests_per_minute", 120, "tenants[acme].limits.requests_per_minute", "gateway", "none"),
    ("tenants.1", {"name": "beta", "api_keys_env": "BETA_KEYS"}, "tenants[beta]", "gateway", "none"),
    ("tenants.0.models", ["m"], "tenants[acme].models", "gateway", "none"),
    ("priority_classes", [{"name": "interactive", "order": 0}], "priority_classes[batch]", "gateway", "none"),
    ("models.0.overflow.threshold_ms", 900.0, "models[m].overflow.threshold_ms", "gateway", "none"),
    ("models.0.overflow.policy", "on_error", "models[m].overflow.policy", "gateway", "none"),
    ("models.0.cost.gpu_hour_usd", 2.5, "models[m].cost.gpu_hour_usd", "gateway", "none"),
    ("models.0.deployment.request_timeout_s", 900.0, "models[m].deployment.request_timeout_s", "gateway", "none"),
    ("models.0.content_parts", ["text", "image_url"], "models[m].content_parts", "gateway", "none"),
    ("gateway.max_body_bytes", 4096, "gateway.max_body_bytes", "gateway", "none"),
    ("gateway.body_timeout_s", 5.0, "gateway.body_timeout_s", "gateway", "none"),
    ("gateway.api_keys_file", "/etc/keys", "gateway.api_keys_file", "gateway", "none"),
    ("models.0.deployment.replicas", 2, "models[m].deployment.replicas", "serve", "in place"),
    ("models.0.deployment.autoscaling", {"min_replicas": 1, "max_replicas": 3}, "models[m].deployment.autoscaling",
     "serve", "in place"),
    ("models.0.deployment.max_ongoing_requests", 8, "models[m].deployment.max_ongoing_requests", "serve", "in place"),
    ("models.0.deployment.request_router", "round_robin", "models[m].deployment.request_router", "serve", "in place"),
    ("models.0.engine.max_num_seqs", 16, "models[m].engine.max_num_seqs", "engine", "replica replacement"),
    ("models.0.engine.gpu_memory_utilization", 0.8, "models[m].engine.gpu_memory_utilization", "engine",
     "replica replacement"),
    ("models.0.engine.extra_args", {"seed": 1}, "models[m].engine.extra_args", "engine", "replica replacement"),
    ("models.0.source", "/models/m", "models[m].source", "engine", "replica replacement"),
    ("models.0.deployment.placement_strategy", "SPREAD", "models[m].deployment.placement_strategy", "engine",
     "replica replacement"),
    ("models.0.deployment.stream_batching_interval_ms", 50.0, "models[m].deployment.stream_batching_interval_ms",
     "engine", "replica replacement"),
    ("models.2", {"name": "o", "source": "builtin:tiny-random"}, "models[o]", "serve", "new model"),
    ("models.1", DELETE, "models[n]", "serve", "model removed"),
    ("gateway.port", 9000, "gateway.port", "gateway", "restart needed"),
    ("gateway.host", "0.0.0.0", "gateway.host", "gateway", "restart needed"),
    ("gateway.workers", 4, "gateway.workers", "gateway", "restart needed"),
    ("gateway.admin_key_env", "OTHER_ADMIN", "gateway.admin_key_env", "gateway", "restart needed"),
    ("ledger.url", "postgresql://lmfleet@db:5432/fleet", "ledger.url", "gateway", "restart needed"),
    ("observability.otlp_endpoint", "http://otel:4318", "observability.otlp_endpoint", "gateway", "restart needed"),
    ("cluster.address", "10.0.0.1:6379", "cluster.address", "cluster", "restart needed"),
    ("cluster.workers.1", {"address": "10.0.0.3"}, "cluster.workers[10.0.0.3]", "cluster", "restart needed"),
    ("cluster.head.gpus", 8, "cluster.head.gpus", "cluster", "restart needed"),
]


@pytest.mark.parametrize(("edit", "value", "path", "where", "cost"), CASES, ids=[c[2] for c in CASES])
def test_one_change_is_classified(edit: str, value: Any, path: str, where: str, cost: str) -> None:
    old, new = parse_config(BASE), parse_config(edited(edit, value))
    [change] = diff_fleets(old, new)
    assert (change.path, change.where, change.cost) == (path, where, cost)
    assert needs_restart([change]) == ([change] if cost == "restart needed" else [])


def test_the_same_fleet_has_no_changes_and_reordering_keyed_lists_is_none() -> None:
    assert diff_fleets(parse_config(BASE), parse_config(BASE)) == []
    turned = copy.deepcopy(BASE)
    turned["models"].reverse()
    assert diff_fleets(parse_config(BASE), parse_config(turned)) == []


def test_values_are_the_old_and_new_ones() -> None:
    [change] = diff_fleets(parse_config(BASE), parse_config(edited("models.0.deployment.replicas", 3)))
    assert change == Change("models[m].deployment.replicas", "models[].deployment.replicas", 1, 3, "serve",
                            "in place")
    [added] = diff_fleets(parse_config(BASE), parse_config(edited("providers.1", NEW_PROVIDER)))
    assert added.old is None and added.new["base_url"] == "https://q.example.com/v1"
    [removed] = diff_fleets(parse_config(BASE), parse_config(edited("models.1", DELETE)))
    assert removed.old["name"] == "n" and removed.new is None


def test_several_changes_come_in_file_order() -> None:
    new = edited("models.0.deployment.replicas", 2)
    new["gateway"] = {"port": 9000}
    new["budget"] = {"daily_usd": 10.0}
    paths = [c.path for c in diff_fleets(parse_config(BASE), parse_config(new))]
    assert paths == ["gateway.port", "models[m].deployment.replicas", "budget.daily_usd"]


@pytest.mark.parametrize(("edit", "value"), [
    ("ledger.url", "postgresql://lmfleet@db:5432/fleet?password=" + SECRET),
    ("models.0.engine.env", {"HF_TOKEN": SECRET}),
    ("models.0.engine.extra_args", {"hf_token": SECRET}),
    ("cluster.setup_commands", [f"export HF_TOKEN={SECRET}"]),
])
def test_secrets_never_echo_in_a_change(edit: str, value: Any) -> None:
    [change] = diff_fleets(parse_config(BASE), parse_config(edited(edit, value)))
    assert SECRET not in repr(change) and MASK in repr(change)


def test_every_key_of_the_fleet_file_is_classified() -> None:
    """A new field of FleetConfig (or a section) must get a row in CLASSIFICATION; a row for a gone field fails."""
    paths = set(schema_paths())
    assert sorted(paths - set(CLASSIFICATION)) == [], "classify these in lmfleet.config.diff"
    assert sorted(set(CLASSIFICATION) - paths) == [], "these rows name no field of FleetConfig"
    assert {cost for _, cost in CLASSIFICATION.values()} <= set(COSTS)
    with pytest.raises(KeyError, match="CLASSIFICATION"):
        classify("gateway.nonexistent")


def test_keys_applied_live_are_gateway_settings_that_cost_nothing() -> None:
    assert APPLIED_LIVE and all(CLASSIFICATION[k] == ("gateway", "none") for k in APPLIED_LIVE)


def test_serve_keys_applied_are_a_kept_models_in_place_and_replacement_keys() -> None:
    costs = {CLASSIFICATION[k][1] for k in SERVE_APPLIED}
    assert costs == {"in place", "replica replacement"}
    assert all(k.startswith("models[].") for k in SERVE_APPLIED) and "models[]" not in SERVE_APPLIED
    assert set(ENGINE_KEYS) == {k for k, (_, c) in CLASSIFICATION.items() if c == "replica replacement"}


# (edit path, new value, whether the engines' fingerprint changes): it moves exactly with "replica replacement"
FINGERPRINT_CASES = [
    ("deployment.replicas", 3, False),
    ("deployment.autoscaling", {"min_replicas": 1, "max_replicas": 4}, False),
    ("deployment.max_ongoing_requests", 16, False),
    ("deployment.request_router", "prefix_aware", False),
    ("deployment.request_timeout_s", 30.0, False),
    ("overflow.threshold_ms", 900.0, False),
    ("cost.gpu_hour_usd", 2.0, False),
    ("engine.max_num_seqs", 8, True),
    ("engine.max_model_len", 512, True),
    ("engine.env", {"X": "1"}, True),
    ("engine.enforce_eager", True, True),
    ("source", "builtin:smollm2", True),
    ("tokenizer", "builtin:smollm2", True),
    ("deployment.stream_batching_interval_ms", 5.0, True),
    ("deployment.placement_strategy", "SPREAD", True),
]


@pytest.mark.parametrize(("edit", "value", "moves"), FINGERPRINT_CASES)
def test_engine_fingerprint_moves_only_with_what_the_engines_are_built_from(edit: str, value: Any,
                                                                           moves: bool) -> None:
    model = parse_config(BASE).models[0]
    other = parse_config(edited(f"models.0.{edit}", value)).models[0]
    assert (engine_fingerprint(other) != engine_fingerprint(model)) is moves
    if not moves:  # the cost the diff shows agrees: nothing that replaces a replica
        assert all(c.cost != "replica replacement" for c in diff_fleets(parse_config(BASE),
                                                                        parse_config(edited(f"models.0.{edit}", value))))


def test_engine_fingerprint_is_stable_salted_and_reads_a_split_only_as_set() -> None:
    model = parse_config(BASE).models[0]
    assert engine_fingerprint(model) == engine_fingerprint(model.model_copy(deep=True))
    assert len(engine_fingerprint(model)) == 16
    assert engine_fingerprint(model, salt="lmfleet 2") != engine_fingerprint(model, salt="lmfleet 1")


@pytest.mark.parametrize(("running", "edit", "value", "live"), [
    ({}, "providers.0.price.input_per_1m", 3.0, True),
    ({}, "budget.on_exhausted", "reject", True),
    ({}, "budget.hourly_usd", 5.0, False),  # no spend store to enforce a first cap with
    ({"budget": {"daily_usd": 50.0}}, "budget.hourly_usd", 5.0, True),
    ({"tenants": [{"name": "acme", "api_keys_env": "ACME_KEYS", "limits": {"daily_usd": 1.0}}]},
     "budget.daily_usd", 5.0, True),
    ({}, "models.0.deployment.replicas", 2, True),  # the serve process redeploys in place
    ({}, "models.0.engine.max_num_seqs", 8, True),  # ... replacing the replicas
    ({}, "models.0.deployment.autoscaling", {"min_replicas": 1, "max_replicas": 2}, True),
    ({}, "models.2", {"name": "o", "source": "builtin:tiny-random"}, True),  # deployed by the serve process
    ({}, "models.1", DELETE, True),  # deleted once its requests in flight ended
    ({}, "tenants.0.limits.requests_per_minute", 120, True),  # as PUT /admin/tenants/NAME does
    ({}, "tenants.0.models", ["m"], True),
    ({}, "tenants.0.limits.daily_usd", 5.0, False),  # no spend store to enforce a first cap with
    ({"budget": {"daily_usd": 50.0}}, "tenants.0.limits.daily_usd", 5.0, True),
    ({}, "tenants.1", {"name": "beta", "api_keys_env": "BETA_KEYS"}, False),  # a tenant added: its keys, its queue
    ({}, "tenants.0.api_keys_env", "OTHER_KEYS", False),
    ({}, "priority_classes", [{"name": "interactive", "order": 0}], False),
    ({}, "gateway.port", 9000, False),
    ({}, "providers.0.api_key_env", "OTHER_KEY", False),  # a running process's environment is fixed
    ({}, "providers.1", NEW_PROVIDER, True),
    ({}, "providers.0.base_url", "https://other.example.com/v1", True),
])
def test_applies_live(running: dict, edit: str, value: Any, live: bool) -> None:
    base = {**BASE, **running}
    old = parse_config(base)
    [change] = diff_fleets(old, parse_config(edited(edit, value, base)))
    assert applies_live(change, old) is live

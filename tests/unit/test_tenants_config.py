"""Tenant and priority-class config: field constraints (with key paths) and the checks across the file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import TypeAdapter, ValidationError

from lmfleet.config import FleetConfig, GatewayConfig
from lmfleet.config.tenants import (
    PriorityClassList,
    TenantConfig,
    TenantProblem,
    check_tenants,
    default_priority_classes,
)


TENANTS = TypeAdapter(list[TenantConfig])
CLASSES = TypeAdapter(PriorityClassList)
MODELS = [{"name": "smollm2", "source": "builtin:tiny-random"}, {"name": "tiny", "source": "builtin:tiny-random"}]


def _fleet(tenants=(), classes=None, gateway=None) -> SimpleNamespace:
    """What check_tenants reads (``FleetLike``), each part validated, the cross-references not yet."""
    return SimpleNamespace(models=FleetConfig.model_validate({"models": MODELS}).models,
                           tenants=TENANTS.validate_python(list(tenants)),
                           priority_classes=CLASSES.validate_python(classes) if classes else default_priority_classes(),
                           gateway=GatewayConfig(**(gateway or {})))


def test_defaults():
    cfg = FleetConfig.model_validate({"models": MODELS})
    assert cfg.tenants == []
    assert [(c.name, c.order, c.max_wait_s) for c in cfg.priority_classes] == [("interactive", 0, None),
                                                                               ("batch", 10, 600.0)]


def test_a_full_tenant_parses():
    t = TenantConfig.model_validate({
        "name": "acme", "api_keys_env": "ACME_KEYS", "models": ["smollm2"], "priority": "batch",
        "max_priority": "interactive", "batch_may_use_providers": True,
        "limits": {"requests_per_minute": 600, "tokens_per_minute": 200_000, "max_concurrency": 16,
                   "hourly_usd": 2.5, "daily_usd": 20}})
    assert t.limits.max_concurrency == 16 and t.limits.daily_usd == 20.0 and t.batch_may_use_providers


def test_classes_are_sorted_most_urgent_first():
    classes = CLASSES.validate_python([{"name": "bulk", "order": 20, "max_wait_s": 3600},
                                       {"name": "chat", "order": 1}, {"name": "jobs", "order": 5, "max_wait_s": 60}])
    assert [c.name for c in classes] == ["chat", "jobs", "bulk"]


KEY = {"name": "acme", "api_keys_env": "ACME_KEYS"}


@pytest.mark.parametrize("data, loc, needle", [
    ({"tenants": [{"name": "acme"}]}, ("tenants", 0), "exactly one of api_keys_env and api_keys_file (neither"),
    ({"tenants": [{**KEY, "api_keys_file": "/k"}]}, ("tenants", 0), "(both given)"),
    ({"tenants": [{**KEY, "api_keys": ["sk-1"]}]}, ("tenants", 0, "api_keys"), "Extra inputs"),
    ({"tenants": [{**KEY, "name": "Acme Corp"}]}, ("tenants", 0, "name"), "pattern"),
    ({"tenants": [{**KEY, "api_keys_env": "1BAD"}]}, ("tenants", 0, "api_keys_env"), "pattern"),
    ({"tenants": [{**KEY, "limits": {"requests_per_minute": 0}}]},
     ("tenants", 0, "limits", "requests_per_minute"), "greater than or equal to 1"),
    ({"tenants": [{**KEY, "limits": {"tokens_per_minute": -5}}]},
     ("tenants", 0, "limits", "tokens_per_minute"), "greater than or equal to 1"),
    ({"tenants": [{**KEY, "limits": {"daily_usd": -1}}]},
     ("tenants", 0, "limits", "daily_usd"), "greater than or equal to 0"),
    ({"tenants": [{**KEY, "limits": {"rpm": 5}}]}, ("tenants", 0, "limits", "rpm"), "Extra inputs"),
    ({"tenants": [{**KEY, "models": ["a", "a"]}]}, ("tenants", 0), "models repeated: ['a']"),
    ({"priority_classes": []}, ("priority_classes",), "at least one class"),
    ({"priority_classes": [{"name": "a", "order": 1}, {"name": "a", "order": 2}]}, ("priority_classes",),
     "class names must be unique; repeated: ['a']"),
    ({"priority_classes": [{"name": "a", "order": 1}, {"name": "b", "order": 1}]}, ("priority_classes",),
     "orders must be distinct"),
    ({"priority_classes": [{"name": "a", "order": 1, "max_wait_s": 0}]}, ("priority_classes", 0, "max_wait_s"),
     "greater than 0"),
    ({"priority_classes": [{"name": "a"}]}, ("priority_classes", 0, "order"), "required"),
])
def test_bad_values_name_their_key_path(data, loc, needle):
    with pytest.raises(ValidationError) as info:
        FleetConfig.model_validate({"models": MODELS, **data})
    errors = info.value.errors()
    assert any(tuple(e["loc"]) == loc for e in errors), errors
    assert needle in str(info.value)


def test_the_loader_paths_through_fleetconfig():
    with pytest.raises(ValidationError) as info:
        FleetConfig.model_validate({"models": MODELS, "tenants": [{**KEY, "limits": {"max_concurrency": 0}}]})
    assert tuple(info.value.errors()[0]["loc"]) == ("tenants", 0, "limits", "max_concurrency")


def test_a_consistent_file_has_no_problems():
    fleet = FleetConfig.model_validate({"models": MODELS, "gateway": {"api_keys_env": "FLAT"}, "tenants": [
        {**KEY, "models": ["smollm2"], "priority": "batch", "max_priority": "interactive"},
        {"name": "beta", "api_keys_file": "/etc/beta.keys"}]})
    assert check_tenants(fleet) == [] and [t.name for t in fleet.tenants] == ["acme", "beta"]
    fleet = _fleet(tenants=[{**KEY, "models": ["smollm2"], "priority": "batch", "max_priority": "interactive"},
                            {"name": "beta", "api_keys_file": "/etc/beta.keys"}],
                   gateway={"api_keys_env": "FLAT"})
    assert check_tenants(fleet) == []


@pytest.mark.parametrize("tenants, gateway, path, needle", [
    ([KEY, {**KEY, "api_keys_env": "OTHER"}], None, "tenants[1].name",
     "tenant names must be unique; this one is already tenants[0] (got 'acme')"),
    ([{**KEY, "name": "default"}], {"api_keys_env": "FLAT"}, "tenants[0].name", "'default' is the tenant of"),
    ([KEY, {"name": "beta", "api_keys_env": "ACME_KEYS"}], None, "tenants[1].api_keys_env",
     "also the key source of tenant 'acme'; a key must belong to one tenant (got 'ACME_KEYS')"),
    ([{**KEY, "models": ["smollm2", "smollm3"]}], None, "tenants[0].models[1]",
     "unknown model; did you mean 'smollm2'? served: ['smollm2', 'tiny'] (got 'smollm3')"),
    ([{**KEY, "priority": "interactiv"}], None, "tenants[0].priority",
     "unknown priority class; did you mean 'interactive'? classes: ['interactive', 'batch'] (got 'interactiv')"),
    ([{**KEY, "max_priority": "urgent"}], None, "tenants[0].max_priority", "unknown priority class; classes:"),
    ([{**KEY, "priority": "interactive", "max_priority": "batch"}], None, "tenants[0].priority",
     "more urgent than max_priority 'batch'; lower priority or raise max_priority (got 'interactive')"),
    ([{**KEY, "max_priority": "batch"}], None, "tenants[0].priority",
     "null (the most urgent class, 'interactive'), more urgent than max_priority 'batch'"),
])
def test_cross_references(tenants, gateway, path, needle):
    problems = check_tenants(_fleet(tenants=tenants, gateway=gateway))
    assert len(problems) == 1, problems
    assert problems[0].path == path and needle in str(problems[0])
    assert str(problems[0]).startswith(f"{path}: ")


def test_problems_reach_the_loader_with_their_key_path():
    """Raised from FleetConfig's validator, each problem is a pydantic error at its own loc, so the loader
    prints the line and key path as for any other error."""
    from lmfleet.config.loader import _describe, _fmt_path

    data = {"models": MODELS, "tenants": [{**KEY, "models": ["smollm3"]}, {**KEY, "priority": "batchy"}]}
    with pytest.raises(ValidationError) as info:
        FleetConfig.model_validate(data)
    lines = [f"{_fmt_path(tuple(e['loc']))}: {_describe(e)}" for e in info.value.errors()]
    assert lines == [
        "tenants[0].models[0]: unknown model; did you mean 'smollm2'? served: ['smollm2', 'tiny'] (got 'smollm3')",
        "tenants[1].name: tenant names must be unique; this one is already tenants[0] (got 'acme')",
        "tenants[1].api_keys_env: also the key source of tenant 'acme'; a key must belong to one tenant "
        "(got 'ACME_KEYS')",
        "tenants[1].priority: unknown priority class; did you mean 'batch'? classes: ['interactive', 'batch'] "
        "(got 'batchy')",
    ]


def test_default_name_is_free_without_flat_keys():
    assert check_tenants(_fleet(tenants=[{**KEY, "name": "default"}])) == []


def test_operator_classes_are_checked():
    fleet = _fleet(tenants=[{**KEY, "priority": "batch"}], classes=[{"name": "chat", "order": 0}])
    assert [p.path for p in check_tenants(fleet)] == ["tenants[0].priority"]


def test_problem_path_format():
    assert TenantProblem(("tenants", 3, "limits", "daily_usd"), "x", "v").path == "tenants[3].limits.daily_usd"


def test_the_example_in_docs_tenants_md_is_valid(tmp_path):
    """The complete example in docs/tenants.md parses with the proposed FleetConfig lines and builds a directory."""
    import re
    from pathlib import Path

    import yaml

    from lmfleet.tenants import TenantDirectory

    doc = (Path(__file__).resolve().parents[2] / "docs" / "tenants.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    fleet = FleetConfig.model_validate(yaml.safe_load(example))
    assert [t.name for t in fleet.tenants] == ["research", "support-bot"]
    keys = tmp_path / "support.keys"
    keys.write_text("# support\nsk-support-1\n")
    fleet.tenants[1].api_keys_file = str(keys)
    d = TenantDirectory.build(fleet.tenants, fleet.priority_classes, gateway=fleet.gateway,
                              environ={"LMFLEET_API_KEYS": "sk-flat", "RESEARCH_KEYS": "sk-r1,sk-r2"})
    assert [d.resolve(k).name for k in ("sk-flat", "sk-r2", "sk-support-1")] == ["default", "research", "support-bot"]
    research = d.tenants["research"]
    assert (research.priority.name, research.max_priority.name) == ("batch", "interactive")
    assert d.tenants["support-bot"].priority.name == "interactive"


def test_the_real_fleet_config_reports_tenant_problems_through_the_loader():
    """FleetConfig itself now carries the tenant keys (not only the test subclass): the loader names the key path."""
    from lmfleet.config import parse_config
    from lmfleet.config.loader import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_config({"models": MODELS, "tenants": [{**KEY, "models": ["smollm3"]}]})
    assert "tenants[0].models[0]" in str(info.value) and "did you mean 'smollm2'" in str(info.value)
    fleet = parse_config({"models": MODELS, "tenants": [KEY]})
    assert [t.name for t in fleet.tenants] == ["acme"]
    assert [c.name for c in fleet.priority_classes] == ["interactive", "batch"]

"""API key -> tenant: hashed keys, the flat keys as the default tenant, errors without secrets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import TypeAdapter

from lmfleet.config.tenants import PriorityClassList, TenantConfig, default_priority_classes
from lmfleet.tenants import Tenant, TenantDirectory, TenantKeyError

CLASSES = default_priority_classes()
SECRETS = ("sk-acme-1", "sk-acme-2", "sk-beta-1", "sk-flat-1")


def _tenants(*items) -> list[TenantConfig]:
    return TypeAdapter(list[TenantConfig]).validate_python(list(items))


@pytest.fixture
def beta_file(tmp_path):
    f = tmp_path / "beta.keys"
    f.write_text("# beta's keys\n\nsk-beta-1\n")
    return str(f)


@pytest.fixture
def directory(beta_file) -> TenantDirectory:
    tenants = _tenants({"name": "acme", "api_keys_env": "ACME_KEYS", "priority": "batch",
                        "max_priority": "interactive", "models": ["smollm2"]},
                       {"name": "beta", "api_keys_file": beta_file})
    env = {"ACME_KEYS": " sk-acme-1 , sk-acme-2,", "FLAT": "sk-flat-1"}
    return TenantDirectory.build(tenants, CLASSES, gateway=SimpleNamespace(api_keys_env="FLAT", api_keys_file=None),
                                 environ=env)


@pytest.mark.parametrize("key, tenant", [
    ("sk-acme-1", "acme"), ("sk-acme-2", "acme"), ("sk-beta-1", "beta"), ("sk-flat-1", "default"),
    ("sk-acme-3", None), ("", None), (None, None), ("sk-acme-1 ", None), ("SK-ACME-1", None),
])
def test_resolve(directory, key, tenant):
    got = directory.resolve(key)
    assert (got.name if got else None) == tenant


def test_records_are_resolved(directory):
    acme = directory.tenants["acme"]
    assert acme.priority.name == "batch" and acme.max_priority.name == "interactive"
    assert acme.may_use("smollm2") and not acme.may_use("tiny")
    default = directory.tenants["default"]
    assert default.priority.name == "interactive" and default.may_use("anything")
    assert default.limits.requests_per_minute is None
    assert list(directory.tenants) == ["default", "acme", "beta"] and directory.key_count == 4


def test_no_secret_in_repr(directory):
    text = repr(directory) + str(directory) + repr(directory.tenants["acme"])
    assert not any(s in text for s in SECRETS)
    assert "_by_digest" not in text


def test_open_without_any_key():
    d = TenantDirectory.build([], CLASSES, gateway=None, environ={})
    assert d.is_open and d.resolve(None).name == "default" and d.resolve("whatever").name == "default"


def test_tenants_without_flat_keys_have_no_default():
    d = TenantDirectory.build(_tenants({"name": "acme", "api_keys_env": "K"}), CLASSES, environ={"K": "sk-acme-1"})
    assert not d.is_open and list(d.tenants) == ["acme"] and d.resolve("sk-flat-1") is None


@pytest.mark.parametrize("tenants, gateway, env, needle", [
    ([{"name": "acme", "api_keys_env": "ACME_KEYS"}], None, {}, "tenants[0].api_keys_env names ACME_KEYS, but"),
    ([{"name": "acme", "api_keys_env": "ACME_KEYS"}], None, {"ACME_KEYS": " , "}, "unset or empty"),
    ([], SimpleNamespace(api_keys_env="FLAT", api_keys_file=None), {}, "gateway.api_keys_env names FLAT"),
    ([{"name": "acme", "api_keys_file": "/nonexistent/keys"}], None, {}, "tenants[0].api_keys_file"),
    ([{"name": "acme", "api_keys_env": "A"}, {"name": "beta", "api_keys_env": "B"}], None,
     {"A": "sk-acme-1", "B": "sk-beta-1,sk-acme-1"}, "tenants[1] ('beta') and tenants[0] ('acme') hold the same"),
    ([{"name": "acme", "api_keys_env": "A"}], SimpleNamespace(api_keys_env="FLAT", api_keys_file=None),
     {"A": "sk-acme-1", "FLAT": "sk-acme-1"}, "tenants[0] ('acme') and gateway ('default') hold the same"),
])
def test_key_errors_name_the_source_never_the_key(tenants, gateway, env, needle):
    with pytest.raises(TenantKeyError) as info:
        TenantDirectory.build(_tenants(*tenants), CLASSES, gateway=gateway, environ=env)
    assert needle in str(info.value)
    assert not any(s in str(info.value) for s in SECRETS)


def test_a_key_file_of_comments_is_an_error(tmp_path):
    f = tmp_path / "k"
    f.write_text("# nothing\n\n")
    with pytest.raises(TenantKeyError, match="holds no key"):
        TenantDirectory.build(_tenants({"name": "acme", "api_keys_file": str(f)}), CLASSES, environ={})


def test_tenant_defaults_follow_the_classes():
    classes = TypeAdapter(PriorityClassList).validate_python([{"name": "bulk", "order": 9, "max_wait_s": 60},
                                                              {"name": "chat", "order": 1}])
    t = Tenant.from_config(_tenants({"name": "a", "api_keys_env": "K"})[0], classes)
    assert t.priority.name == "chat" and t.max_priority.name == "chat"
    t = Tenant.from_config(_tenants({"name": "a", "api_keys_env": "K", "priority": "bulk"})[0], classes)
    assert t.priority.name == "bulk" and t.max_priority.name == "bulk"  # null max_priority: its own default


def test_a_tenant_naming_no_class_is_refused():
    cfg = _tenants({"name": "a", "api_keys_env": "K", "max_priority": "urgent"})[0]
    with pytest.raises(ValueError, match="tenant 'a': max_priority 'urgent' is not a priority class"):
        Tenant.from_config(cfg, CLASSES)

"""Changing a tenant's settings at run time (issue 14): ``PUT``/``DELETE /admin/tenants/NAME`` on the real gateway
(``build_gateway``, fake backends): validated like fleet.yaml, applied at once, kept across restarts (the spend
store's database), picked up by the other gateway processes of the fleet, no key ever shown."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lmfleet.config.tenants import TenantConfig, TenantSettings, default_priority_classes
from lmfleet.store import PostgresSpendStore, SqliteSpendStore
from lmfleet.tenants import Tenant, TenantBook, TenantDirectory
from lmfleet.tenants.admin import TenantSettingsError, parse_update
from lmfleet.testing.pg_shared import fresh_database
from lmfleet.testing.gateway_fakes import make_gateway, started_client
from tests.unit.test_gateway_tenants import (
    ADMIN,
    CHAT,
    CLASSES,
    FLAT_KEY,
    KEYS,
    _error,
    key,
    ok_local,
    tenant_gateway,
)

pytestmark = pytest.mark.usefixtures("close_started_gateways")

A_LIMITS = {"requests_per_minute": 100, "max_concurrency": 4}


def gateway(tmp_path, **kw):
    return tenant_gateway(tmp_path, {"a": {"limits": A_LIMITS}, "b": {}}, flat=True, **kw)


async def _tenant(c, name: str) -> dict:
    r = await c.get("/admin/tenants", headers=ADMIN)
    assert r.status_code == 200
    return r.json()["tenants"][name]


async def test_a_limit_lowered_at_run_time_holds_at_once_and_keeps_the_others(tmp_path):
    app = gateway(tmp_path)
    c = await started_client(app)
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200
    r = await c.put("/admin/tenants/a", json={"limits": {"requests_per_minute": 2}}, headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["limits"]["requests_per_minute"] == 2 and body["limits"]["max_concurrency"] == 4
    assert body["persisted"] is True and body["source"] == "admin"
    assert body["windows"]["requests_per_minute"] == {"limit": 2, "used": 1.0, "remaining": 1}  # counts kept
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))
    assert _error(r, 429)["code"] == "rate_limit_exceeded" and r.headers["x-ratelimit-limit-requests"] == "2"
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("b"))).status_code == 200
    a = await _tenant(c, "a")
    assert a["limits"]["requests_per_minute"] == 2 and a["source"] == "admin"
    # lifting it: null removes the limit (and its window)
    r = await c.put("/admin/tenants/a", json={"limits": {"requests_per_minute": None}}, headers=ADMIN)
    assert r.json()["limits"]["requests_per_minute"] is None and "requests_per_minute" not in r.json()["windows"]
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200


async def test_priority_and_models_change_at_run_time(tmp_path):
    c = await started_client(gateway(tmp_path))
    r = await c.put("/admin/tenants/b", json={"priority": "batch", "max_priority": "interactive"}, headers=ADMIN)
    assert (r.json()["priority"], r.json()["max_priority"]) == ("batch", "interactive")
    r = await c.post("/v1/chat/completions", json=CHAT, headers=key("b"))
    assert r.status_code == 200 and r.headers["x-lmfleet-priority"] == "batch"
    r = await c.post("/v1/chat/completions", json=CHAT, headers={**key("b"), "x-lmfleet-priority": "interactive"})
    assert r.headers["x-lmfleet-priority"] == "interactive"
    r = await c.put("/admin/tenants/b", json={"models": ["m"]}, headers=ADMIN)
    assert r.json()["models"] == ["m"]
    # the flat keys' tenant is a tenant too
    r = await c.put("/admin/tenants/default", json={"limits": {"max_concurrency": 3}}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["limits"]["max_concurrency"] == 3
    r = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {FLAT_KEY}"})
    assert r.status_code == 200


@pytest.mark.parametrize("body,param,words", [
    ({"limits": {"max_concurrency": 0}}, "limits.max_concurrency", "greater than or equal to 1"),
    ({"limits": {"requests_per_minute": "many"}}, "limits.requests_per_minute", "valid integer"),
    ({"limits": {"daily_usd": -1}}, "limits.daily_usd", "greater than or equal to 0"),
    ({"limits": {"burst": 3}}, "limits.burst", "unknown setting"),
    ({"models": ["m", "m"]}, "models", "repeated"),
    ({"models": ["mm"]}, "models[0]", "unknown model; did you mean 'm'?"),
    ({"priority": "batchy"}, "priority", "did you mean 'batch'?"),
    ({"priority": "interactive", "max_priority": "batch"}, "priority", "more urgent than max_priority"),
    ({"batch_may_use_providers": "yes"}, "batch_may_use_providers", "valid boolean"),
    ({"api_keys_env": "OTHER_KEYS"}, "api_keys_env", "keys are never set through the API"),
    ({"name": "c"}, "name", "unknown setting"),
    ({"limits": {"hourly_usd": 1}}, "limits.hourly_usd", "started without a spend cap"),
])
async def test_a_bad_body_is_400_naming_the_field_and_changes_nothing(tmp_path, body, param, words):
    c = await started_client(gateway(tmp_path))
    before = await _tenant(c, "a")
    r = await c.put("/admin/tenants/a", json=body, headers=ADMIN)
    err = _error(r, 400)
    assert (err["param"], err["code"], err["type"]) == (param, "invalid_tenant_settings", "invalid_request_error")
    assert words in err["message"] and err["message"].startswith(param)
    assert await _tenant(c, "a") == before


@pytest.mark.parametrize("method,path,headers,status,code", [
    ("PUT", "/admin/tenants/nobody", ADMIN, 404, "tenant_not_found"),
    ("DELETE", "/admin/tenants/nobody", ADMIN, 404, "tenant_not_found"),
    ("PUT", "/admin/tenants/a", {"authorization": f"Bearer {KEYS['a']}"}, 401, "invalid_api_key"),
    ("PUT", "/admin/tenants/a", {}, 401, "invalid_api_key"),
])
async def test_unknown_tenants_are_404_and_only_the_admin_may_change_one(tmp_path, method, path, headers, status,
                                                                          code):
    c = await started_client(gateway(tmp_path))
    r = await c.request(method, path, json={"limits": {"max_concurrency": 1}}, headers=headers)
    assert _error(r, status)["code"] == code
    assert (await _tenant(c, "a"))["limits"]["max_concurrency"] == 4


async def test_a_body_that_is_not_an_object_is_400(tmp_path):
    c = await started_client(gateway(tmp_path))
    r = await c.put("/admin/tenants/a", content=b"[1, 2]", headers={**ADMIN, "content-type": "application/json"})
    assert r.status_code == 400


async def test_changes_survive_a_restart_and_delete_goes_back_to_the_file(tmp_path):
    c = await started_client(gateway(tmp_path))
    await c.put("/admin/tenants/a", json={"limits": {"max_concurrency": 1}, "priority": "batch"}, headers=ADMIN)
    c2 = await started_client(gateway(tmp_path))  # a restart: a new gateway on the same ledger file
    a = await _tenant(c2, "a")
    assert (a["limits"]["max_concurrency"], a["priority"], a["source"]) == (1, "batch", "admin")
    r = await c2.delete("/admin/tenants/a", headers=ADMIN)
    assert r.status_code == 200 and r.json()["limits"]["max_concurrency"] == 4 and r.json()["source"] == "fleet.yaml"
    c3 = await started_client(gateway(tmp_path))
    a = await _tenant(c3, "a")
    assert (a["limits"]["max_concurrency"], a["priority"], a["source"]) == (4, "interactive", "fleet.yaml")


async def test_the_other_gateway_processes_pick_a_change_up_within_their_poll(tmp_path):
    """Two gateways of one fleet (as two worker processes build them) on one ledger file: a PUT on one holds
    on the other once it has polled (0.05 s here; 1 s by default)."""
    apps = [gateway(tmp_path) for _ in range(2)]
    clients = [await started_client(app) for app in apps]
    other = apps[1].state.tenant_admin
    other.poll_s = 0.05
    poll = asyncio.create_task(other.poll_forever())
    try:
        r = await clients[0].put("/admin/tenants/a", json={"limits": {"requests_per_minute": 1}}, headers=ADMIN)
        assert r.status_code == 200
        for _ in range(100):
            if (await _tenant(clients[1], "a"))["limits"]["requests_per_minute"] == 1:
                break
            await asyncio.sleep(0.02)
        a = await _tenant(clients[1], "a")
        assert a["limits"]["requests_per_minute"] == 1 and a["source"] == "admin"
        assert (await clients[1].post("/v1/chat/completions", json=CHAT, headers=key("a"))).status_code == 200
        assert _error(await clients[1].post("/v1/chat/completions", json=CHAT, headers=key("a")), 429)
        await clients[0].delete("/admin/tenants/a", headers=ADMIN)
        for _ in range(100):
            if (await _tenant(clients[1], "a"))["source"] == "fleet.yaml":
                break
            await asyncio.sleep(0.02)
        assert (await _tenant(clients[1], "a"))["limits"]["requests_per_minute"] == 100
    finally:
        poll.cancel()


async def test_a_spend_cap_set_at_run_time_is_enforced_when_the_gateway_has_a_spend_store(tmp_path):
    path = tmp_path / "a.keys"
    path.write_text(f"{KEYS['a']}\n")
    app = make_gateway(tmp_path, ok_local, extra={"tenants": [{"name": "a", "api_keys_file": str(path)}],
                                                   "priority_classes": CLASSES, "budget": {"hourly_usd": 5}})
    c = await started_client(app)
    r = await c.put("/admin/tenants/a", json={"limits": {"hourly_usd": 0.5}}, headers=ADMIN)
    assert r.status_code == 200, r.text
    caps = app.state.gateway.router.tenant_caps["a"]
    assert [(cap.key, cap.window_s) for cap in caps] == [("tenant:a", 3600)]


async def test_no_key_is_logged_or_returned(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    c = await started_client(gateway(tmp_path))
    secret = "sk-oops-pasted-a-key-9d2f"
    r = await c.put("/admin/tenants/a", json={"api_key": secret, "limits": {"max_concurrency": 2}}, headers=ADMIN)
    assert r.status_code == 400 and secret not in r.text
    r = await c.put("/admin/tenants/a", json={"limits": {"max_concurrency": 2}}, headers=ADMIN)
    texts = [r.text, (await c.get("/admin/tenants", headers=ADMIN)).text, caplog.text]
    for text in texts:
        assert not any(k in text for k in [*KEYS.values(), FLAT_KEY, secret])


# ---- the pure part -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,expect", [
    ({}, {}),
    ({"limits": {"tokens_per_minute": 10}}, {"limits": {**A_LIMITS, "tokens_per_minute": 10}}),
    ({"limits": {}}, {}),
    ({"models": None}, {"models": []}),
    ({"models": []}, {"models": []}),
    ({"priority": None}, {"priority": None}),
    ({"batch_may_use_providers": True}, {"batch_may_use_providers": True}),
])
def test_an_update_replaces_the_fields_given_and_merges_limits(body, expect):
    current = TenantSettings(limits=A_LIMITS, models=["m"], priority="interactive")
    new = parse_update("a", body, current, served=["m"], classes=default_priority_classes(), spend_caps=False)
    want = current.model_dump()
    for k, v in expect.items():
        want[k] = {**want[k], **v} if k == "limits" else v
    assert new.model_dump() == want


def test_parse_update_refuses_what_it_cannot_use():
    with pytest.raises(TenantSettingsError) as e:
        parse_update("a", {"limits": {"daily_usd": 3}}, TenantSettings(), served=["m"],
                     classes=default_priority_classes(), spend_caps=False)
    assert e.value.param == "limits.daily_usd"
    # with a spend store it is accepted; an unchanged cap is never refused
    assert parse_update("a", {"limits": {"daily_usd": 3}}, TenantSettings(), served=["m"],
                        classes=default_priority_classes(), spend_caps=True).limits.daily_usd == 3
    kept = TenantSettings(limits={"daily_usd": 3})
    assert parse_update("a", {"priority": "batch"}, kept, served=["m"], classes=default_priority_classes(),
                        spend_caps=False).limits.daily_usd == 3


# ---- the store: both backends --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_store_keeps_overrides_with_one_version_counter_across_connections(tmp_path, backend, request):
    if backend == "sqlite":
        where = str(tmp_path / "ledger.sqlite")
        opener = SqliteSpendStore
    else:
        where = fresh_database(request.getfixturevalue("pg_server"))
        opener = PostgresSpendStore
    one, two = opener(where), opener(where)  # two processes' connections
    try:
        assert one.tenant_overrides_version() == 0 and two.tenant_overrides() == []
        a1 = one.put_tenant_override("a", '{"limits": {}}')
        b1 = two.put_tenant_override("b", '{"models": []}')
        a2 = two.put_tenant_override("a", None)  # reverted: a row with no settings, a newer version
        assert (a1.version, b1.version, a2.version) == (1, 2, 3)
        assert one.tenant_overrides_version() == 3
        assert [(r.name, r.settings, r.version) for r in one.tenant_overrides()] == [
            ("b", '{"models": []}', 2), ("a", None, 3)]
    finally:
        one.close()
        two.close()


# ---- the in-process swap: directory and book -------------------------------------------------------------------
@pytest.mark.parametrize("before,after,used,limited,window", [
    ({"requests_per_minute": 10}, {"requests_per_minute": 2}, 3, True, (2, 3.0)),   # counts kept, now over
    ({"requests_per_minute": 10}, {"requests_per_minute": 20}, 3, True, (20, 3.0)),
    ({"requests_per_minute": 10}, {}, 3, False, None),                              # lifted: no window
    ({}, {"requests_per_minute": 5}, 0, True, (5, 0.0)),                            # new: an empty window
    ({}, {"max_concurrency": 1}, 0, True, None),
])
def test_a_swapped_tenant_resolves_by_its_keys_and_its_windows_keep_their_counts(before, after, used, limited,
                                                                                  window):
    classes = default_priority_classes()
    cfg = TenantConfig(name="a", api_keys_env="A_KEYS", limits=before)
    directory = TenantDirectory.build([cfg], classes, environ={"A_KEYS": "k1,k2"})
    book = TenantBook(directory, classes, clock=lambda: 1000.0)
    for _ in range(used):
        book.take(directory.tenants["a"])
    new = TenantSettings(limits=after).as_config("a")
    tenant = Tenant.from_config(new, classes)
    directory.replace(tenant)
    book.set_limits(tenant)
    assert directory.resolve("k1") is tenant and directory.resolve("k2") is tenant
    assert book.is_limited(tenant) is limited
    w = book.usage["a"].requests
    assert (None if w is None else (w.limit, w.used(1000.0))) == window
    with pytest.raises(KeyError):
        directory.replace(Tenant.from_config(TenantSettings().as_config("zz"), classes))

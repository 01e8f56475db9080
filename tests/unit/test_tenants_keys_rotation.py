"""Key rotation without a restart: merge_keys (pure, a table) and KeyFiles on real key files in tmp_path."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
from pydantic import TypeAdapter

from lmfleet.config.tenants import TenantConfig, default_priority_classes
from lmfleet.tenants import TenantDirectory
from lmfleet.tenants import keys as keys_module
from lmfleet.tenants.directory import digest
from lmfleet.tenants.keys import KeyFiles, merge_keys

CLASSES = default_priority_classes()
SECRETS = ["sk-acme-old", "sk-acme-new", "sk-acme-2", "sk-beta-1", "sk-beta-2", "sk-env-1", "sk-flat-1",
           "sk-flat-file-1", "sk-flat-file-2"]


def D(*names: str) -> frozenset[bytes]:
    """Digests of keys named by a letter: D("x", "y")."""
    return frozenset(digest(n) for n in names)


# ---- merge_keys (pure) -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("current,fresh,expected,refused", [
    # a changed file: its keys replace the old ones; the others stay
    ({"a": D("1"), "b": D("2")}, {"a": D("3")}, {"a": D("3"), "b": D("2")}, {}),
    ({"a": D("1"), "b": D("2")}, {"a": D("1", "3")}, {"a": D("1", "3"), "b": D("2")}, {}),  # a second key
    ({"a": D("1", "3"), "b": D("2")}, {"a": D("3")}, {"a": D("3"), "b": D("2")}, {}),     # the old one removed
    ({"a": D("1"), "b": D("2")}, {}, {"a": D("1"), "b": D("2")}, {}),                      # nothing read
    # a new key another tenant holds: refused, the file's tenant keeps what it holds
    ({"a": D("1"), "b": D("2")}, {"a": D("2")}, {"a": D("1"), "b": D("2")}, {"a": "b"}),
    ({"a": D("1"), "b": D("2")}, {"a": D("1", "2")}, {"a": D("1"), "b": D("2")}, {"a": "b"}),
    # both files changed and now share a key: both refused (move a key in two steps: remove, then add)
    ({"a": D("1"), "b": D("2")}, {"a": D("3"), "b": D("3")}, {"a": D("1"), "b": D("2")}, {"a": "b", "b": "a"}),
    # a key moved from a to b at once: b's new set clashes with a's current one until a's file drops it
    ({"a": D("1", "9"), "b": D("2")}, {"a": D("1"), "b": D("2", "9")}, {"a": D("1"), "b": D("2", "9")}, {}),
    ({"a": D("1", "9"), "b": D("2")}, {"b": D("2", "9")}, {"a": D("1", "9"), "b": D("2")}, {"b": "a"}),
    # one refused, the other applied
    ({"a": D("1"), "b": D("2"), "c": D("4")}, {"a": D("4"), "b": D("5")},
     {"a": D("1"), "b": D("5"), "c": D("4")}, {"a": "c"}),
    # a tenant that had no keys before (the default tenant of an open directory cannot have a file; for completeness)
    ({"a": D("1")}, {"b": D("2")}, {"a": D("1"), "b": D("2")}, {}),
    ({"a": D("1")}, {"b": D("1")}, {"a": D("1"), "b": frozenset()}, {"b": "a"}),
])
def test_merge_keys(current, fresh, expected, refused):
    got, why = merge_keys(current, fresh)
    assert got == expected and why == refused
    owners = [d for ds in got.values() for d in ds]
    assert len(owners) == len(set(owners))  # never a key held twice


# ---- KeyFiles on real files --------------------------------------------------------------------------------------
def write(path, *keys: str, comment: str = "# keys") -> None:
    path.write_text("\n".join([comment, *keys, ""]))


def replace_atomically(path, *keys: str) -> None:
    tmp = path.with_suffix(".tmp")
    write(tmp, *keys)
    os.replace(tmp, path)


@pytest.fixture
def files(tmp_path):
    acme, beta, flat = tmp_path / "acme.keys", tmp_path / "beta.keys", tmp_path / "flat.keys"
    write(acme, "sk-acme-old")
    write(beta, "sk-beta-1")
    write(flat, "sk-flat-file-1")
    return SimpleNamespace(acme=acme, beta=beta, flat=flat)


def build(files) -> TenantDirectory:
    tenants = TypeAdapter(list[TenantConfig]).validate_python([
        {"name": "acme", "api_keys_file": str(files.acme)}, {"name": "beta", "api_keys_file": str(files.beta)},
        {"name": "envy", "api_keys_env": "ENVY_KEYS"}])
    gateway = SimpleNamespace(api_keys_env="FLAT", api_keys_file=str(files.flat))
    return TenantDirectory.build(tenants, CLASSES, gateway=gateway,
                                 environ={"ENVY_KEYS": "sk-env-1", "FLAT": "sk-flat-1"})


def who(d: TenantDirectory, key: str) -> str | None:
    t = d.resolve(key)
    return t.name if t is not None else None


async def test_a_new_key_works_and_a_removed_one_stops_at_the_next_look(files):
    d = build(files)
    kf = KeyFiles(d)
    assert [s.where for s in kf.sources] == ["gateway", "tenants[0]", "tenants[1]"]  # the env-only tenant: none
    report = await kf.check()  # the first look reads every file: nothing changed since start
    assert report.changed == [] and report.errors == []
    assert report.keys == {"default": 2, "acme": 1, "beta": 1, "envy": 1}
    assert report.reloadable == {"default": True, "acme": True, "beta": True, "envy": False}
    assert kf.scan() == []  # unchanged files are only stat()ed

    write(files.acme, "sk-acme-old", "sk-acme-new")       # rotation, step 1: the new key next to the old one
    assert (await kf.check()).changed == ["acme"]
    assert who(d, "sk-acme-old") == who(d, "sk-acme-new") == "acme"
    replace_atomically(files.acme, "sk-acme-new")          # step 2: the old key goes
    report = await kf.check()
    assert report.changed == ["acme"] and report.keys["acme"] == 1
    assert who(d, "sk-acme-old") is None and who(d, "sk-acme-new") == "acme"
    assert who(d, "sk-beta-1") == "beta" and who(d, "sk-env-1") == "envy"


async def test_the_flat_key_file_rotates_and_the_flat_variables_keys_stay(files):
    d = build(files)
    kf = KeyFiles(d)
    await kf.check()
    replace_atomically(files.flat, "sk-flat-file-2")
    assert (await kf.check()).changed == ["default"]
    assert [who(d, k) for k in ("sk-flat-1", "sk-flat-file-1", "sk-flat-file-2")] == ["default", None, "default"]


@pytest.mark.parametrize("break_it,problem", [
    (lambda p: p.unlink(), "cannot be read: No such file or directory"),
    (lambda p: write(p, comment="# emptied by mistake"), "holds no key"),
    (lambda p: p.write_text(""), "holds no key"),
    (lambda p: (p.unlink(), p.mkdir()), "cannot be read: Is a directory"),
    (lambda p: p.write_bytes(b"sk-\xff\xfe\n"), "cannot be read: UnicodeDecodeError"),
])
async def test_a_file_that_cannot_be_used_keeps_the_keys_with_one_warning(files, caplog, break_it, problem):
    caplog.set_level(logging.INFO, logger="lmfleet.tenants")
    d = build(files)
    kf = KeyFiles(d)
    await kf.check()
    break_it(files.acme)
    for _ in range(3):  # looked at again and again: still one warning
        report = await kf.check()
        assert report.changed == [] and who(d, "sk-acme-old") == "acme" and not d.is_open
        assert [e["param"] for e in report.errors] == ["tenants[0].api_keys_file"]
        assert problem in report.errors[0]["message"] and "keeps the 1 key(s)" in report.errors[0]["message"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and problem in warnings[0].getMessage() and str(files.acme) in warnings[0].getMessage()
    # back, with a new key: in force, and said once
    if files.acme.is_dir():
        files.acme.rmdir()
    write(files.acme, "sk-acme-new")
    assert (await kf.check()).changed == ["acme"]
    assert who(d, "sk-acme-old") is None and who(d, "sk-acme-new") == "acme"
    assert (await kf.check()).errors == []
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1
    assert not any(s in caplog.text for s in SECRETS)


async def test_every_file_gone_never_opens_the_gateway(files):
    d = build(files)
    kf = KeyFiles(d)
    for p in (files.acme, files.beta, files.flat):
        p.unlink()
    report = await kf.check()
    assert len(report.errors) == 3 and not d.is_open and d.key_count == 5
    assert who(d, "sk-nope") is None and who(d, "sk-beta-1") == "beta"


async def test_a_key_of_another_tenant_is_refused_and_named_without_the_key(files, caplog):
    d = build(files)
    kf = KeyFiles(d)
    await kf.check()
    write(files.acme, "sk-acme-old", "sk-beta-1")
    report = await kf.check()
    assert report.changed == [] and who(d, "sk-beta-1") == "beta" and who(d, "sk-acme-old") == "acme"
    msg = report.errors[0]["message"]
    assert "holds a key that tenant 'beta' (tenants[1]) holds" in msg and "'acme' keeps the 1 key(s)" in msg
    # moving a key: out of beta's file first, then into acme's (both may happen in one look)
    write(files.beta, "sk-beta-2")
    report = await kf.check()
    assert sorted(report.changed) == ["acme", "beta"] and report.errors == []
    assert who(d, "sk-beta-1") == "acme" and who(d, "sk-beta-2") == "beta"
    assert not any(s in caplog.text or s in str(report.body()) for s in SECRETS)


async def test_a_file_written_while_it_is_read_is_read_again_later(files, monkeypatch):
    d = build(files)
    kf = KeyFiles(d)
    await kf.check()
    real = keys_module.read_key_file

    def half_written(where, file):
        keys = real(where, file)
        with open(file, "a") as f:  # the writer goes on while we read
            f.write("sk-acme-2\n")
        return keys

    write(files.acme, "sk-acme-new")
    monkeypatch.setattr(keys_module, "read_key_file", half_written)
    report = await kf.check()
    assert report.changed == [] and "changed while it was read" in report.errors[0]["message"]
    assert who(d, "sk-acme-new") is None and who(d, "sk-acme-old") == "acme"
    monkeypatch.setattr(keys_module, "read_key_file", real)
    report = await kf.check()
    assert report.changed == ["acme"] and who(d, "sk-acme-new") == who(d, "sk-acme-2") == "acme"


async def test_the_poller_keeps_going_and_picks_up_changes(files):
    d = build(files)
    kf = KeyFiles(d, period_s=0.0)
    looks = 0

    async def sleep(_):
        nonlocal looks
        looks += 1
        if looks == 2:
            replace_atomically(files.acme, "sk-acme-new")
        if looks == 3:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        await kf.poll_forever(sleep)
    assert who(d, "sk-acme-new") == "acme" and who(d, "sk-acme-old") is None


def test_set_keys_refuses_what_would_open_or_share(files):
    d = build(files)
    before = d.digests_by_tenant()
    with pytest.raises(ValueError, match="open to anyone"):
        d.set_keys({})
    with pytest.raises(ValueError, match="same API key"):
        d.set_keys({**before, "beta": before["acme"]})
    with pytest.raises(ValueError, match="no tenant 'ghost'"):
        d.set_keys({**before, "ghost": D("x")})
    assert d.digests_by_tenant() == before
    assert d.key_counts() == {"default": 2, "acme": 1, "beta": 1, "envy": 1}
    assert not any(s in repr(d) + repr(d.sources) for s in SECRETS)

"""A tenant's settings changed at run time (``PUT /admin/tenants/NAME``): validated, persisted, applied everywhere.

    admin = TenantAdmin(directory, book, router.tenant_caps, served=[...], store=spend_store, spend_caps=True)
    admin.load()                                   # at start: settings set earlier win over fleet.yaml's
    settings = await admin.update("acme", body)    # TenantSettingsError (400), UnknownTenantError (404),
                                                   # StoreUnavailable (503)
    await admin.poll_forever()                     # in the gateway's lifespan: other processes' changes

Persisted in the spend store's database (``tenant_overrides``, ``lmfleet/store/tenants.py``): every gateway
process (and node, with PostgreSQL) shares it and polls ``MAX(version)`` every ``poll_s``; a change is applied by
swapping the :class:`Tenant` in the :class:`TenantDirectory` (keys keep resolving, now to the new settings), resizing
its windows in the :class:`TenantBook` and replacing its spend caps. Requests already admitted keep what they got.
Keys never pass here: the settings hold limits, models and classes only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from lmfleet.errors import LmfleetError
from lmfleet.config.tenants import TenantProblem, TenantSettings, TenantUpdate, check_settings
from lmfleet.store import Cap, StoreUnavailable, TenantOverride, caps_for_budget, tenant_key
from lmfleet.tenants.book import TenantBook
from lmfleet.tenants.directory import Tenant, TenantDirectory

__all__ = ["TenantAdmin", "TenantSettingsError", "UnknownTenantError", "parse_update", "settings_of"]

log = logging.getLogger("lmfleet.tenants")


class TenantSettingsError(LmfleetError, ValueError):
    """A ``PUT`` body that cannot be used: ``param`` is the key path (``limits.max_concurrency``), ``message`` says
    what was found and what is expected."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


class UnknownTenantError(LmfleetError, KeyError):
    """No tenant of that name (404)."""


def settings_of(t: Tenant) -> TenantSettings:
    """A live tenant's settings, classes by name (``priority``/``max_priority`` as resolved)."""
    return TenantSettings(limits=t.limits, models=sorted(t.models), priority=t.priority.name,
                          max_priority=t.max_priority.name, batch_may_use_providers=t.batch_may_use_providers)


def _from_pydantic(e: ValidationError) -> TenantSettingsError:
    err = e.errors()[0]
    p = TenantProblem(tuple(err["loc"]), err["msg"], "")
    if err["type"] == "extra_forbidden":  # never echo an unknown key's value: it may be a secret sent by mistake
        return TenantSettingsError(p.path, f"{p.path}: unknown setting; settable: limits, models, priority, "
                                   "max_priority, batch_may_use_providers (keys are never set through the API)")
    got = repr(err.get("input"))[:80]
    return TenantSettingsError(p.path or None, f"{p.path or 'body'}: {err['msg']} (got {got})")


def parse_update(name: str, body: Any, current: TenantSettings, *, served: Sequence[str],
                 classes: Sequence[Any], spend_caps: bool) -> TenantSettings:
    """``current`` with the ``PUT`` ``body`` applied, checked like fleet.yaml's tenants (pure).

    ``spend_caps``: the gateway enforces tenant USD caps (it opened the spend store at start); without it a new
    ``hourly_usd``/``daily_usd`` is refused rather than silently not enforced. Raises :class:`TenantSettingsError`.
    """
    if not isinstance(body, dict):
        raise TenantSettingsError(None, f"body must be a JSON object of settings, got {type(body).__name__}")
    try:
        new = TenantUpdate.model_validate(body).merged(current)
    except ValidationError as e:
        raise _from_pydantic(e) from None
    problems = check_settings(name, new, served=served, classes=classes)
    if problems:
        raise TenantSettingsError(problems[0].path, str(problems[0]))
    for key in ("hourly_usd", "daily_usd"):
        value = getattr(new.limits, key)
        if not spend_caps and value is not None and value != getattr(current.limits, key):
            raise TenantSettingsError(f"limits.{key}", f"limits.{key}: this gateway started without a spend cap, so "
                                      "it has no spend store to enforce one; set it in fleet.yaml and restart "
                                      f"(got {value!r})")
    return new


class TenantAdmin:
    """Run-time tenant settings of one gateway process (see the module docstring)."""

    def __init__(self, directory: TenantDirectory, book: TenantBook, caps: dict[str, tuple[Cap, ...]], *,
                 served: Sequence[str], store: Any | None = None, spend_caps: bool = False, poll_s: float = 1.0):
        self.directory = directory
        self.book = book
        self.caps = caps
        """The router's ``tenant_caps`` (name -> its USD caps), updated in place."""
        self.served = list(served)
        self.store = store
        """A ``SqlSpendStore`` (None: changes are kept in this process only, lost at restart)."""
        self.spend_caps = spend_caps
        self.poll_s = poll_s
        self.file: dict[str, TenantSettings] = {n: settings_of(t) for n, t in directory.tenants.items()}
        """Each tenant's settings from fleet.yaml (what a reverted override goes back to)."""
        self.overrides: dict[str, TenantOverride] = {}
        """Tenants whose settings come from the admin API, with when they were set."""
        self.version = 0
        self._store_failed = False

    def settings(self, name: str) -> TenantSettings:
        return settings_of(self.directory.tenants[name])

    def source(self, name: str) -> dict[str, Any]:
        """Where ``name``'s settings come from (``GET /admin/tenants``)."""
        o = self.overrides.get(name)
        return {"source": "fleet.yaml"} if o is None else {"source": "admin", "updated_at": o.updated_at,
                                                          "version": o.version}

    async def update(self, name: str, body: Any) -> TenantSettings:
        """Validate ``body`` against ``name``'s current settings, persist, apply here; the new settings."""
        if name not in self.directory.tenants:
            raise UnknownTenantError(name)
        new = parse_update(name, body, self.settings(name), served=self.served, classes=self.book.classes,
                           spend_caps=self.spend_caps)
        if self.store is not None:
            row = await asyncio.to_thread(self.store.put_tenant_override, name, new.model_dump_json())
            self.overrides[name] = row
        self.apply(name, new)
        return new

    async def revert(self, name: str) -> TenantSettings:
        """Back to fleet.yaml's settings (persisted as such: other processes follow)."""
        if name not in self.directory.tenants:
            raise UnknownTenantError(name)
        if self.store is not None:
            await asyncio.to_thread(self.store.put_tenant_override, name, None)
        self.overrides.pop(name, None)
        self.apply(name, self.file[name])
        return self.file[name]

    def apply(self, name: str, settings: TenantSettings) -> None:
        """Make ``settings`` ``name``'s in this process (call on the event loop: no I/O)."""
        tenant = Tenant.from_config(settings.as_config(name), self.book.classes)
        self.directory.replace(tenant)
        self.book.set_limits(tenant)
        caps = tuple(caps_for_budget(tenant.limits, tenant_key(name)))
        if caps:
            self.caps[name] = caps
        else:
            self.caps.pop(name, None)

    # ---- other processes' changes ----------------------------------------------------------------------------
    def read_changes(self) -> list[TenantOverride] | None:
        """Rows newer than what this process applied (blocking; None: nothing new)."""
        if self.store is None or self.store.tenant_overrides_version() == self.version:
            return None
        return [r for r in self.store.tenant_overrides() if r.version > self.version]

    def apply_rows(self, rows: Sequence[TenantOverride]) -> None:
        """Apply rows read by :meth:`read_changes` (on the event loop). A row that no longer fits fleet.yaml (a
        tenant or model removed since) is skipped with an error line; the tenant keeps fleet.yaml's settings."""
        for row in rows:
            self.version = max(self.version, row.version)
            if row.name not in self.directory.tenants:
                log.warning("tenant settings: %r was set through the admin API but is no longer in fleet.yaml; "
                            "ignored", row.name)
                continue
            if row.settings is None:
                self.overrides.pop(row.name, None)
                self.apply(row.name, self.file[row.name])
                continue
            try:
                settings = TenantSettings.model_validate_json(row.settings)
            except ValidationError as e:
                log.error("tenant settings: %r: stored settings cannot be read (%s); keeping fleet.yaml's", row.name,
                          e.errors()[0]["msg"])
                continue
            problems = check_settings(row.name, settings, served=self.served, classes=self.book.classes)
            if problems:
                log.error("tenant settings: %r: stored settings no longer fit fleet.yaml (%s); keeping fleet.yaml's",
                          row.name, problems[0])
                continue
            if self.settings(row.name) != settings:
                log.info("tenant settings: %r now %s (admin API, version %d)", row.name, settings.model_dump_json(),
                         row.version)
            self.overrides[row.name] = row
            self.apply(row.name, settings)

    def load(self) -> None:
        """At start (blocking): the settings set through the admin API earlier, over fleet.yaml's."""
        try:
            rows = self.read_changes()
        except StoreUnavailable as e:
            log.error("tenant settings: cannot read the admin API's settings (%s); fleet.yaml's apply until the "
                      "database is back", e)
            return
        if rows:
            self.apply_rows(rows)

    async def poll_forever(self, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        """Every ``poll_s``: apply what other gateway processes changed (cancel to stop)."""
        while True:
            await sleep(self.poll_s)
            try:
                rows = await asyncio.to_thread(self.read_changes)
            except StoreUnavailable as e:
                if not self._store_failed:
                    log.error("tenant settings: cannot poll the database for changes (%s); retrying", e)
                self._store_failed = True
                continue
            self._store_failed = False
            if rows:
                self.apply_rows(rows)

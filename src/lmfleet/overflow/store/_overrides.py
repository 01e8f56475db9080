"""Tenant settings changed at run time (``PUT /admin/tenants/NAME``), kept in the spend store's database.

Table (migration 4 of both backends)::

    tenant_overrides  (name) -> settings, version, updated_at
                      settings: the tenant's effective settings as JSON (``TenantSettings``), NULL: back to
                      fleet.yaml; version: one counter across the table, so every gateway process (and node, with
                      PostgreSQL) notices a change by reading ``MAX(version)``, one indexed row, every few seconds

The database, not a file beside the ledger: it is what every gateway process and node already shares (SQLite
file on one node, PostgreSQL across nodes), it survives restarts, and writes are transactions. No key is stored
here: settings hold limits, models and classes only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

__all__ = ["MIGRATION", "TenantOverride", "TenantOverrides"]

MIGRATION = """
CREATE TABLE IF NOT EXISTS tenant_overrides (
    name       TEXT PRIMARY KEY,
    settings   TEXT,
    version    {int} NOT NULL,
    updated_at {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS tenant_overrides_version ON tenant_overrides (version)
"""
"""Both backends' DDL; ``{int}``/``{real}``: the backend's integer and double types."""

_LOCK_KEY = "tenant-overrides"


@dataclass(frozen=True)
class TenantOverride:
    """One row: a tenant's settings as set through the admin API (None: reverted to fleet.yaml)."""

    name: str
    settings: str | None
    version: int
    updated_at: float


class TenantOverrides:
    """Mixin of ``SqlSpendStore``: tenant settings set at run time (see the module docstring)."""

    _transaction: Callable[[Sequence[str]], AbstractContextManager[Any]]
    _clock: Callable[[], float]

    def put_tenant_override(self, name: str, settings: str | None) -> TenantOverride:
        """Store ``name``'s settings (JSON; None: back to fleet.yaml) under the next version. Raises
        ``StoreUnavailable`` when the database cannot be used."""
        with self._transaction((_LOCK_KEY,)) as q:
            version = int(q("SELECT COALESCE(MAX(version), 0) FROM tenant_overrides").fetchone()[0]) + 1
            now = self._clock()
            q("INSERT INTO tenant_overrides (name, settings, version, updated_at) VALUES (?,?,?,?)"
              " ON CONFLICT (name) DO UPDATE SET settings = excluded.settings, version = excluded.version,"
              " updated_at = excluded.updated_at", (name, settings, version, now))
            return TenantOverride(name, settings, version, now)

    def tenant_overrides_version(self) -> int:
        """The latest version (0: none ever set): what a gateway process polls."""
        with self._transaction(()) as q:
            return int(q("SELECT COALESCE(MAX(version), 0) FROM tenant_overrides").fetchone()[0])

    def tenant_overrides(self) -> list[TenantOverride]:
        """Every row, oldest version first."""
        with self._transaction(()) as q:
            rows = q("SELECT name, settings, version, updated_at FROM tenant_overrides ORDER BY version").fetchall()
        return [TenantOverride(str(r[0]), r[1], int(r[2]), float(r[3])) for r in rows]

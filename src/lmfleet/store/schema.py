"""Every table lmfleet keeps, declared once, and the one list of migrations that builds them.

Tables::

    requests          the ledger: one row per request (who served it, for which tenant, tokens, latency, cost)
    reservations      (id, key) -> request_id, amount_nusd, created_at, expires_at: worst-case spend held per cap key
    spend_buckets     (key, bucket_end) -> nusd: settled spend per cap key in ``bucket_s`` buckets
    budget_keys       one row per lock key, PostgreSQL only (locked with ``FOR UPDATE``; SQLite locks the whole file)
    tenant_slots      (id) -> key, expires_at: one row per tenant request in flight
    rate_windows      (key, window_start) -> n: tenants' fixed rate windows (requests, tokens)
    tenant_overrides  (name) -> settings, version, updated_at: tenant settings set through the admin API

Both SQLite and PostgreSQL are created from these declarations (``create_table_sql``), with each dialect's types
(``TYPES``). ``MIGRATIONS`` lists the schema's versions in order; the database records the version it has reached
in ``lmfleet_schema``, and opening a store applies the steps above it (``migrate``). Each step is idempotent, so a
file the ledger alone created (a ``requests`` table and no version) upgrades like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = ["MIGRATIONS", "TABLES", "TYPES", "AddColumn", "Column", "CreateTables", "Dialect", "INSERT_REQUEST", "Migration", "Query", "Table",
           "create_table_sql", "insert_sql", "migrate", "schema_version"]

Dialect = Literal["sqlite", "postgresql"]
ColumnType = Literal["id", "text", "int", "real"]

TYPES: dict[Dialect, dict[ColumnType, str]] = {
    "sqlite": {"id": "INTEGER PRIMARY KEY AUTOINCREMENT", "text": "TEXT", "int": "INTEGER", "real": "REAL"},
    "postgresql": {"id": "BIGSERIAL PRIMARY KEY", "text": "TEXT", "int": "BIGINT", "real": "DOUBLE PRECISION"},
}
"""Each column type in each dialect (``id``: an auto-incremented integer primary key)."""


@dataclass(frozen=True)
class Column:
    name: str
    type: ColumnType
    nullable: bool = False


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...] = ()
    """Composite or text primary key (an ``id`` column is its own)."""
    indexes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(index name, columns)."""
    dialects: tuple[Dialect, ...] = ("sqlite", "postgresql")
    """The databases that keep it."""

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


REQUESTS = Table("requests", (
    Column("id", "id"),
    Column("ts", "real"),
    Column("model", "text"),
    Column("served_by", "text"),
    Column("route_reason", "text"),
    Column("input_tokens", "int"),
    Column("output_tokens", "int"),
    Column("latency_ms", "real", nullable=True),
    Column("ttft_ms", "real", nullable=True),
    Column("status", "text"),
    Column("cost_nusd", "int"),
    Column("tenant", "text", nullable=True),  # NULL: untagged, reported as the tenant "default"
    Column("usage_source", "text", nullable=True),  # provider | estimated; NULL: a row from before the column
    Column("upstream_model", "text", nullable=True),  # the model name the backend answered with
    # requests kept local with an estimate: the predicted wait before the first token and the realised one
    Column("predicted_wait_ms", "real", nullable=True),
    Column("realised_wait_ms", "real", nullable=True),
    # the same requests: what the estimate was computed from, JSON (lmfleet.overflow.admission)
    Column("admission", "text", nullable=True),
), indexes=(("requests_ts", ("ts",)),))

RESERVATIONS = Table("reservations", (
    Column("id", "text"),
    Column("key", "text"),
    Column("request_id", "text"),
    Column("amount_nusd", "int"),
    Column("created_at", "real"),
    Column("expires_at", "real"),
), primary_key=("id", "key"), indexes=(("reservations_key", ("key", "expires_at")),))

SPEND_BUCKETS = Table("spend_buckets", (
    Column("key", "text"),
    Column("bucket_end", "int"),
    Column("nusd", "int"),
), primary_key=("key", "bucket_end"))

BUDGET_KEYS = Table("budget_keys", (Column("key", "text"),), primary_key=("key",), dialects=("postgresql",))

TENANT_SLOTS = Table("tenant_slots", (
    Column("id", "text"),
    Column("key", "text"),
    Column("expires_at", "real"),
), primary_key=("id",), indexes=(("tenant_slots_key", ("key", "expires_at")),))

RATE_WINDOWS = Table("rate_windows", (
    Column("key", "text"),
    Column("window_start", "real"),
    Column("n", "real"),
), primary_key=("key", "window_start"))

TENANT_OVERRIDES = Table("tenant_overrides", (
    Column("name", "text"),
    Column("settings", "text", nullable=True),  # JSON of TenantSettings; NULL: back to fleet.yaml
    Column("version", "int"),
    Column("updated_at", "real"),
), primary_key=("name",), indexes=(("tenant_overrides_version", ("version",)),))

TABLES: tuple[Table, ...] = (REQUESTS, RESERVATIONS, SPEND_BUCKETS, BUDGET_KEYS, TENANT_SLOTS, RATE_WINDOWS,
                             TENANT_OVERRIDES)


def create_table_sql(table: Table, dialect: Dialect) -> list[str]:
    """``CREATE TABLE IF NOT EXISTS`` and its indexes, in ``dialect`` (nothing for a table the dialect does not keep)."""
    if dialect not in table.dialects:
        return []
    types = TYPES[dialect]
    cols = [f"{c.name} {types[c.type]}" + ("" if c.nullable or c.type == "id" else " NOT NULL") for c in table.columns]
    if table.primary_key:
        cols.append(f"PRIMARY KEY ({', '.join(table.primary_key)})")
    out = [f"CREATE TABLE IF NOT EXISTS {table.name} ({', '.join(cols)})"]
    out += [f"CREATE INDEX IF NOT EXISTS {name} ON {table.name} ({', '.join(on)})" for name, on in table.indexes]
    return out


def insert_sql(table: Table) -> str:
    """``INSERT`` of every column but an ``id`` (``?`` placeholders, in declaration order)."""
    cols = [c.name for c in table.columns if c.type != "id"]
    return f"INSERT INTO {table.name} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))})"


INSERT_REQUEST = insert_sql(REQUESTS)
"""One ledger row: ts, model, served_by, route_reason, input_tokens, output_tokens, latency_ms, ttft_ms, status,
cost_nusd, tenant, usage_source, upstream_model, predicted_wait_ms, realised_wait_ms, admission."""


class Query(Protocol):
    """Run one statement (``?`` placeholders) inside the current transaction; returns a DB-API cursor."""

    def __call__(self, sql: str, params: Sequence[Any] = ()) -> Any: ...


@dataclass(frozen=True)
class CreateTables:
    """Create tables as declared now (a table that exists is left as it is: later steps bring it up to date)."""

    tables: tuple[Table, ...]

    def apply(self, q: Query, dialect: Dialect) -> None:
        for table in self.tables:
            for sql in create_table_sql(table, dialect):
                q(sql)


@dataclass(frozen=True)
class AddColumn:
    """Add a column to a table made before it existed (nothing when it is there already)."""

    table: Table
    column: str

    def apply(self, q: Query, dialect: Dialect) -> None:
        if self.column in _columns(q, self.table.name, dialect):
            return
        col = self.table.column(self.column)
        null = "" if col.nullable else " NOT NULL"
        q(f"ALTER TABLE {self.table.name} ADD COLUMN {col.name} {TYPES[dialect][col.type]}{null}")


Migration = CreateTables | AddColumn

MIGRATIONS: tuple[tuple[int, Migration], ...] = (
    (1, CreateTables((REQUESTS, RESERVATIONS, SPEND_BUCKETS, BUDGET_KEYS))),
    (2, AddColumn(REQUESTS, "tenant")),
    (3, CreateTables((TENANT_SLOTS, RATE_WINDOWS))),
    (4, CreateTables((TENANT_OVERRIDES,))),
    (5, AddColumn(REQUESTS, "usage_source")),
    (6, AddColumn(REQUESTS, "upstream_model")),
    (7, AddColumn(REQUESTS, "predicted_wait_ms")),
    (8, AddColumn(REQUESTS, "realised_wait_ms")),
    (9, AddColumn(REQUESTS, "admission")),
)
"""(version, step), in order. A new table or column is declared above and gets a new step here."""


def _columns(q: Query, table: str, dialect: Dialect) -> set[str]:
    if dialect == "sqlite":
        return {row[1] for row in q(f"PRAGMA table_info({table})").fetchall()}
    rows = q("SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
             " AND table_name = ?", (table,)).fetchall()
    return {row[0] for row in rows}


def schema_version(q: Query) -> int:
    """The version the database has reached (0: none recorded), ``lmfleet_schema`` created if missing."""
    q("CREATE TABLE IF NOT EXISTS lmfleet_schema (version INTEGER NOT NULL)")
    return int(q("SELECT COALESCE(MAX(version), 0) FROM lmfleet_schema").fetchone()[0])


def migrate(q: Query, dialect: Dialect) -> int:
    """Apply every step above the recorded version, recording each; returns the version reached.

    The caller holds the database's schema lock (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: an advisory lock) inside
    one transaction, so processes and nodes that start together apply each step once.
    """
    current = schema_version(q)
    for version, step in MIGRATIONS:
        if version > current:
            step.apply(q, dialect)
            q("INSERT INTO lmfleet_schema (version) VALUES (?)", (version,))
            current = version
    return current

"""The ledger of every request: who served it, for which tenant, how many tokens, how long, what it cost.

``SqlLedger`` reads and writes the ``requests`` table of one database (``SqliteDatabase``: ``Ledger``, a file;
``PgDatabase``: ``PostgresLedger``, shared by several nodes), the table the spend store also appends to when it
settles a reservation. Each call is one statement (autocommit). On PostgreSQL a read whose pooled connection turned
out dead (the server restarted) is retried once on a new one; a write is not (it may have landed): it raises
``StoreUnavailable`` and the gateway's ledger writer retries it.

Costs are stored as integer nano-dollars (``cost_nusd``), so every total is an exact integer sum of its rows: the
per-request costs add up to the reported totals with no float drift. Timestamps are epoch seconds
(``time.time()``), so windows survive restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmfleet.overflow.admission import Admission, admission_json
from lmfleet.overflow.money import nusd_to_usd, usd_to_nusd
from lmfleet.provenance import PROVIDER_PREFIX
from lmfleet.store.postgres import PgDatabase
from lmfleet.store.records import Database
from lmfleet.store.schema import INSERT_REQUEST
from lmfleet.store.sqlite import SqliteDatabase

__all__ = ["DEFAULT_TENANT", "Grouping", "Ledger", "PostgresLedger", "SqlLedger", "UsageRow"]

Grouping = Literal["served_by", "tenant"]
"""What ``summary`` groups by: the backend that served a request, or the tenant that sent it."""

DEFAULT_TENANT = "default"
"""How reports name rows without a tenant (written before tenants, or by an untagged gateway): the tenant the
gateway's flat API keys belong to (``lmfleet.tenants``)."""

_GROUP_SQL: dict[str, str] = {"served_by": "served_by", "tenant": f"COALESCE(tenant, '{DEFAULT_TENANT}')"}


@dataclass(frozen=True)
class UsageRow:
    """One group of a summary (or the ``"total"``): requests, tokens and cost."""

    name: str
    """The group's value: a ``served_by`` label, a tenant, or ``"total"``."""
    requests: int
    input_tokens: int
    output_tokens: int
    cost_usd: float
    usd_per_1m_output: float | None
    """cost_usd per million output tokens; None when no output tokens."""
    by: Grouping = field(default="served_by", compare=False)

    @property
    def served_by(self) -> str:
        return self.name

    def as_dict(self) -> dict[str, Any]:
        """The group's value under its column's name (``served_by`` or ``tenant``), then the figures."""
        return {self.by: self.name, "requests": self.requests, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "cost_usd": self.cost_usd,
                "usd_per_1m_output": self.usd_per_1m_output}


def _row(name: str, requests: int, inp: Any, out: Any, nusd: Any, by: Grouping = "served_by") -> UsageRow:
    # PostgreSQL sums BIGINTs as NUMERIC (Decimal): integers again before any arithmetic
    inp, out, nusd = int(inp), int(out), int(nusd)
    cost = nusd_to_usd(nusd)
    return UsageRow(name, int(requests), inp, out, cost, cost / out * 1e6 if out else None, by)


class SqlLedger:
    """Every request: who served it, for whom, how many tokens, how long, what it cost (integer nano-dollars)."""

    def __init__(self, db: Database, *, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self._clock = clock

    def _fetch(self, sql: str, params: Sequence[Any] = ()) -> tuple[list[str], list[tuple[Any, ...]]]:
        return self.db.statement(sql, params, lambda cur: ([d[0] for d in cur.description], cur.fetchall()),
                                 retry_stale=True)

    def _insert(self, sql: str, params: Sequence[Any]) -> int:
        # not retried: the caller (the gateway's ledger writer) retries StoreUnavailable in order
        return self.db.statement(sql + " RETURNING id", params, lambda cur: int(cur.fetchone()[0]),
                                 retry_stale=False)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "SqlLedger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the ledger ----------------------------------------------------------------------------------
    def record(
        self,
        *,
        model: str,
        served_by: str,
        route_reason: str,
        input_tokens: int,
        output_tokens: int,
        status: str,
        cost_usd: float,
        latency_ms: float | None = None,
        ttft_ms: float | None = None,
        ts: float | None = None,
        tenant: str | None = None,
        usage_source: str | None = None,
        upstream_model: str | None = None,
        predicted_wait_ms: float | None = None,
        realised_wait_ms: float | None = None,
        admission: Admission | Mapping[str, Any] | None = None,
    ) -> int:
        """Append one request; returns its row id. ``status``: e.g. "ok", "error", "cancelled", or an HTTP code.
        ``tenant``: who sent it (None: reported as ``default``); ``usage_source``: where the token counts came from
        (``provider`` or ``estimated``); ``upstream_model``: the model name the backend answered with;
        ``predicted_wait_ms`` / ``realised_wait_ms``: a request kept local, its predicted and realised wait before
        the first token; ``admission``: what that prediction was computed from (``lmfleet.overflow.admission``),
        stored as JSON."""
        if input_tokens < 0 or output_tokens < 0 or cost_usd < 0:
            raise ValueError(f"negative usage: {input_tokens=} {output_tokens=} {cost_usd=}")
        when = self._clock() if ts is None else ts
        return self._insert(INSERT_REQUEST, (when, model, served_by, route_reason, input_tokens, output_tokens, latency_ms,
                                      ttft_ms, str(status), usd_to_nusd(cost_usd), tenant, usage_source,
                                      upstream_model, predicted_wait_ms, realised_wait_ms,
                                      admission_json(admission)))

    def spend_events(self, since: float, bucket_s: float = 60.0) -> list[tuple[float, float]]:
        """External spend after ``since`` as ``(latest ts in bucket, usd)`` pairs, for ``check_budget``."""
        _, rows = self._fetch(
            "SELECT MAX(ts), SUM(cost_nusd) FROM requests WHERE ts > ? AND served_by LIKE ?"
            f" GROUP BY {self.db.bucket_sql} ORDER BY 1",
            (since, f"{PROVIDER_PREFIX}%", bucket_s),
        )
        return [(float(ts), nusd_to_usd(int(nusd))) for ts, nusd in rows]

    def summary(self, since: float | None = None, until: float | None = None,
                by: Grouping = "served_by") -> list[UsageRow]:
        """One row per ``by`` value (``served_by`` or ``tenant``) over ``[since, until)``, most expensive first.
        Rows without a tenant count as the tenant ``default``."""
        if by not in _GROUP_SQL:
            raise ValueError(f"by={by!r}: expected one of {sorted(_GROUP_SQL)}")
        group = _GROUP_SQL[by]
        where, args = self._where(since, until)
        _, rows = self._fetch(
            f"SELECT {group}, COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cost_nusd)"
            f" FROM requests{where} GROUP BY {group} ORDER BY SUM(cost_nusd) DESC, {group}",
            args,
        )
        return [_row(*r, by=by) for r in rows]

    def totals(self, since: float | None = None, until: float | None = None,
               by: Grouping = "served_by") -> UsageRow:
        """All rows of ``[since, until)`` together (named ``"total"``; ``by`` only names its column in ``as_dict``)."""
        where, args = self._where(since, until)
        _, [(n, inp, out, nusd)] = self._fetch(
            "SELECT COUNT(*), COALESCE(SUM(input_tokens), 0), COALESCE(SUM(output_tokens), 0),"
            f" COALESCE(SUM(cost_nusd), 0) FROM requests{where}",
            args,
        )
        return _row("total", n, inp, out, nusd, by)

    def rows(self, since: float | None = None, until: float | None = None) -> list[dict[str, Any]]:
        """Raw rows (cost in USD), oldest first; for tests and exports."""
        where, args = self._where(since, until)
        names, rows = self._fetch(f"SELECT * FROM requests{where} ORDER BY id", args)
        out = [dict(zip(names, r)) for r in rows]
        for r in out:
            r["cost_usd"] = nusd_to_usd(int(r.pop("cost_nusd")))
        return out

    @staticmethod
    def _where(since: float | None, until: float | None) -> tuple[str, tuple[float, ...]]:
        parts, args = [], []
        if since is not None:
            parts.append("ts >= ?")
            args.append(since)
        if until is not None:
            parts.append("ts < ?")
            args.append(until)
        return (" WHERE " + " AND ".join(parts) if parts else ""), tuple(args)


class Ledger(SqlLedger):
    """The SQLite ledger at ``path`` (created with its folder if missing; an older file is upgraded)."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        super().__init__(SqliteDatabase(path, busy_timeout_s=busy_timeout_s), clock=clock)
        self.path = self.db.path


class PostgresLedger(SqlLedger):
    """The ledger in the PostgreSQL database at ``url`` (tables created or upgraded on open)."""

    def __init__(self, url: str, *, password: str | None = None, connect_timeout_s: float = 5.0,
                 statement_timeout_s: float = 5.0, pool_size: int = 2,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(PgDatabase(url, password=password, connect_timeout_s=connect_timeout_s,
                                    statement_timeout_s=statement_timeout_s, pool_size=pool_size), clock=clock)
        self.url = url

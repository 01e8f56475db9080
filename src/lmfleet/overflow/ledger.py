"""SQLite ledger of every request: who served it, how many tokens, how long, what it cost.

One file (``LedgerConfig.path``), WAL journal, one connection guarded by a lock: safe for one
process whose asyncio gateway calls these (quick, synchronous) methods through
``asyncio.to_thread``. Reopening the file after a restart sees every earlier row.

Costs are stored as integer nano-dollars (``cost_nusd``), so every total is an exact integer sum
of its rows: the per-request costs add up to the reported totals with no float drift.
Timestamps are epoch seconds (``time.time()``), so windows survive restarts.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmfleet.overflow.money import NUSD_PER_USD, nusd_to_usd, usd_to_nusd
from lmfleet.provenance import PROVIDER_PREFIX, local_label, provider_label

__all__ = ["NUSD_PER_USD", "Ledger", "UsageRow", "served_by_local", "served_by_provider", "usd_to_nusd"]

# the ledger's old names for the provenance labels (lmfleet.provenance holds the rule)
served_by_local = local_label
served_by_provider = provider_label

# external rows: served_by starts with "provider/"
_EXTERNAL = f"served_by LIKE '{PROVIDER_PREFIX}%'"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    ts            REAL    NOT NULL,
    model         TEXT    NOT NULL,
    served_by     TEXT    NOT NULL,
    route_reason  TEXT    NOT NULL,
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    latency_ms    REAL,
    ttft_ms       REAL,
    status        TEXT    NOT NULL,
    cost_nusd     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
"""


@dataclass(frozen=True)
class UsageRow:
    served_by: str
    requests: int
    input_tokens: int
    output_tokens: int
    cost_usd: float
    usd_per_1m_output: float | None
    """cost_usd per million output tokens; None when no output tokens."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row(served_by: str, requests: int, inp: int, out: int, nusd: int) -> UsageRow:
    cost = nusd_to_usd(nusd)
    return UsageRow(served_by, requests, inp, out, cost, cost / out * 1e6 if out else None)


class Ledger:
    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
    ) -> int:
        """Append one request; returns its row id. ``status``: e.g. "ok", "error", "cancelled", or an HTTP code."""
        if input_tokens < 0 or output_tokens < 0 or cost_usd < 0:
            raise ValueError(f"negative usage: {input_tokens=} {output_tokens=} {cost_usd=}")
        when = self._clock() if ts is None else ts
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO requests (ts, model, served_by, route_reason, input_tokens, output_tokens,"
                " latency_ms, ttft_ms, status, cost_nusd) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (when, model, served_by, route_reason, input_tokens, output_tokens, latency_ms, ttft_ms,
                 str(status), usd_to_nusd(cost_usd)),
            )
            return int(cur.lastrowid or 0)

    def spend_since(self, ts: float, external_only: bool = True) -> float:
        """USD recorded at or after ``ts`` (external providers only by default)."""
        sql = "SELECT COALESCE(SUM(cost_nusd), 0) FROM requests WHERE ts >= ?"
        if external_only:
            sql += f" AND {_EXTERNAL}"
        with self._lock:
            (nusd,) = self._db.execute(sql, (ts,)).fetchone()
        return nusd_to_usd(nusd)

    def spend_events(self, since: float, bucket_s: float = 60.0) -> list[tuple[float, float]]:
        """External spend after ``since`` as ``(latest ts in bucket, usd)`` pairs, for ``check_budget``."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT MAX(ts), SUM(cost_nusd) FROM requests WHERE ts > ? AND {_EXTERNAL}"
                " GROUP BY CAST(ts / ? AS INTEGER) ORDER BY 1",
                (since, bucket_s),
            ).fetchall()
        return [(ts, nusd_to_usd(nusd)) for ts, nusd in rows]

    def summary(self, since: float | None = None, until: float | None = None) -> list[UsageRow]:
        """One row per ``served_by`` over ``[since, until)``, most expensive first."""
        where, args = self._where(since, until)
        with self._lock:
            rows = self._db.execute(
                "SELECT served_by, COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cost_nusd)"
                f" FROM requests{where} GROUP BY served_by ORDER BY SUM(cost_nusd) DESC, served_by",
                args,
            ).fetchall()
        return [_row(*r) for r in rows]

    def totals(self, since: float | None = None, until: float | None = None) -> UsageRow:
        """All rows of ``[since, until)`` together (``served_by="total"``)."""
        where, args = self._where(since, until)
        with self._lock:
            n, inp, out, nusd = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(input_tokens), 0), COALESCE(SUM(output_tokens), 0),"
                f" COALESCE(SUM(cost_nusd), 0) FROM requests{where}",
                args,
            ).fetchone()
        return _row("total", n, inp, out, nusd)

    def rows(self, since: float | None = None, until: float | None = None) -> list[dict[str, Any]]:
        """Raw rows (cost in USD), oldest first; for tests and exports."""
        where, args = self._where(since, until)
        with self._lock:
            cur = self._db.execute(f"SELECT * FROM requests{where} ORDER BY id", args)
            names = [d[0] for d in cur.description]
            out = [dict(zip(names, r)) for r in cur.fetchall()]
        for r in out:
            r["cost_usd"] = nusd_to_usd(r.pop("cost_nusd"))
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

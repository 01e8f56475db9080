"""``budget`` and ``ledger``: caps on external spend, and the database where costs and reservations are kept."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lmfleet.config.base import Strict

class BudgetConfig(Strict):
    """Spend caps for external providers."""

    hourly_usd: float | None = Field(None, ge=0, description="External spend cap per rolling hour (USD).")
    daily_usd: float | None = Field(None, ge=0, description="External spend cap per rolling day (USD).")
    on_exhausted: Literal["queue", "reject"] = Field(
        "queue", description="When spent, or while the budget store (ledger database) is down: keep requests "
        "that would overflow local (queue) or answer 429 with Retry-After (reject)."
    )


class LedgerConfig(Strict):
    """Where request costs and budget reservations live: a SQLite file (one node) or PostgreSQL (several)."""

    path: str = Field("~/.cache/lmfleet/ledger.sqlite", description="SQLite file of per-request usage and cost.")
    url: str | None = Field(
        None, description="PostgreSQL shared by several gateway nodes: postgresql://USER@HOST:PORT/DBNAME "
        "(no password here: see password_env). Null: the SQLite file at `path`."
    )
    password_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Env var holding the PostgreSQL password (never inline)."
    )
    connect_timeout_s: float = Field(
        5.0, ge=2, le=60, description="Longest wait for the database: PostgreSQL connect, statement and lock "
        "timeouts; SQLite busy timeout. Past it a paid request is not admitted (fail closed)."
    )
    reservation_ttl_s: float = Field(
        900.0, gt=0, description="A budget reservation not settled by then stops counting (its gateway died). "
        "Keep it above every provider's timeouts.total_s."
    )

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
        except ValueError as e:
            raise ValueError(f"not a URL ({e}); expected postgresql://USER@HOST:PORT/DBNAME") from None
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError(f"scheme {parts.scheme!r} is not supported; expected postgresql://USER@HOST:PORT/DBNAME")
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError("needs a host and a database name: postgresql://USER@HOST:PORT/DBNAME")
        if parts.password is not None:
            raise ValueError("holds a password; put it in an env var and name that var in ledger.password_env")
        return v

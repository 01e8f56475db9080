"""The store's interfaces, its records and its errors.

Exceptions::

    LmfleetError
     └── SpendStoreError       anything the store cannot do
          └── StoreUnavailable the database cannot be read or written (down, locked, full, unreachable):
                               reservations fail closed; the gateway closes the provider route
                               (keeps the request local or answers 429). Recoverable: a later call retries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from lmfleet.errors import LmfleetError
from lmfleet.overflow.admission import Admission
from lmfleet.store.caps import GLOBAL, Cap, Refusal
from lmfleet.store.schema import Dialect, Query

__all__ = ["Database", "Reservation", "Spend", "SpendStore", "SpendStoreError", "StoreUnavailable", "UsageRecord"]


class SpendStoreError(LmfleetError):
    """The store (spend, ledger, tenants' counters) could not do what was asked."""


class StoreUnavailable(SpendStoreError):
    """The ledger database cannot be used now; no spend is admitted until it can. ``str()`` is one line."""


T = TypeVar("T")


class Database(Protocol):
    """One database (``SqliteDatabase``, ``PgDatabase``), migrated to the current schema when opened."""

    dialect: Dialect
    bucket_sql: str
    """SQL that turns ``ts`` into a bucket number of ``?`` seconds."""

    def transaction(self, keys: Sequence[str] = ()) -> AbstractContextManager[Query]:
        """One transaction holding every key's lock; database errors become ``StoreUnavailable``."""
        ...

    def statement(self, sql: str, params: Sequence[Any], read: Callable[[Any], T], *, retry_stale: bool) -> T:
        """One statement on its own (autocommit), ``read(cursor)`` its result."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Reservation:
    """Worst-case spend held for one provider request until it is settled or released (or expires)."""

    id: str
    request_id: str
    amount_nusd: int
    keys: tuple[str, ...]
    """The cap keys it counts against."""
    expires_at: float
    """Epoch seconds after which the hold no longer counts (a gateway that died mid-request)."""


@dataclass(frozen=True)
class Spend:
    """What counts against one key's caps over a window: settled spend plus held reservations."""

    settled_nusd: int
    held_nusd: int


@dataclass(frozen=True)
class UsageRecord:
    """One ledger row (the ``requests`` table that ``Ledger`` reads); its cost is passed beside it."""

    model: str
    served_by: str
    route_reason: str
    input_tokens: int
    output_tokens: int
    status: str
    latency_ms: float | None = None
    ttft_ms: float | None = None
    tenant: str | None = None
    """The tenant whose key sent it; None: untagged (reports show it as ``default``)."""
    usage_source: str | None = None
    """Where the token counts came from: ``provider`` (the backend's usage) or ``estimated`` (counted by the gateway
    with the model's tokenizer, for an answer without usage); None: not said."""
    upstream_model: str | None = None
    """The model name the backend answered with (None: it named none)."""
    predicted_wait_ms: float | None = None
    """A request kept local: the wait before its first token the router predicted (None: sent out, or no estimate)."""
    realised_wait_ms: float | None = None
    """A request kept local: the wait it had, dispatch to first token as the gateway saw it (None: no first token
    measured, see ``lmfleet.overflow.estimate_error``)."""
    admission: Admission | Mapping[str, Any] | None = None
    """A request kept local with an estimate: what the estimate was computed from (``lmfleet.overflow.admission``;
    written as JSON by the ledger's writer)."""

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"negative usage: {self.input_tokens=} {self.output_tokens=}")


@runtime_checkable
class SpendStore(Protocol):
    """Exact, shared spend caps: reserve before a paid request, settle (or release) when it ends.

    Every method is synchronous and quick (one short transaction); an asyncio caller runs it through
    ``asyncio.to_thread``. Implementations: ``SqliteSpendStore`` (one node, several processes) and
    ``PostgresSpendStore`` (several nodes).
    """

    def reserve(self, request_id: str, amount_nusd: int, caps: Sequence[Cap]) -> Reservation | Refusal:
        """Hold ``amount_nusd`` against every cap in ``caps`` atomically, or refuse (a falsy ``Refusal``).

        Raises ``StoreUnavailable`` when the database cannot be used: no spend is admitted then.
        """
        ...

    def settle(self, reservation: Reservation, actual_nusd: int, record: UsageRecord | None = None) -> bool:
        """Replace the hold by the real cost, and write the ledger row, in one transaction.

        False when the reservation was already settled or released. A write that fails is kept and
        retried before the next reservation (which fails closed until it succeeds).
        """
        ...

    def release(self, reservation: Reservation, record: UsageRecord | None = None) -> bool:
        """Drop the hold of a request that spent nothing (failed before the provider charged)."""
        ...

    def record(self, record: UsageRecord, cost_nusd: int) -> None:
        """Write a ledger row that reserved nothing (a local request), in the same database."""
        ...

    def spent(self, window_s: float, key: str = GLOBAL) -> Spend:
        """What counts against ``key``'s caps over the last ``window_s`` now."""
        ...

    def close(self) -> None: ...

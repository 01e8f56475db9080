"""The running fleet's configuration, kept in the cluster: one numbered version that every process reads.

``lmfleet serve`` writes the fleet it starts with; ``lmfleet apply`` reads it to show what a new file changes,
then writes the new one as the next version; gateways read the number (``/admin/state``: ``fleet_version``).
It lives in Ray's GCS key-value store (namespace :data:`NAMESPACE`), which outlives any one process or node
but not the cluster::

    fleet/current   -> b"7"                        the version in force
    fleet/v7        -> {"version": 7, "written_at": ..., "source": ..., "fleet": {...}}

A version's record is written once and never overwritten (GCS ``put`` without overwrite), so two ``apply`` runs
racing for the same number cannot both win: the loser gets :class:`VersionConflict` and changes nothing. The
record holds the fleet as loaded (``model_dump``), which is what a gateway needs to rebuild its settings; a fleet
file names its secrets' environment variables, it does not hold them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lmfleet.config.models import FleetConfig
from lmfleet.errors import LmfleetError

__all__ = ["NAMESPACE", "FleetStore", "KeyValue", "MemoryKV", "RayKV", "StoredFleet", "VersionConflict"]

NAMESPACE = "lmfleet"
CURRENT_KEY = "fleet/current"


def version_key(version: int) -> str:
    return f"fleet/v{version}"


class VersionConflict(LmfleetError):
    """The stored fleet is not the version this change was computed against (someone else applied first)."""


class KeyValue(Protocol):
    """The part of a key-value store the fleet store needs (Ray's GCS; :class:`MemoryKV` in tests)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        """Store ``value``; returns whether ``key`` already had a value (then, without overwrite, nothing changed)."""
        ...


class RayKV:
    """The Ray cluster's GCS key-value store, in :data:`NAMESPACE`: through ``client`` (a
    :func:`lmfleet.ray_private.gcs_client`, no ``ray.init`` needed) when given, else through the connected driver's
    (``ray.init`` first)."""

    def __init__(self, client: object = None) -> None:
        self.client = client

    def get(self, key: str) -> bytes | None:
        from lmfleet.ray_private import kv_get

        return kv_get(key, NAMESPACE, self.client)

    def put(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        from lmfleet.ray_private import kv_put

        return kv_put(key, value, overwrite=overwrite, namespace=NAMESPACE, client=self.client)


class MemoryKV:
    """A dict with :class:`KeyValue`'s semantics (tests, and a fleet without Ray)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        existed = key in self.data
        if overwrite or not existed:
            self.data[key] = value
        return existed


@dataclass(frozen=True)
class StoredFleet:
    """One stored version of the running fleet."""

    version: int
    fleet: FleetConfig
    written_at: float
    """Unix time the version was stored."""
    source: str
    """Who wrote it and from what: ``serve /etc/lmfleet/fleet.yaml``, ``apply fleet.yaml``."""


class FleetStore:
    """Read and write the running fleet's numbered versions in a :class:`KeyValue` store."""

    def __init__(self, kv: KeyValue, clock: Callable[[], float] = time.time) -> None:
        self._kv = kv
        self._clock = clock

    def current_version(self) -> int | None:
        """The version in force, or None when no fleet was stored (one key read: cheap enough to poll)."""
        raw = self._kv.get(CURRENT_KEY)
        return int(raw) if raw else None

    def read(self, version: int | None = None) -> StoredFleet | None:
        """``version`` (default: the one in force), or None when there is none."""
        version = self.current_version() if version is None else version
        raw = self._kv.get(version_key(version)) if version is not None else None
        if raw is None:
            return None
        record = json.loads(raw)
        return StoredFleet(record["version"], FleetConfig.model_validate(record["fleet"]), record["written_at"],
                           record["source"])

    def publish(self, fleet: FleetConfig, *, source: str) -> StoredFleet:
        """Store ``fleet`` as the next version whatever is in force (``lmfleet serve`` at start: the fleet it runs)."""
        return self.write(fleet, source=source, expected=self.current_version())

    def write(self, fleet: FleetConfig, *, source: str, expected: int | None) -> StoredFleet:
        """Store ``fleet`` as the version after ``expected`` (the one the caller read; None: the first) and make it
        the one in force. :class:`VersionConflict` when another version came in between."""
        current = self.current_version()
        if current != expected:
            raise VersionConflict(f"the running fleet is at version {current}, not {expected}: another change was "
                                  "applied meanwhile; run the command again to see the difference from it")
        stored = StoredFleet((expected or 0) + 1, fleet, self._clock(), source)
        record = {"version": stored.version, "written_at": stored.written_at, "source": source,
                  "fleet": fleet.model_dump(mode="json")}
        if self._kv.put(version_key(stored.version), json.dumps(record).encode(), overwrite=False):
            raise VersionConflict(f"version {stored.version} of the running fleet was just written by another "
                                  "command; run this one again to see the difference from it")
        self._kv.put(CURRENT_KEY, str(stored.version).encode(), overwrite=True)
        return stored

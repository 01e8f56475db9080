"""Which version of the running fleet this gateway process sees: the cluster's stored version
(:mod:`lmfleet.cluster.fleet_store`), polled every :data:`FLEET_POLL_S` seconds, shown by ``/admin/state``.

The reader is injected (the process that runs the gateway on a Ray cluster passes the GCS store's
``current_version``; tests pass a function), so this module does no I/O of its own. A failed read keeps the last
version: the store is advisory for the request path, which never waits on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("lmfleet.gateway")

FLEET_POLL_S = 2.0
"""How often the stored version is read (one small GCS read): a new version is seen within this long, as key
files are re-read."""


class FleetWatch:
    """The stored fleet version this process runs under; ``on_version`` takes each new one (the first read
    included: a process started from its own file converges to the cluster's version)."""

    def __init__(self, read_version: Callable[[], int | None], *, period_s: float = FLEET_POLL_S,
                 on_version: Callable[[int], Awaitable[None]] | None = None) -> None:
        self._read = read_version
        self._period_s = period_s
        self._on_version = on_version
        self.version: int | None = None
        """The version this process has taken; None before the first read or without a store."""

    async def poll_once(self) -> int | None:
        """Read the stored version once; run ``on_version`` if it moved. Returns the version seen."""
        try:
            seen = await asyncio.to_thread(self._read)
        except Exception as e:  # the GCS restarting or unreachable: keep serving under the version we have
            log.warning("gateway: cannot read the running fleet's version (keeping %s): %s", self.version, e)
            return self.version
        if seen is None or seen == self.version:
            return self.version
        if self._on_version is not None:
            try:
                await self._on_version(seen)
            except Exception:  # this process stays on the version it has; the next poll tries again
                log.exception("gateway: cannot take version %s of the running fleet (keeping %s)", seen,
                              self.version)
                return self.version
        self.version = seen
        return seen

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self._period_s)

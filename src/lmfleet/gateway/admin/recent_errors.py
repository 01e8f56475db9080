"""The gateway's last warnings and errors, in memory, for the operator dashboard.

Every failure the gateway handles is already logged on the ``lmfleet.gateway`` logger (failed upstream attempts,
broken streams, an unreachable budget store or registry, unexpected errors), so a logging handler that keeps
the last ``maxlen`` records is the whole mechanism: no hook in the request path, nothing kept when nothing
fails. One ring per process (:func:`recent_errors`), shared by every gateway the process builds.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

__all__ = ["ErrorEntry", "RecentErrors", "recent_errors"]

LOGGER = "lmfleet.gateway"


@dataclass(frozen=True)
class ErrorEntry:
    t: float
    """When it was logged (epoch seconds)."""
    level: str
    message: str
    """The log line's first ``max_chars`` characters, with the exception's type when there was one."""


class RecentErrors(logging.Handler):
    """A logging handler that keeps the last ``maxlen`` records at WARNING or above."""

    def __init__(self, maxlen: int = 100, max_chars: int = 400) -> None:
        super().__init__(logging.WARNING)
        self.max_chars = max_chars
        self._ring: deque[ErrorEntry] = deque(maxlen=maxlen)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string must not lose the record (nor raise in the caller)
            msg = str(record.msg)
        if record.exc_info and record.exc_info[0] is not None:
            msg = f"{msg} ({record.exc_info[0].__name__})"
        self._ring.append(ErrorEntry(record.created, record.levelname, msg[: self.max_chars]))

    def entries(self) -> list[ErrorEntry]:
        """Oldest first."""
        with self.lock:  # type: ignore[union-attr]
            return list(self._ring)


_RING: RecentErrors | None = None


def recent_errors() -> RecentErrors:
    """The process's ring, attached to the ``lmfleet.gateway`` logger on first use."""
    global _RING
    if _RING is None:
        _RING = RecentErrors()
        logging.getLogger(LOGGER).addHandler(_RING)
    return _RING

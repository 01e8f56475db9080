"""The root of lmfleet's own exceptions.

Every exception that lmfleet raises on purpose derives from ``LmfleetError``, so that a caller embedding lmfleet
can catch "anything lmfleet refused or could not do" in one clause. Subclasses may also derive from a builtin
(``ValueError``, ``RuntimeError``, ``KeyError``) where callers already catch that.
"""

from __future__ import annotations

__all__ = ["LmfleetError"]


class LmfleetError(Exception):
    """Base class of every exception lmfleet defines."""

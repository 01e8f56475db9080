"""The root of lmfleet's own exceptions.

Every exception that lmfleet raises on purpose derives from ``LmfleetError``, so that a caller embedding lmfleet
can catch "anything lmfleet refused or could not do" in one clause. Subclasses may also derive from a builtin
(``ValueError``, ``RuntimeError``, ``KeyError``) where callers already catch that.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LmfleetError", "openai_error_body"]


class LmfleetError(Exception):
    """Base class of every exception lmfleet defines."""


def openai_error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
                      code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``: the one builder of that shape
    (the gateway's answers, the tenants' refusals and the admin API all use it)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}

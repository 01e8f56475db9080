"""The outcome of one check, and how a list of outcomes becomes an exit code."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # could not run here (offline, no local files...); says why

    @property
    def rank(self) -> int:
        return {"pass": 0, "skip": 0, "warn": 1, "fail": 2}[self.value]


@dataclass(frozen=True)
class CheckResult:
    """One finding: ``check`` is the check's id (``memory.fit``), ``subject`` what it is about (a model, a node)."""

    check: str
    subject: str
    status: Status
    message: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "subject": self.subject, "status": self.status.value,
                "message": self.message, "fix": self.fix, "data": self.data}


def passed(check: str, subject: str, message: str, **data: Any) -> CheckResult:
    return CheckResult(check, subject, Status.PASS, message, None, data)


def warned(check: str, subject: str, message: str, fix: str, **data: Any) -> CheckResult:
    return CheckResult(check, subject, Status.WARN, message, fix, data)


def failed(check: str, subject: str, message: str, fix: str, **data: Any) -> CheckResult:
    return CheckResult(check, subject, Status.FAIL, message, fix, data)


def skipped(check: str, subject: str, message: str, **data: Any) -> CheckResult:
    return CheckResult(check, subject, Status.SKIP, message, None, data)


EXIT_OK, EXIT_WARN, EXIT_FAIL = 0, 1, 2


def exit_code(results: list[CheckResult], *, warn_ok: bool = False) -> int:
    """0 all passed, 1 warnings only (0 with ``warn_ok``), 2 any failure."""
    worst = max((r.status.rank for r in results), default=0)
    if worst == 2:
        return EXIT_FAIL
    if worst == 1 and not warn_ok:
        return EXIT_WARN
    return EXIT_OK

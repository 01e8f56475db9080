"""Render check results: a rich table for people, JSON for machines."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmfleet.check.result import CheckResult, Status

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


def render_table(results: list[CheckResult], console: Console, *, title: str = "lmfleet check") -> None:
    table = Table(title=title, show_lines=True, expand=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("subject", overflow="fold")
    table.add_column("finding", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for r in results:
        table.add_row(Text(r.status.value.upper(), style=_STYLE[r.status]), Text(r.check), Text(r.subject), Text(r.message),
                      Text(r.fix or ""))
    console.print(table)
    counts = {s: sum(r.status is s for r in results) for s in Status}
    console.print(" ".join(f"[{_STYLE[s]}]{counts[s]} {s.value}[/]" for s in Status))


def to_json(results: list[CheckResult], *, exit_code: int, extra: dict[str, Any] | None = None) -> str:
    counts = {s.value: sum(r.status is s for r in results) for s in Status}
    return json.dumps({"exit_code": exit_code, "counts": counts, "results": [r.to_dict() for r in results],
                       **(extra or {})}, indent=2, default=str)

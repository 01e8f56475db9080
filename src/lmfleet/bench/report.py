"""The benchmark report: one dict (built by a pure function) rendered as JSON, CSV and a rich table."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from lmfleet.bench.cost import Price, cost_table
from lmfleet.bench.loadgen import RequestRecord
from lmfleet.bench.metrics import SLO, group_by, measurement_window, summarize, timeseries

SCHEMA_VERSION = 1


def build_report(records: Sequence[RequestRecord], *, warmup: float, slo: SLO = SLO(),
                 prices: dict[str, Price] | None = None, ledger: dict | None = None,
                 meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the outputs show: overall, per provider, per class, cost, time series, raw latencies."""
    measured = [r for r in records if not r.warmup]
    duration = measurement_window(records, warmup)
    by_provider = group_by(measured, lambda r: r.provider)
    by_class = group_by(measured, lambda r: r.cls)
    tokens = {p: (sum(r.prompt_tokens for r in rs if r.ok), sum(r.output_tokens for r in rs if r.ok))
              for p, rs in by_provider.items()}
    cost = cost_table(tokens, prices or {}, ledger)
    providers = {p: summarize(rs, duration, slo) for p, rs in by_provider.items()}
    for p, s in providers.items():
        s["cost_usd"] = cost["providers"][p]["cost_usd"]
        s["usd_per_1m_output"] = cost["providers"][p]["usd_per_1m_output"]
        s["cost_source"] = cost["providers"][p]["source"]
    overall = summarize(measured, duration, slo)
    overall["cost_usd"] = cost["overall"]["cost_usd"]
    overall["usd_per_1m_output"] = cost["overall"]["usd_per_1m_output"]
    overall["cost_complete"] = cost["overall"]["complete"]
    return {
        "schema_version": SCHEMA_VERSION,
        "meta": {**(meta or {}), "warmup_s": warmup, "warmup_requests_excluded": len(records) - len(measured),
                 "slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms, "e2el": slo.e2el_ms}},
        "overall": overall,
        "providers": providers,
        "classes": {c: summarize(rs, duration, slo) for c, rs in by_class.items()},
        "timeseries": timeseries(measured),
        "samples": {p: {"ttft_s": [r.ttft for r in rs if r.ok], "e2el_s": [r.latency for r in rs if r.ok]}
                    for p, rs in by_provider.items()},
    }


def check_consistency(report: dict[str, Any]) -> list[str]:
    """Problems where the parts of a report do not add up (empty list = consistent)."""
    problems = []
    o = report["overall"]
    for section in ("providers", "classes"):
        groups = report[section].values()
        for key in ("requests", "completed", "failed", "input_tokens", "output_tokens"):
            total = sum(g[key] for g in groups)
            if total != o[key]:
                problems.append(f"{section}: sum of {key} = {total}, overall = {o[key]}")
    if o["completed"] + o["failed"] != o["requests"]:
        problems.append(f"overall: completed {o['completed']} + failed {o['failed']} != requests {o['requests']}")
    return problems


# ---------------------------------------------------------------- JSON / CSV

def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, default=float))


def flat_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Long format: one row per (scope, group, metric)."""
    rows = []
    groups = [("overall", "all", report["overall"])]
    groups += [("provider", k, v) for k, v in report["providers"].items()]
    groups += [("class", k, v) for k, v in report["classes"].items()]
    for scope, name, s in groups:
        for key, value in s.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    rows.append({"scope": scope, "group": name, "metric": f"{key}.{sub}", "value": v})
            else:
                rows.append({"scope": scope, "group": name, "metric": key, "value": value})
    return rows


def write_csv(report: dict[str, Any], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["scope", "group", "metric", "value"])
        w.writeheader()
        w.writerows(flat_rows(report))


# ---------------------------------------------------------------- terminal table

# (row label, getter) in the operators' report order
TABLE_ROWS: list[tuple[str, Any]] = [
    ("Requests (ok / failed)", lambda s: f"{s['completed']} / {s['failed']}"),
    ("Throughput (output tok/s)", lambda s: f"{s['output_throughput']:.1f}"),
    ("Total tokens/s", lambda s: f"{s['total_token_throughput']:.1f}"),
    ("Requests/s", lambda s: f"{s['request_throughput']:.2f}"),
    ("E2E latency P50 (ms)", lambda s: f"{s['e2el_ms']['p50']:.0f}"),
    ("E2E latency P95 (ms)", lambda s: f"{s['e2el_ms']['p95']:.0f}"),
    ("E2E latency P99 (ms)", lambda s: f"{s['e2el_ms']['p99']:.0f}"),
    ("TTFT P50 / P99 (ms)", lambda s: f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f}"),
    ("TPOT P50 / P99 (ms)", lambda s: f"{s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p99']:.1f}"),
    ("ITL P50 / P99 (ms)", lambda s: f"{s['itl_ms']['p50']:.1f} / {s['itl_ms']['p99']:.1f}"),
    ("Error rate", lambda s: f"{100 * s['error_rate']:.2f}%"
     + (f" ({', '.join(f'{k}: {v}' for k, v in s['errors_by_status'].items())})" if s["errors_by_status"] else "")),
    ("Goodput (req/s) / SLO met", lambda s: "-" if s["goodput_rps"] is None
     else f"{s['goodput_rps']:.2f} / {100 * s['slo_attainment']:.1f}%"),
    ("$ / 1M output tokens", lambda s: "-" if s.get("usd_per_1m_output") is None
     else f"{s['usd_per_1m_output']:.3f}"),
]


TABLE_WIDTH = 200
"""Columns the tables may take when stdout is not a terminal (a table takes only what it needs)."""


def table_console() -> Console:
    """Where the tables go: the terminal's width on a terminal; to a file or a pipe, room for every column (rich
    would fold them at 80 columns, breaking row labels over lines)."""
    plain = Console()
    return plain if plain.is_terminal else Console(width=max(plain.width, TABLE_WIDTH))


def render_tables(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or table_console()
    for title, section in (("per provider", "providers"), ("per workload class", "classes")):
        table = Table(title=f"lmfleet bench — {title}", title_justify="left")
        table.add_column("Metric")
        groups = list(report[section].items())
        for name, _ in groups:
            table.add_column(name, justify="right")
        table.add_column("Overall", justify="right", style="bold")
        for label, get in TABLE_ROWS:
            if section == "classes" and label.startswith("$"):
                continue
            table.add_row(label, *(get(s) for _, s in groups), get(report["overall"]))
        console.print(table)

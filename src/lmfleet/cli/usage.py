"""``lmfleet usage``: requests, tokens and cost per backend or per tenant, from the ledger (SQLite or PostgreSQL);
``--advise``: rent or buy per model (:mod:`lmfleet.overflow.advise`); ``--estimate``: how wrong the predicted local
wait was, per model (:mod:`lmfleet.overflow.estimate_error`)."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, get_args

import typer
from rich.console import Console
from rich.table import Table

from lmfleet.cli.common import EXIT_USAGE, fail, load_or_exit
from lmfleet.config.models import FleetConfig, LedgerConfig
from lmfleet.overflow.advise import AdviceRow, advise, facts_from_rows, replica_hour_nusd
from lmfleet.overflow.estimate_error import EstimateError, estimate_errors, samples_from_rows
from lmfleet.store import DEFAULT_TENANT, Grouping, SpendStoreError, StoreUnavailable, UsageRow, describe, open_ledger

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(value: str, now: float) -> float:
    """``1h``, ``30m``, ``7d``, ``2w`` (ago from ``now``) or an ISO time (naive = UTC) -> epoch seconds."""
    m = _DURATION_RE.match(value)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {value!r}: expected a duration like 1h, 24h, 7d or an ISO time like 2026-11-29T12:00") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _money(x: float) -> str:
    return f"{x:.6f}" if x < 1 else f"{x:,.2f}"


def _table(rows: list[UsageRow], total: UsageRow, title: str, by: Grouping) -> Table:
    t = Table(title=title)
    t.add_column("served by" if by == "served_by" else "tenant")
    for col in ("requests", "input tokens", "output tokens", "cost $", "$/1M output"):
        t.add_column(col, justify="right")
    for r in [*rows, total]:
        per = "-" if r.usd_per_1m_output is None else _money(r.usd_per_1m_output)
        cells = [r.name, f"{r.requests:,}", f"{r.input_tokens:,}", f"{r.output_tokens:,}", _money(r.cost_usd), per]
        t.add_row(*cells, style="bold" if r is total else None, end_section=r is rows[-1] if rows else False)
    return t


def usage(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Fleet file whose ledger (ledger.url, else ledger.path) to read (default: the embedded default fleet)."),
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="SQLite ledger file to read (overrides the fleet file's ledger)."),
    since: Optional[str] = typer.Option(None, "--since", help="Only requests since: 1h, 24h, 7d, or an ISO time. Default: all."),
    by: str = typer.Option("served_by", "--by", help=f"Group by: served_by (local model or provider) or tenant (rows without one: {DEFAULT_TENANT})."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    advise_: bool = typer.Option(False, "--advise", help="Rent or buy: per model, hours in which overflow spend "
                                 "exceeded one more replica's hourly cost (the fleet file's cost.gpu_hour_usd x its "
                                 "GPUs, or cost.node_hour_usd), and that replica's cost over the window against the "
                                 "overflow's."),
    estimate: bool = typer.Option(False, "--estimate", help="The predicted local wait against the realised one "
                                  "(streamed requests kept local): per model, requests, the share that waited past "
                                  "the model's overflow.threshold_ms (missed), median and P90 absolute error (ms and "
                                  "% of the threshold), bias (median signed error and median actual/predicted), over "
                                  "--since."),
) -> None:
    """Show requests, tokens and cost per backend (local model or provider) or per tenant, from the ledger.

    Exit 1 when the ledger cannot be read (no SQLite file yet, PostgreSQL unreachable); 2 on bad options."""
    if by not in get_args(Grouping):
        fail(f"--by {by!r}: expected one of {', '.join(get_args(Grouping))}", EXIT_USAGE)
    if advise_ and estimate:
        fail("--advise and --estimate: choose one", EXIT_USAGE)
    fleet = load_or_exit(config)
    cfg = fleet.ledger if ledger is None else LedgerConfig(path=str(ledger))
    where = describe(cfg)
    if cfg.url is None and not Path(where).exists():
        fail(f"no ledger at {where} (nothing served yet, or a different ledger.path)", 1)
    now = time.time()
    try:
        start = parse_since(since, now) if since else None
    except ValueError as e:
        fail(str(e), EXIT_USAGE)
    try:
        with open_ledger(cfg) as led:
            if advise_ or estimate:
                raw = led.rows(since=start)
            else:
                rows = led.summary(since=start, by=by)  # type: ignore[arg-type]  # checked above
                total = led.totals(since=start, by=by)  # type: ignore[arg-type]
    except StoreUnavailable as e:
        fail(str(e), 1)
    except SpendStoreError as e:  # ledger.password_env unset, psycopg missing
        fail(f"ledger: {e}", EXIT_USAGE)
    if estimate:
        thresholds = {m.name: m.overflow.threshold_ms for m in fleet.models}
        errors = estimate_errors(samples_from_rows(raw), thresholds)
        if as_json:
            typer.echo(json.dumps({"ledger": where, "since": start, "until": now,
                                   "models": [e.as_dict(thresholds.get(e.model)) for e in errors]}, indent=2))
            return
        Console().print(_estimate_table(errors, thresholds, where, _span(start)))
        return
    if advise_:
        window = (start, now) if start is not None else None
        advice = advise(facts_from_rows(raw), replica_hours(fleet), window=window)
        if as_json:
            typer.echo(json.dumps({"ledger": where, "since": start, "until": now,
                                   "models": [a.as_dict() for a in advice]}, indent=2))
            return
        console = Console()
        for a in advice:
            console.print(_advice_table(a))
        return
    if as_json:
        out = {
            "ledger": where,
            "by": by,
            "since": start,
            "until": now,
            "rows": [r.as_dict() for r in rows],
            "total": total.as_dict(),
        }
        typer.echo(json.dumps(out, indent=2))
        return
    Console().print(_table(rows, total, f"Usage ({_span(start)}) — {where}", by))


def _span(start: float | None) -> str:
    return "all time" if start is None else f"since {datetime.fromtimestamp(start, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def replica_hours(fleet: FleetConfig) -> dict[str, int]:
    """Each model's cost of one more replica per hour (nano-dollars), by the device its engine runs on."""
    from lmfleet.engine.app import engine_device

    return {m.name: replica_hour_nusd(m, uses_gpus=engine_device(m) == "gpu") for m in fleet.models}


def _advice_table(a: AdviceRow) -> Table:
    d = a.as_dict()
    t = Table(title=f"Rent or buy — {a.model}: {a.verdict}")
    t.add_column("")
    t.add_column("overflow (rent)", justify="right")
    t.add_column("one more replica (buy)", justify="right")
    per = (lambda x: "-" if x is None else _money(x))  # noqa: E731
    t.add_row("whole window", f"{_money(d['overflow_usd'])} $", f"{_money(d['replica_usd'])} $ ({a.hours} h)")
    t.add_row("hours over", f"{_money(d['overflow_over_usd'])} $",
              f"{_money(d['replica_over_usd'])} $ ({a.hours_over} h of {a.hours})")
    t.add_row("$/1M tokens the providers served", per(a.overflow_usd_per_1m), per(a.replica_usd_per_1m))
    t.add_row("replica-hour", "", f"{_money(d['replica_hour_usd'])} $")
    return t


def _estimate_table(errors: list[EstimateError], thresholds: dict[str, float], where: str, span: str) -> Table:
    t = Table(title=f"Predicted local wait vs realised ({span}) — {where}",
              caption=None if errors else "no request kept local with both figures in this window")
    t.add_column("model")
    for col in ("requests", "missed (> threshold)", "median |err| ms", "P90 |err| ms", "P90 % of threshold",
                "bias ms", "median actual/predicted"):
        t.add_column(col, justify="right")
    for e in errors:
        d = e.as_dict(thresholds.get(e.model))
        pct = d["p90_abs_error_pct_of_threshold"]
        ratio = d["median_actual_over_predicted"]
        missed = "-" if e.missed is None else f"{e.missed:,} ({d['missed_pct']:.1f} %)"
        t.add_row(e.model, f"{e.count:,}", missed, f"{e.median_abs_error_ms:.0f}", f"{e.p90_abs_error_ms:.0f}",
                  "-" if pct is None else f"{pct:.0f} %", f"{e.bias_ms:+.0f}", "-" if ratio is None else f"{ratio:.2f}")
    return t

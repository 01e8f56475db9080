"""`lmfleet usage`: --since parsing, table and JSON output from a ledger file."""

import json
import time
from datetime import datetime, timezone

import pytest
from typer.testing import CliRunner

from lmfleet.cli.main import app
from lmfleet.cli.usage import parse_since
from lmfleet.overflow.ledger import Ledger

NOW = 1_800_000_000.0
ISO = datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1h", NOW - 3600),
        ("24h", NOW - 86400),
        ("7d", NOW - 7 * 86400),
        ("30m", NOW - 1800),
        ("1.5h", NOW - 5400),
        ("2w", NOW - 14 * 86400),
        # ISO times; naive means UTC
        ("2027-01-15T08:00:00Z", ISO),
        ("2027-01-15T08:00:00", ISO),
        ("2027-01-15T09:00:00+01:00", ISO),
    ],
)
def test_parse_since(value, expected):
    assert parse_since(value, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("value", ["yesterday", "1y", "", "h1"])
def test_parse_since_rejects(value):
    with pytest.raises(ValueError, match="expected a duration"):
        parse_since(value, NOW)


@pytest.fixture
def ledger_path(tmp_path):
    path = tmp_path / "ledger.sqlite"
    now = time.time()
    with Ledger(path) as led:
        for ago, sb, i, o, c in [(10, "local/smollm2", 100, 200, 0.001), (20, "provider/acme", 50, 1000, 0.0006),
                                 (7200, "provider/acme", 50, 1000, 0.0006)]:
            led.record(model="smollm2", served_by=sb, route_reason="x", input_tokens=i, output_tokens=o,
                       status="ok", cost_usd=c, ts=now - ago)
    return path


@pytest.mark.parametrize(
    "since, rows, total_requests, total_cost",
    [(None, 2, 3, 0.0022), ("1h", 2, 2, 0.0016), ("1s", 0, 0, 0.0)],
)
def test_usage_json(ledger_path, since, rows, total_requests, total_cost):
    args = ["usage", "--ledger", str(ledger_path), "--json"] + (["--since", since] if since else [])
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert len(out["rows"]) == rows
    assert out["total"]["requests"] == total_requests
    assert out["total"]["cost_usd"] == pytest.approx(total_cost)


def test_usage_table(ledger_path):
    res = CliRunner().invoke(app, ["usage", "--ledger", str(ledger_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for text in ("local/smollm2", "provider/acme", "total", "$/1M output"):
        assert text in res.output


def test_usage_reads_ledger_path_from_fleet_file(ledger_path, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models:\n  - name: tiny\n    source: builtin:tiny-random\nledger:\n  path: {ledger_path}\n")
    res = CliRunner().invoke(app, ["usage", "-c", str(fleet), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["total"]["requests"] == 3


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--ledger", "/nonexistent/l.sqlite"], 1, "no ledger at"),
        (["--since", "yesterday"], 2, "expected a duration"),
    ],
)
def test_usage_errors(ledger_path, args, code, message):
    if "--ledger" not in args:
        args = ["--ledger", str(ledger_path), *args]
    res = CliRunner().invoke(app, ["usage", *args])
    assert res.exit_code == code
    assert message in res.output

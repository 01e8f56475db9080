"""`lmfleet usage`: --since parsing, table and JSON output, by backend or tenant, from a ledger file or a
PostgreSQL ledger (ledger.url); errors and exit codes."""

import json
import socket
import time
from datetime import datetime, timezone

import pytest
from typer.testing import CliRunner

from lmfleet.cli.main import app
from lmfleet.cli.usage import parse_since
from lmfleet.config.models import LedgerConfig
from lmfleet.store import Ledger, open_ledger
from lmfleet.testing.pg_server import PgUnavailable
from lmfleet.testing.pg_shared import fresh_database, shared_pg_server

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
                       status="ok", cost_usd=c, ts=now - ago, tenant="acme" if sb == "provider/acme" else None)
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


@pytest.mark.parametrize(
    "since, expected",
    # cost in nano-dollars
    [(None, {"acme": (2, 1_200_000), "default": (1, 1_000_000)}),
     ("1h", {"default": (1, 1_000_000), "acme": (1, 600_000)})],
)
def test_usage_by_tenant(ledger_path, since, expected):
    args = ["usage", "--ledger", str(ledger_path), "--json", "--by", "tenant"] + (["--since", since] if since else [])
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["by"] == "tenant"
    assert {r["tenant"]: (r["requests"], round(r["cost_usd"] * 1e9)) for r in out["rows"]} == expected
    assert out["total"]["tenant"] == "total"
    table = CliRunner().invoke(app, ["usage", "--ledger", str(ledger_path), "--by", "tenant"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "tenant" in table.output and "default" in table.output


def _fleet_file(tmp_path, ledger: str) -> str:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models:\n  - name: tiny\n    source: builtin:tiny-random\nledger:\n{ledger}")
    return str(fleet)


def test_usage_reads_the_postgres_ledger(tmp_path, pg_server):
    url = fresh_database(pg_server)
    with open_ledger(LedgerConfig(url=url)) as led:
        for sb, tenant in [("local/tiny", None), ("provider/acme", "acme"), ("provider/acme", "beta")]:
            led.record(model="tiny", served_by=sb, route_reason="x", input_tokens=1, output_tokens=2, status="ok",
                       cost_usd=0.001, tenant=tenant)
    fleet = _fleet_file(tmp_path, f"  url: {url}\n")
    res = CliRunner().invoke(app, ["usage", "-c", fleet, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["ledger"] == url and out["total"]["requests"] == 3
    assert {r["served_by"]: r["requests"] for r in out["rows"]} == {"provider/acme": 2, "local/tiny": 1}
    res = CliRunner().invoke(app, ["usage", "-c", fleet, "--json", "--by", "tenant"])
    assert {r["tenant"] for r in json.loads(res.output)["rows"]} == {"acme", "beta", "default"}


@pytest.mark.parametrize(
    "ledger, args, code, message",
    [
        # PostgreSQL down: one line, exit 1, in seconds
        ("  url: postgresql://lmfleet@127.0.0.1:{port}/lmfleet\n  connect_timeout_s: 2\n", [], 1,
         "ledger database postgresql://lmfleet@127.0.0.1:{port}/lmfleet"),
        # a misconfigured ledger.url: exit 2, naming the key
        ("  url: mysql://lmfleet@db/lmfleet\n", [], 2, "ledger.url"),
        ("  url: postgresql://lmfleet@127.0.0.1:{port}/lmfleet\n  password_env: LMFLEET_TEST_NO_SUCH_VAR\n", [], 2,
         "ledger.password_env names LMFLEET_TEST_NO_SUCH_VAR"),
        ("  path: {tmp}/l.sqlite\n", ["--by", "model"], 2, "--by 'model': expected one of served_by, tenant"),
    ],
)
def test_usage_ledger_errors(tmp_path, ledger, args, code, message):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fmt = {"port": port, "tmp": tmp_path}
    fleet = _fleet_file(tmp_path, ledger.format(**fmt))
    t = time.monotonic()
    res = CliRunner().invoke(app, ["usage", "-c", fleet, *args])
    assert time.monotonic() - t < 6
    assert res.exit_code == code, res.output
    assert message.format(**fmt) in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("node_hour_usd, since, verdict, hours_over", [
    (0.0001, None, "buy", 2),    # a replica at $0.0001/h: cheaper than the $0.0006 hours of overflow
    (1.0, None, "rent", 0),
    (0.0001, "1h", "buy", 1),    # the older hour is outside the window
])
def test_usage_advise(ledger_path, tmp_path, node_hour_usd, since, verdict, hours_over):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models:\n  - name: smollm2\n    source: builtin:smollm2\n    engine: {{device: cpu}}\n"
                     f"    cost: {{node_hour_usd: {node_hour_usd}}}\nledger:\n  path: {ledger_path}\n")
    args = ["usage", "-c", str(fleet), "--advise"] + (["--since", since] if since else [])
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)["models"]
    assert row["model"] == "smollm2" and row["verdict"] == verdict and row["hours_over"] == hours_over
    assert row["replica_hour_usd"] == pytest.approx(node_hour_usd)
    table = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0 and f"Rent or buy — smollm2: {verdict}" in table.output


def test_usage_estimate(tmp_path):
    path = tmp_path / "ledger.sqlite"
    now = time.time()
    with Ledger(path) as led:
        for ago, predicted, realised in [(10, 1000.0, 1500.0), (20, 1000.0, 800.0), (30, 500.0, None),
                                         (7200, 100.0, 5100.0), (40, None, None)]:
            led.record(model="smollm2", served_by="local/smollm2" if predicted else "provider/acme",
                       route_reason="x", input_tokens=1, output_tokens=1, status="200", cost_usd=0.0, ts=now - ago,
                       predicted_wait_ms=predicted, realised_wait_ms=realised)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models:\n  - name: smollm2\n    source: builtin:smollm2\n    overflow: {{threshold_ms: 2000}}\n"
                     f"ledger:\n  path: {path}\n")
    res = CliRunner().invoke(app, ["usage", "-c", str(fleet), "--estimate", "--since", "1h", "--json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)["models"]
    # errors +500 and -200: median |err| 350, P90 470 (23.5 % of 2000), bias +150, ratios 1.5 and 0.8
    assert row == {"model": "smollm2", "requests": 2, "median_abs_error_ms": 350.0, "p90_abs_error_ms": 470.0,
                   "median_abs_error_pct_of_threshold": 17.5, "p90_abs_error_pct_of_threshold": 23.5,
                   "bias_ms": 150.0, "median_actual_over_predicted": 1.15, "threshold_ms": 2000.0,
                   "missed": 0, "missed_pct": 0.0}
    table = CliRunner().invoke(app, ["usage", "-c", str(fleet), "--estimate"], env={"COLUMNS": "250"})
    # all time: the row of 2 h ago waited 5.1 s, past the 2 s threshold: 1 of 3 missed
    assert table.exit_code == 0 and "smollm2" in table.output and "all time" in table.output, table.output
    assert "1 (33.3 %)" in table.output
    since = CliRunner().invoke(app, ["usage", "-c", str(fleet), "--estimate", "--since", "1h"], env={"COLUMNS": "250"})
    assert "since " in since.output and "0 (0.0 %)" in since.output, since.output
    both = CliRunner().invoke(app, ["usage", "-c", str(fleet), "--estimate", "--advise"])
    assert both.exit_code == 2 and "choose one" in both.output

"""Report building and rendering: sums add up, every format is produced from the same dict."""

import csv
import io
import json

import pytest
from rich.console import Console

from lmfleet.bench.cost import Price
from lmfleet.bench.html import render_html
from lmfleet.bench.loadgen import RequestRecord
from lmfleet.bench.metrics import SLO
from lmfleet.bench.report import build_report, check_consistency, flat_rows, render_tables, write_csv


def rec(start, provider, cls, out=10, prompt=5, status=200, error="", warmup=False):
    return RequestRecord(cls=cls, provider=provider, start=start, status=status, error=error, ttft=0.1,
                         latency=1.0, itl=[0.1] * (out - 1), prompt_tokens=prompt, output_tokens=out, warmup=warmup)


RECORDS = [
    rec(0.1, "local/m", "short", warmup=True),
    rec(1.0, "local/m", "short"),
    rec(1.5, "local/m", "long", out=20, prompt=50),
    rec(2.0, "provider/x", "long", out=30, prompt=60),
    rec(2.5, "provider/x", "short", status=429, error="rate limited", out=0, prompt=0),
]


@pytest.fixture
def report():
    return build_report(RECORDS, warmup=1.0, slo=SLO(ttft_ms=500),
                        prices={"local": Price(0.05, 0.10), "provider/x": Price(0.5, 1.5)}, meta={"model": "m"})


def test_report_groups_add_up(report):
    assert check_consistency(report) == []
    o = report["overall"]
    assert (o["requests"], o["completed"], o["failed"]) == (4, 3, 1)
    assert (o["input_tokens"], o["output_tokens"]) == (115, 60)
    assert report["meta"]["warmup_requests_excluded"] == 1
    assert set(report["providers"]) == {"local/m", "provider/x"}
    assert set(report["classes"]) == {"short", "long"}
    assert o["duration_s"] == pytest.approx(2.5)  # from the end of warm-up (1.0) to the last end (3.5)
    assert report["providers"]["provider/x"]["errors_by_status"] == {"429": 1}


def test_report_cost(report):
    local, ext = report["providers"]["local/m"], report["providers"]["provider/x"]
    assert local["cost_usd"] == pytest.approx((55 * 0.05 + 30 * 0.10) / 1e6)
    assert ext["usd_per_1m_output"] == pytest.approx((60 * 0.5 + 30 * 1.5) / 30)
    assert report["overall"]["cost_usd"] == pytest.approx(local["cost_usd"] + ext["cost_usd"])
    assert report["overall"]["usd_per_1m_output"] == pytest.approx(report["overall"]["cost_usd"] / 60 * 1e6)


def test_consistency_check_finds_mismatch(report):
    report["providers"]["local/m"]["output_tokens"] += 1
    assert check_consistency(report) == ["providers: sum of output_tokens = 61, overall = 60"]


def test_json_round_trip_and_csv(report, tmp_path):
    assert json.loads(json.dumps(report))["overall"]["output_tokens"] == 60
    path = tmp_path / "r.csv"
    write_csv(report, path)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(flat_rows(report))
    by_key = {(r["scope"], r["group"], r["metric"]): r["value"] for r in rows}
    assert by_key[("overall", "all", "output_tokens")] == "60"
    assert by_key[("provider", "provider/x", "ttft_ms.p99")] == "100.0"
    assert ("class", "long", "e2el_ms.p50") in by_key


def test_terminal_table_has_provider_columns_and_metric_rows(report):
    buf = io.StringIO()
    render_tables(report, Console(file=buf, width=200))
    text = buf.getvalue()
    for needle in ("local/m", "provider/x", "Overall", "Throughput (output tok/s)", "E2E latency P99",
                   "Error rate", "$ / 1M output tokens", "25.00% (429: 1)", "short", "long"):
        assert needle in text


def test_html_is_self_contained(report):
    page = render_html(report)
    assert page.count("data:image/png;base64,") == 2
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert "provider/x" in page


def test_empty_run_builds():
    r = build_report([], warmup=0.0)
    assert r["overall"]["requests"] == 0 and check_consistency(r) == []
    assert "data:image/png" in render_html(r)


def test_tables_to_a_pipe_keep_every_row_label_on_one_line(report, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    render_tables(report)  # stdout captured: not a terminal (rich alone would fold the tables at 80 columns)
    text = capsys.readouterr().out
    assert "Throughput (output tok/s)" in text and "TTFT P50 / P99 (ms)" in text
    buf = io.StringIO()
    render_tables(report, Console(file=buf, width=80))
    assert "Throughput (output tok/s)" not in buf.getvalue()  # what a pipe got before: the label over two lines

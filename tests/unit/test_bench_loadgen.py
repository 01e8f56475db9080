"""The load generator and the CLI against the fast local OpenAI server (no engine)."""

import asyncio
import json

import pytest
from typer.testing import CliRunner

from lmfleet.bench.loadgen import LoadPlan, Target, run_load
from lmfleet.bench.workload import BenchRequest
from lmfleet.cli.bench import app

from lmfleet.net import free_port
from lmfleet.testing.fast_openai_server import FastServer

REQS = [BenchRequest("a", "completion", 3, 5, prompt="one two three"),
        BenchRequest("b", "chat", 2, 7, messages=[{"role": "user", "content": "hi there"}])]


@pytest.fixture(scope="module")
def server():
    with FastServer("--served-by", "local/fast", "--itl-ms", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def bare_server():
    with FastServer("--max-model-len", "1024") as srv:
        yield srv


@pytest.mark.parametrize("plan, expected", [
    (LoadPlan(users=4, num_requests=30), 30),
    (LoadPlan(rate=300.0, num_requests=25), 25),
    (LoadPlan(rate=300.0, burstiness=0.3, num_requests=25, max_concurrency=3), 25),
    (LoadPlan(users=2, num_requests=10, think_time=(0.01, 0.02), ramp_up=0.05), 10),
])
def test_load_models_send_the_requested_count(server, plan, expected):
    records, wall = asyncio.run(run_load(Target(server.base_url, "fast"), REQS, plan))
    assert len(records) == expected and wall > 0
    assert all(r.ok for r in records)
    assert {r.provider for r in records} == {"local/fast"}
    for r in records:
        assert r.output_tokens == (5 if r.cls == "a" else 7)  # from usage
        assert len(r.itl) == r.output_tokens - 1 and 0 < r.ttft <= r.latency


def test_duration_stops_sending_and_warmup_is_flagged(server):
    plan = LoadPlan(users=2, duration=0.6, warmup=0.3)
    records, _ = asyncio.run(run_load(Target(server.base_url, "fast"), REQS, plan))
    assert records and max(r.start for r in records) < 0.7
    assert any(r.warmup for r in records) and any(not r.warmup for r in records)
    assert all(r.warmup == (r.start < 0.3) for r in records)


def test_without_header_the_endpoint_is_the_provider_and_errors_are_recorded(bare_server):
    records, _ = asyncio.run(run_load(Target(bare_server.base_url, "fast", label="ep"), REQS,
                                      LoadPlan(users=1, num_requests=2)))
    assert {r.provider for r in records} == {"ep"}
    dead = f"http://127.0.0.1:{free_port()}"
    records, _ = asyncio.run(run_load(Target(dead, "fast"), REQS, LoadPlan(users=1, num_requests=2)))
    assert all(not r.ok and r.status == 0 for r in records)


def test_non_streaming(server):
    records, _ = asyncio.run(run_load(Target(server.base_url, "fast"), REQS, LoadPlan(users=2, num_requests=4),
                                      stream=False))
    assert all(r.ok and r.ttft == r.latency and r.output_tokens in (5, 7) for r in records)


# ---------------------------------------------------------------- CLI

runner = CliRunner()
BASE = ["run", "--model", "fast", "--tokenizer", "builtin:tiny-random", "--requests", "20", "--quiet"]


def test_bench_alone_shows_help():
    result = runner.invoke(app, [])
    assert "run" in result.output and "sweep" in result.output


@pytest.mark.parametrize("extra, message", [
    (["--mix", "a:0.5:50:10,b:0.4:50:10"], "weights sum to 0.9"),
    (["--mix", "a:0.5:50:10,b:0.5:50:10", "--weight", "c=1"], "unknown class name(s) ['c']"),
    (["--mix", "a:1:1000-1500:100"], "exceeds the model's context"),
    (["--users", "2", "--rate", "3"], "not both"),
    (["--price", "local"], "--price 'local'"),
    (["--think-time", "3-1"], "--think-time"),
    (["--mix", "missing.yaml"], "does not exist"),
])
def test_bad_input_exits_2_before_load(bare_server, extra, message):
    result = runner.invoke(app, [*BASE, "--url", bare_server.base_url, *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_unreachable_url_exits_2():
    result = runner.invoke(app, [*BASE, "--url", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 2 and "cannot reach" in result.output


def test_unknown_model_exits_2(bare_server):
    result = runner.invoke(app, [*BASE, "--url", bare_server.base_url, "--model", "nope"])
    assert result.exit_code == 2 and "is not served" in result.output


def test_cli_run_writes_every_format(server, tmp_path):
    result = runner.invoke(app, [*BASE, "--url", server.base_url, "--mix", "a:0.5:40-80:4:chat,b:0.5:30:6:completion",
                                 "--users", "4", "--price", "local=0.1:0.2", "--no-ledger", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["overall"]["requests"] == 20 and report["overall"]["failed"] == 0
    assert report["providers"]["local/fast"]["usd_per_1m_output"] is not None
    assert (tmp_path / "report.csv").stat().st_size > 0
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()


def test_cli_sweep_over_users(server, tmp_path):
    result = runner.invoke(app, ["sweep", "--over", "users", "--values", "1,4", "--url", server.base_url,
                                 "--model", "fast", "--tokenizer", "builtin:tiny-random", "--requests", "12",
                                 "--mix", "a:1:40:4:chat", "--quiet", "--no-ledger", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r["users"] for r in rows] == [1.0, 4.0] and all(r["requests"] == 12 for r in rows)
    assert (tmp_path / "users-4" / "report.json").exists()
    assert "data:image/png;base64," in (tmp_path / "sweep.html").read_text()


def test_cli_overflow_sweep_without_admin_endpoint_exits_2(server, tmp_path, monkeypatch):
    monkeypatch.setenv("LMFLEET_ADMIN_KEY", "k")
    result = runner.invoke(app, ["sweep", "--over", "overflow", "--values", "100,200", "--url", server.base_url,
                                 "--model", "fast", "--tokenizer", "builtin:tiny-random", "--requests", "4",
                                 "--mix", "a:1:40:4:chat", "--quiet", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "admin/overflow answered 404" in result.output
    assert not (tmp_path / "sweep.json").exists()


@pytest.mark.parametrize("req, stream, extra, path, keys, absent", [
    (REQS[0], True, None, "/v1/completions", {"prompt", "stream_options", "max_tokens"}, {"messages", "ignore_eos"}),
    (REQS[1], True, {"temperature": 0}, "/v1/chat/completions", {"messages", "temperature"}, {"prompt"}),
    (REQS[1], False, None, "/v1/chat/completions", {"messages"}, {"stream_options"}),
    (BenchRequest("a", "completion", 1, 2, prompt="x", ignore_eos=True), True, None, "/v1/completions",
     {"ignore_eos"}, set()),
])
def test_payload(req, stream, extra, path, keys, absent):
    url, body = Target("http://h:1/", "m", extra_body=extra).payload(req, stream)
    data = json.loads(body)
    assert url == f"http://h:1{path}" and data["model"] == "m" and data["stream"] is stream
    assert keys <= set(data) and not (absent & set(data))

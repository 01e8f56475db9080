"""benchmarks/bench_front_door.py: its pure parts, its smoke mode end to end, and a gateway that starts and relays
with Ray and vLLM unimportable (a CPU-only front-end node, the benchmark's device machine)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_front_door as fd  # noqa: E402

from lmfleet.net import free_port  # noqa: E402
from lmfleet.testing.fast_openai_server import FastServer  # noqa: E402

NO_ENGINE = "import sys\nfor m in ('ray', 'vllm'):\n    sys.modules[m] = None  # import fails, as where not installed\n"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}


def test_mix_follows_the_short_fraction_and_ranges():
    shape = fd.Shape()
    draws = [fd.draw_request(random.Random(i), shape) for i in range(4000)]
    short = [d for d in draws if d[0] == "short"]
    assert 0.57 < len(short) / len(draws) < 0.63
    assert all(50 <= w <= 500 and 32 <= n <= 512 for _, w, n in short)
    assert all(4096 <= w <= 8192 and 256 <= n <= 1024 for k, w, n in draws if k == "long")


def test_chat_body_is_json_with_the_asked_words():
    body = json.loads(fd.chat_body(7, 3))
    assert body["max_tokens"] == 3 and body["stream"] is True
    assert len(body["messages"][0]["content"].split()) == 7


@pytest.mark.parametrize("hist,q,want", [
    ([0, 10, 0], 0.5, 2 * fd.GAP_BIN_S),
    ([5, 0, 5], 0.5, 1 * fd.GAP_BIN_S),
    ([5, 0, 5], 0.99, 3 * fd.GAP_BIN_S),
    ([1] * 100, 0.99, 99 * fd.GAP_BIN_S),
])
def test_hist_pct(hist, q, want):
    assert fd.hist_pct(hist, q) == pytest.approx(want)


def test_hist_pct_of_nothing_is_nan():
    assert fd.hist_pct([0, 0], 0.5) != fd.hist_pct([0, 0], 0.5)


def test_closed_loop_demand_estimate():
    shape = fd.Shape(short_frac=1.0, short_prompt=(0, 0), short_out=(100, 100), think=(1.0, 1.0))
    # each user: 100 tokens in 100 x 10 ms, then 1 s thinking -> 50 tok/s
    assert fd.expected_tokens_per_s(10, shape, (10, 10), 0.0, 0.0) == pytest.approx(500)


def test_added_latency_is_against_direct_of_the_same_load():
    def row(path, load, p99, gap99, tok):
        return {"path": path, "load": load, "tokens_s": tok, "gap_ms": {"p99": gap99},
                "ttft_excess_ms": {"p50": p99 / 2, "p95": p99, "p99": p99}}

    rows = [row("direct", "closed", 2.0, 30.0, 100.0), row("gw1", "closed", 5.0, 31.5, 90.0),
            row("gw1", "open 5/s", 9.0, 40.0, 10.0)]
    fd.add_vs_direct(rows)
    assert rows[1]["added_ttft_ms"]["p99"] == pytest.approx(3.0)
    assert rows[1]["added_gap_p99_ms"] == pytest.approx(1.5)
    assert rows[1]["tokens_vs_direct"] == pytest.approx(0.9)
    assert "added_ttft_ms" not in rows[2]  # no direct row for that load


def test_top_frames_from_collapsed_stacks(tmp_path):
    raw = tmp_path / "s.raw"
    raw.write_text("main;loop;relay 30\nmain;loop;tokenize 60\nmain;loop 10\n")
    top = fd.top_frames(str(raw), n=3)
    assert top["samples"] == 100
    assert top["own_pct"][0] == ("tokenize", 60.0)
    assert ("loop", 100.0) in top["inclusive_pct"]


def test_smoke_mode_runs_every_path(tmp_path):
    out = tmp_path / "fd.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_front_door.py"), "--smoke",
                           "--open-rate", "1", "--json", str(out)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    got = {(r["path"], r["load"].split()[0]) for r in rows}
    assert {("direct", "closed"), ("gw2", "closed"), ("direct", "open"), ("gw2", "open")} <= got
    for r in rows:  # a busy 2-core machine can starve a few-second open-loop window: only the closed loop must flow
        assert r["errors"] == 0, r
        if r["load"] == "closed":
            assert r["tokens_s"] > 0, r
            assert r["path"] == "direct" or (r["hop_cores"] > 0 and "added_ttft_ms" in r), r


def test_gateway_entry_points_import_without_ray_or_vllm():
    code = NO_ENGINE + textwrap.dedent("""
        import lmfleet.cli.main, lmfleet.cli.gateway, lmfleet.serve.gateway_proc, lmfleet.gateway.build
        from lmfleet.engine.app import resolve_model
        from lmfleet.gateway import build_gateway
        from lmfleet.cli.main import main
        sys.argv = ["lmfleet", "gateway", "--help"]
        try:
            main()
        except SystemExit as e:
            assert not e.code, e.code
        assert sys.modules["ray"] is None and sys.modules["vllm"] is None
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_gateway_worker_relays_a_stream_without_ray_or_vllm(tmp_path):
    from lmfleet.models import resolve_source

    resolve_source("builtin:tiny-random")  # built here (with torch) as a deployment would have it
    port = free_port()
    cfg = fd.write_fleet(tmp_path, port, 4096)
    code = NO_ENGINE + textwrap.dedent(f"""
        sys.argv = ["bench_front_door.py", "--serve-worker", {str(cfg)!r}, "--fake-url", sys.argv[1]]
        sys.path.insert(0, {str(REPO / "benchmarks")!r})
        import runpy
        runpy.run_path({str(REPO / "benchmarks" / "bench_front_door.py")!r}, run_name="__main__")
    """)
    with FastServer() as fake:
        gw = subprocess.Popen([sys.executable, "-c", code, fake.base_url], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        try:
            body, deadline = b"", time.monotonic() + 120
            while time.monotonic() < deadline and gw.poll() is None:
                try:
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                                 data=fd.chat_body(3, 4), headers={"content-type": "application/json"})
                    body = urllib.request.urlopen(req, timeout=10).read()
                    break
                except OSError:
                    time.sleep(0.3)
            assert gw.poll() is None, gw.stdout.read().decode(errors="replace")[-3000:]
            assert body.count(b'"choices":[{') == 4 and body.rstrip().endswith(b"[DONE]"), body[-500:]
        finally:
            gw.terminate()
            gw.wait(30)

"""`lmfleet profile` through the real CLI against the shared fleet: the request anatomy of a short built-in load on
"tiny", vLLM torch profiler traces from its replica (Ray Serve LLM's start_profile/stop_profile on the CPU engine)
gathered into --out, and the one-line refusals (no profiler folder, no admin key)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

LMFLEET = [sys.executable, "-m", "lmfleet.cli.main"]


def _run(fleet, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "LMFLEET_TEST_ADMIN_KEY": fleet.admin_key, "LMFLEET_API_KEY": fleet.api_key, **env}
    return subprocess.run([*LMFLEET, "profile", "-c", str(fleet.config_path), *args], env=environ,
                          capture_output=True, text=True, timeout=timeout)


def test_profile_anatomy_and_engine_traces(fleet, tmp_path):
    out = tmp_path / "prof"
    r = _run(fleet, "--model", "tiny", "--duration", "5", "--load", "2", "--max-tokens", "16", "--trace",
             "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    (row,) = report["anatomy"]
    assert row["model"] == "tiny" and row["requests"] >= 2, report
    assert report["load"]["tiny"]["failed"] == 0, report
    phases = row["phases_ms"]
    assert phases["gateway"] is not None and 0 < phases["gateway"] < row["e2e_ms"], row
    assert row["engine_requests"] > 0, report  # vLLM's histograms came through Ray's metrics pages
    assert report["engine_source"] == "ray" and row["engine_approximate"], report  # Ray's bucket midpoints
    for p in ("queue", "prefill", "decode", "relay"):
        assert phases[p] is not None and phases[p] >= 0, row
    exact = row["exact_ms"]  # the gateway's own clock: adds up exactly
    assert exact["to_first_token"] > 0 and exact["streaming"] > 0, row
    assert sum(exact.values()) == pytest.approx(row["e2e_ms"], abs=0.05), row

    traces = report["traces"]
    assert traces["replicas"]["tiny"]["replicas"] == 1, traces
    files = [Path(f) for f in traces["files"]]
    assert files and all(f.is_file() and f.is_relative_to(out) for f in files), traces
    engine = [f for f in files if f.name.endswith(".pt.trace.json.gz")]
    assert engine, traces
    doc = json.loads(gzip.decompress(engine[0].read_bytes()))
    assert doc["traceEvents"], engine[0]  # a Chrome trace: Perfetto and TensorBoard open it


def test_profile_table_for_every_model(fleet):
    r = _run(fleet, "--duration", "4", "--load", "1", "--max-tokens", "8", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)  # the table, for humans (pytest -s)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("request anatomy over") and "traces:" not in r.stdout
    assert any(ln.startswith("smollm2 ") for ln in lines) and any(ln.startswith("tiny ") for ln in lines), r.stdout


def test_profile_trace_without_profiler_dir_is_one_line(fleet, tmp_path):
    r = _run(fleet, "--model", "smollm2", "--trace", "--duration", "1", "--out", str(tmp_path), timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "engine.profiler_dir" in lines[0] and "smollm2" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_profile_routes_need_the_admin_key(fleet):
    for key in (None, fleet.api_key):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        got = httpx.post(f"{fleet.base_url}/admin/profile/start", json={"models": ["tiny"]}, headers=headers,
                         timeout=30)
        assert got.status_code == 401, got.text
    # the gateway refuses too when the fleet file is not the one it runs: a model without a folder is named
    got = fleet.admin("POST", "/admin/profile/start", json={"models": ["smollm2"]})
    assert got.status_code == 409 and "engine.profiler_dir" in got.json()["error"]["message"], got.text

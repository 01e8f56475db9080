"""benchmarks/bench_overflow_policies.py --smoke against the shared fleet: every policy replays a short trace,
the report and its files come out, and the fleet's overflow settings are put back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_bench_overflow_policies_smoke(fleet, tmp_path):
    before = fleet.admin("GET", "/admin/state").json()["models"]["smollm2"]
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_overflow_policies.py"), "--smoke", "--url",
           fleet.base_url, "--admin-key", fleet.admin_key, "--api-key", fleet.api_key, "--capacity-rps", "0.5",
           "--max-num-seqs", "8", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["results"]) == {"predictive", "hedge", "ttft_timeout", "on_error", "local only"}
    for name, r in summary["results"].items():
        assert r["requests"] == summary["requests_per_round"] > 0, name
        assert r["errors"] <= r["requests"] // 4, (name, done.stdout[-3000:])
    assert summary["results"]["local only"]["external_share"] == 0.0
    assert "| predictive |" in done.stdout
    lines = (out / "outcomes.jsonl").read_text().splitlines()
    assert len(lines) == 5 * summary["requests_per_round"]
    after = fleet.admin("GET", "/admin/state").json()["models"]["smollm2"]
    assert (after["mode"], after["threshold_ms"]) == (before["mode"], before["threshold_ms"])

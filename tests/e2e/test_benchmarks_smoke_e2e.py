"""The benchmarks that measure a real fleet run once, in smoke mode, against the shared e2e fleet.

bench_gateway.py compares bare vLLM (the fleet's provider, a bare vLLM server), Ray Serve's endpoint and the
gateway; soak_gateway.py soaks the gateway for a few seconds. Both measure nothing here: they check that the
benchmarks still run against today's fleet.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import PROVIDER_KEY

pytestmark = pytest.mark.e2e  # no per-test timeout: the first test here may be the one that starts the fleet

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)


def test_bench_gateway_smoke(fleet, tmp_path):
    sport = yaml.safe_load(fleet.config_path.read_text())["gateway"]["serve_port"]
    targets = {
        "bare vLLM": {"url": f"{fleet.provider_direct_url}/v1", "model": "smollm2-remote", "api_key": PROVIDER_KEY},
        "Ray Serve LLM endpoint": {"url": f"http://127.0.0.1:{sport}/smollm2/v1"},
        "lmfleet gateway": {"url": f"{fleet.base_url}/v1", "api_key": fleet.api_key},
    }
    out = tmp_path / "bench_gateway.json"
    r = run("bench_gateway.py", ["--smoke", "--targets", json.dumps(targets), "--out", str(out)], tmp_path, 1200)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    table = json.loads(out.read_text())["table"]
    assert set(table) == set(targets)
    for name, row in table.items():
        assert row["c1_output_tok_s"] > 0 and row["c32_output_tok_s"] > 0, (name, row)


def test_soak_gateway_smoke(fleet, tmp_path):
    out = tmp_path / "soak.json"
    r = run("soak_gateway.py", ["--smoke", "--url", fleet.base_url, "--api-key", fleet.api_key, "--admin-key",
                                fleet.admin_key, "--pid", str(fleet.proc.pid), "--json", str(out)], tmp_path, 280)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert json.loads(out.read_text())["failures"] == []

"""Every maintained benchmark runs once, in seconds, so that none of them rots (benchmarks/README.md lists them).

Those that need no engine run here in their smoke mode; those that start engines are checked for what can be
checked without one (their imports and arguments: ``--help``); tests/e2e/test_benchmarks_smoke_e2e.py runs the
ones that can use the shared e2e fleet.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# (script, arguments): a few seconds each, tiny sizes
SMOKE = [
    ("bench_relay.py", ["--smoke"]),
    ("bench_gateway_workers.py", ["--smoke"]),
    ("fuzz_gateway.py", ["--smoke"]),
    ("bench_dashboard.py", ["--smoke"]),
    ("bench_tenants.py", ["--duration", "1", "--loads", "1"]),
    ("bench_rate_store.py", ["20"]),
    ("estimator_loto.py", ["--smoke", "--prefill-line", "gateway", "--out", "out"]),
    ("estimator_loto.py", ["--smoke", "--miss-floors", "0", "0.15", "--out", "out"]),
    ("overflow_report.py", ["--smoke", "--refit-oracle", "--out", "out"]),
    ("gate_line_replay.py", ["--smoke"]),
    ("gate_line_replay.py", ["--cold", "--smoke"]),
]
# start engines (or need GPUs): their imports and arguments only
HELP_ONLY = ["bench_gateway.py", "gpu_serve.py", "bench_overflow.py", "bench_gateways_overload.py",
             "bench_prefix_routing.py", "bench_vs_vllm.py", "planner_vs_vllm.py", "soak_gateway.py", "gpu_proof.py", "bench_budget_store.py",
             "bench_engine_start.py"]


def run(script: str, args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)


# benchmarks whose smoke mode runs in a test module of their own
OWN_TEST = {"bench_front_door.py": "tests/unit/test_bench_front_door_smoke.py",
            "bench_overflow_policies.py": "tests/e2e/test_bench_overflow_policies_e2e.py"}


def test_every_benchmark_is_covered():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert scripts == {s for s, _ in SMOKE} | set(HELP_ONLY) | set(OWN_TEST)
    for test in OWN_TEST.values():
        assert (BENCHMARKS.parent / test).is_file(), test


def test_benchmarks_are_standalone():
    """No benchmark edits sys.path, imports tests.* or imports another benchmark: helpers live in lmfleet.testing."""
    names = {p.stem for p in BENCHMARKS.glob("*.py")}
    for path in BENCHMARKS.glob("*.py"):
        text = path.read_text()
        assert "sys.path" not in text, path.name
        assert not re.search(r"^\s*(from|import) tests\b", text, re.M), path.name
        imported = set(re.findall(r"^\s*(?:from|import) (\w+)", text, re.M))
        assert not imported & names, (path.name, imported & names)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script,args", SMOKE, ids=[s for s, _ in SMOKE])
def test_benchmark_smoke(script, args, tmp_path):
    r = run(script, args, tmp_path, 200)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert r.stdout.strip(), r.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", HELP_ONLY)
def test_engine_benchmark_imports(script, tmp_path):
    r = run(script, ["--help"], tmp_path, 100)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage" in r.stdout.lower(), r.stdout[-1000:]

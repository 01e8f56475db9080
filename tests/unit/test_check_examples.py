"""Every example passes its own check (issue 16), and ``check --offline`` plans GPU fleets for the GPUs the file
describes (``cluster.gpu`` or ``--gpu``), never for the machine running the check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmfleet.check.runner import CheckOptions, run_checks
from lmfleet.cli.main import app
from lmfleet.config import load_config, parse_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FLEET_FILES = sorted(EXAMPLES.glob("*.yaml"))
MIX_FILES = sorted((EXAMPLES / "bench").glob("*.yaml"))
KNOWN_FILES = {*FLEET_FILES, *MIX_FILES, EXAMPLES / "grafana" / "lmfleet.json",
               EXAMPLES / "haproxy" / "lmfleet.cfg",  # checked by tests/unit/test_serve_gateway_proc.py
               EXAMPLES / "prometheus" / "lmfleet-alerts.yml"}  # checked by tests/unit/test_prometheus_alerts.py


def test_every_example_file_is_covered_here():
    on_disk = {p for p in EXAMPLES.rglob("*") if p.is_file()}
    assert on_disk <= KNOWN_FILES, f"examples this test does not check: {sorted(on_disk - KNOWN_FILES)}"
    assert FLEET_FILES and MIX_FILES


@pytest.mark.parametrize("path", FLEET_FILES, ids=lambda p: p.name)
def test_example_fleet_passes_check_offline_through_the_cli(path):
    r = CliRunner().invoke(app, ["check", "-c", str(path), "--offline", "--json", "--warn-ok"])
    report = json.loads(r.stdout)
    failures = [f"{x['check']} {x['subject']}: {x['message']}" for x in report["results"] if x["status"] == "fail"]
    assert r.exit_code == 0 and not failures, failures
    statuses = {(x["check"], x["status"]) for x in report["results"]}
    if load_config(path).cluster.gpu:  # planned for the file's GPUs, not this machine's CPU and RAM
        assert ("memory.fit", "pass") in statuses and not any(c == "memory.host" for c, _ in statuses)


def test_embedded_default_passes_its_own_offline_check_without_warnings():
    """`lmfleet check --offline` with no -c checks the embedded default: nothing to fix, so it exits 0."""
    r = CliRunner().invoke(app, ["check", "--offline", "--json"])
    report = json.loads(r.stdout)
    findings = [f"{x['status']} {x['check']}: {x['message']}" for x in report["results"]
                if x["status"] in ("warn", "fail")]
    assert r.exit_code == 0 and not findings, findings


def test_examples_default_is_the_embedded_default():
    assert load_config(EXAMPLES / "default.yaml") == load_config(None)


@pytest.mark.parametrize("path", MIX_FILES, ids=lambda p: p.name)
def test_example_bench_mix_loads(path):
    from lmfleet.bench.workload import load_mix

    assert load_mix(str(path)).classes


# ---- GPU fleets are planned for the described GPUs -------------------------------------------------------
DEEPSEEK = {
    "cluster": {"head": {"address": "10.0.0.10"}, "workers": [{"address": f"10.0.0.1{i}"} for i in (1, 2, 3)],
                "gpus_per_node": 8},
    "models": [{"name": "ds", "source": "deepseek-ai/DeepSeek-V3",
                "engine": {"tensor_parallel_size": 8, "pipeline_parallel_size": 4, "max_model_len": 16384,
                           "quantization": "fp8", "max_num_seqs": 128},
                "deployment": {"max_ongoing_requests": 128, "request_timeout_s": 900}}],
}


def _with_gpu(gpu: str | None) -> dict:
    cluster = {**DEEPSEEK["cluster"], **({"gpu": gpu} if gpu else {})}
    return {**DEEPSEEK, "cluster": cluster}


@pytest.mark.parametrize("file_gpu,flag_gpu,memory_status,planned_on", [
    ("h200", None, "pass", "NVIDIA H200"),           # the file names its GPUs
    ("h200", "l4", "fail", "NVIDIA L4"),             # --gpu overrides the file (21 GiB of weights per 22 GiB L4)
    (None, "h200", "pass", "NVIDIA H200"),
    (None, None, "skip", "set cluster.gpu"),         # GPUs of unknown model: no plan, and never this machine's
])
def test_offline_plans_gpu_fleets_for_the_described_gpus(file_gpu, flag_gpu, memory_status, planned_on):
    from lmfleet.check.hardware import gpu_model

    cfg = parse_config(_with_gpu(file_gpu))
    opts = CheckOptions(offline=True, gpu=gpu_model(flag_gpu) if flag_gpu else None, build_builtin=False)
    results, _ = run_checks(cfg, opts)
    by_check = {r.check: r for r in results if r.subject == "ds"}
    assert by_check["memory.fit"].status == memory_status and planned_on in by_check["memory.fit"].message
    assert "memory.host" not in by_check  # this machine's RAM is no part of a GPU fleet's plan
    assert "CPU" not in by_check["memory.fit"].message
    timeout = by_check["timeout.generation"]
    assert timeout.status == "pass", timeout.message  # GPU decode speed, not the CPU engine's ~200 ms/token


@pytest.mark.parametrize("gpu", ["h2000", "", "80 apples"])
def test_unknown_cluster_gpu_is_a_config_error(gpu):
    from lmfleet.config import ConfigError

    with pytest.raises(ConfigError, match="cluster.gpu"):
        parse_config(_with_gpu(gpu) if gpu else {**DEEPSEEK, "cluster": {**DEEPSEEK["cluster"], "gpu": ""}})


def test_cpu_fleet_still_checks_this_machines_ram():
    cfg = parse_config({"models": [{"name": "t", "source": "builtin:tiny-random"}]})
    results, _ = run_checks(cfg, CheckOptions(offline=True))
    assert any(r.check == "memory.host" for r in results)

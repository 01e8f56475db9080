"""`lmfleet check` through the real CLI against live Ray: a two-node local cluster, and a throwaway local Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

LMFLEET = [sys.executable, "-m", "lmfleet.cli.main"]
FLEET = {
    "cluster": {"min_link_gbps": 0.001},
    "models": [{
        "name": "tiny", "source": "builtin:tiny-random",
        "engine": {"max_model_len": 2048, "cpu_kvcache_space_gib": 1},
        "deployment": {"replicas": 1, "max_ongoing_requests": 8, "request_timeout_s": 300},
    }],
}


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("check") / "fleet.yaml"
    p.write_text(yaml.safe_dump(FLEET))
    return p


@pytest.fixture(scope="module")
def two_node_ray():
    """A head and one worker raylet on this machine (Ray's own test cluster), stopped by this fixture only."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "object_store_memory": 256 * 1024**2})
    cluster.add_node(num_cpus=1, object_store_memory=256 * 1024**2)
    cluster.wait_for_nodes()
    yield cluster.address
    cluster.shutdown()


def run_check(*args: str, timeout: float = 300) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    res = subprocess.run([*LMFLEET, "check", *args, "--json"], capture_output=True, text=True, timeout=timeout, env=env)
    assert res.stdout, res.stderr[-3000:]
    return res.returncode, json.loads(res.stdout)


def test_check_against_two_node_cluster(fleet_file, two_node_ray):
    code, report = run_check("-c", str(fleet_file), "--address", two_node_ray)
    by = {}
    for r in report["results"]:
        by.setdefault(r["check"], []).append(r)
    assert code == report["exit_code"] == 0, [r for r in report["results"] if r["status"] in ("warn", "fail")]
    assert report["mode"] == "cluster" and len(report["hardware"]) == 2
    # this machine has no GPU: both nodes say so, and the fit check says engines run on the CPU
    assert all("no GPUs" in r["message"] for r in by["gpu.inventory"]) and len(by["gpu.inventory"]) == 2
    assert "CPU" in by["gpu.fit"][0]["message"]
    [link] = report["links"]
    assert link["gbps"] > 0 and link["latency_ms"] > 0
    assert by["network.links"][0]["status"] == "pass"
    assert {r["check"]: r["status"] for r in report["results"] if r["subject"] == "tiny"} == {
        "model.files": "pass", "parallel.tp_heads": "pass", "parallel.pp_layers": "pass",
        "parallel.max_model_len": "pass", "memory.fit": "pass", "memory.kv_capacity": "pass",
        "timeout.generation": "pass", "queue.burst": "pass", "tokenizer.load": "pass", "tokenizer.roundtrip": "pass",
        "tokenizer.chat_template": "pass", "tokenizer.stop_tokens": "pass", "tokenizer.vocab": "pass"}
    fit = next(r for r in report["results"] if r["check"] == "memory.fit")
    assert fit["data"]["kv_tokens"] == 1_048_576  # 1 GiB / 1,024 B per token, as vLLM reports for this model


def test_check_starts_and_stops_a_throwaway_ray(fleet_file):
    code, report = run_check("-c", str(fleet_file), "--warn-ok")
    assert code == 0
    first = report["results"][0]
    assert first["check"] == "cluster" and "throwaway local Ray" in first["message"]
    assert report["hardware"][0]["gpus"] == 0

"""`cluster status`: parsing Ray / Serve / gateway answers, degraded detection, rendering, JSON."""

from __future__ import annotations

import json

import httpx
import pytest

from lmfleet.cluster.probe import gateway_side
from lmfleet.cluster.status import (
    ClusterStatus,
    GpuMemory,
    ModelLoad,
    parse_gateway_state,
    parse_nodes,
    parse_serve_details,
    render_status,
)

HEAD, W1, W2 = "a" * 56, "b" * 56, "c" * 56

RAY_NODES = [
    {"NodeID": W1, "Alive": True, "NodeManagerAddress": "10.77.0.2",
     "Resources": {"CPU": 2.0, "memory": 1e9, "node:10.77.0.2": 1.0}, "Labels": {"lmfleet.io/host": "w1", "ray.io/node-id": W1}},
    {"NodeID": HEAD, "Alive": True, "NodeManagerAddress": "10.77.0.1",
     "Resources": {"CPU": 1.0, "node:__internal_head__": 1.0}, "Labels": {}},
    {"NodeID": W2, "Alive": False, "NodeManagerAddress": "10.77.0.3", "Resources": {}, "Labels": {}},
]
AVAILABLE = {W1: {"CPU": 0.0}, HEAD: {"CPU": 1.0}}


def serve_details(w1_state="RUNNING", w2_state="RUNNING", target=2, status="HEALTHY"):
    return {
        "applications": {
            "lmfleet-tiny": {
                "deployments": {
                    "LLMServer:tiny": {
                        "status": status, "target_num_replicas": target, "message": "",
                        "replicas": [
                            {"replica_id": "r1", "state": w1_state, "node_id": W1, "node_ip": "10.77.0.2"},
                            {"replica_id": "r2", "state": w2_state, "node_id": W2, "node_ip": None},
                        ],
                    },
                    "OpenAiIngress": {"status": "HEALTHY", "target_num_replicas": 1,
                                      "replicas": [{"replica_id": "i1", "state": "RUNNING", "node_id": HEAD}]},
                }
            }
        }
    }


def test_parse_nodes_orders_head_first_and_drops_ray_labels():
    nodes = parse_nodes(RAY_NODES, AVAILABLE, {W1: [GpuMemory(0, 1024, 2048)]})
    assert [(n.address, n.is_head, n.alive) for n in nodes] == [
        ("10.77.0.1", True, True), ("10.77.0.2", False, True), ("10.77.0.3", False, False)]
    assert nodes[1].labels == {"lmfleet.io/host": "w1"}
    assert (nodes[1].cpus_total, nodes[1].cpus_free) == (2.0, 0.0)
    assert nodes[1].gpu_memory == (GpuMemory(0, 1024, 2048),)
    assert nodes[2].cpus_free == 0.0


def test_parse_serve_details_accepts_serve_enums():
    from ray.serve._private.common import DeploymentStatus as ServeDeploymentStatus, ReplicaState

    details = serve_details(w1_state=ReplicaState.RUNNING, status=ServeDeploymentStatus.HEALTHY)
    dep = parse_serve_details(details, parse_nodes(RAY_NODES, AVAILABLE))[0]
    assert (dep.status, dep.replicas[0].state, dep.running) == ("HEALTHY", "RUNNING", 2)


def test_parse_serve_details_maps_replicas_to_nodes():
    nodes = parse_nodes(RAY_NODES, AVAILABLE)
    deps = parse_serve_details(serve_details(), nodes)
    assert [(d.app, d.name) for d in deps] == [("lmfleet-tiny", "LLMServer:tiny"), ("lmfleet-tiny", "OpenAiIngress")]
    assert [(r.replica_id, r.node_address) for r in deps[0].replicas] == [("r1", "10.77.0.2"), ("r2", "10.77.0.3")]
    assert deps[1].replicas[0].node_address == "10.77.0.1"  # from the node table when Serve gives no IP


@pytest.mark.parametrize(
    ("nodes", "details", "state", "problems"),
    [
        (RAY_NODES[:2], serve_details(), "healthy", []),
        (RAY_NODES, serve_details(w2_state="PENDING_ALLOCATION"), "degraded",
         ["node 10.77.0.3 (cccccccc) is dead", "LLMServer:tiny: 1/2 replicas running"]),
        (RAY_NODES[:2], serve_details(w2_state="STARTING"), "degraded", ["LLMServer:tiny: 1/2 replicas running"]),
        (RAY_NODES[:2], serve_details(status="UNHEALTHY"), "degraded", ["LLMServer:tiny: UNHEALTHY"]),
        (RAY_NODES[:2], serve_details(status="UPSCALING"), "healthy", []),
    ],
)
def test_degraded_detection(nodes, details, state, problems):
    parsed = parse_nodes(nodes, AVAILABLE)
    st = ClusterStatus(parsed, parse_serve_details(details, parsed))
    assert st.state == state
    for p in problems:
        assert any(p in q for q in st.problems()), st.problems()
    assert len(st.problems()) == len(problems)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"models": {"tiny": {"in_flight": 3, "queued": 1.5, "recent_ttft_ms": 120.0}}},
         [ModelLoad("tiny", 3.0, 1.5, 120.0)]),
        ({"models": [{"name": "b", "in_flight": 0, "queued_estimate": 0, "ttft_ms": {"p50": 80, "p95": 200}},
                     {"name": "a", "in_flight": 1}]},
         [ModelLoad("a", 1.0, None, None), ModelLoad("b", 0.0, 0.0, 80.0)]),
        ({"models": {"x": {"in_flight": 2, "overflowing": True}}}, [ModelLoad("x", 2.0, None, None, {"overflowing": True})]),
        ({"models": {"t": {"in_flight": 4, "queued_estimate": 0, "recent_ttft_s": 0.0853, "mode": "auto"}},
          "providers": {}},  # the shape lmfleet's gateway answers
         [ModelLoad("t", 4.0, 0.0, 85.3, {"mode": "auto"})]),
        ({"models": {}}, []),
    ],
)
def test_parse_gateway_state(answer, expected):
    assert parse_gateway_state(answer) == expected


def _status_with_gateway(handler) -> ClusterStatus:
    st = ClusterStatus([], [])
    gateway_side(st, "http://gw:8000", "adm", client=httpx.Client(transport=httpx.MockTransport(handler)))
    return st


def test_gateway_load_is_read_with_admin_key():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"], seen["path"] = request.headers.get("authorization"), request.url.path
        return httpx.Response(200, json={"models": {"tiny": {"in_flight": 2}}})

    st = _status_with_gateway(handler)
    assert seen == {"auth": "Bearer adm", "path": "/admin/state"}
    assert st.load == [ModelLoad("tiny", 2.0, None, None)] and st.errors == []


@pytest.mark.parametrize(
    ("handler", "note"),
    [
        (lambda r: httpx.Response(404), "answered 404"),
        (lambda r: httpx.Response(200, text="<html>"), "did not answer JSON"),
        (lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused")), "not reachable"),
    ],
)
def test_gateway_absence_is_a_note(handler, note):
    st = _status_with_gateway(handler)
    assert st.load is None
    assert any(note in e for e in st.errors), st.errors


def test_render_shows_nodes_replicas_load_and_problems():
    nodes = parse_nodes(RAY_NODES, AVAILABLE, {W1: [GpuMemory(0, 40 * 1024, 80 * 1024)]})
    st = ClusterStatus(nodes, parse_serve_details(serve_details(w2_state="STARTING"), nodes),
                       load=[ModelLoad("tiny", 3, 1, 120.5)], errors=["a note"])
    text = render_status(st)
    assert text.startswith("cluster: degraded — 2/3 nodes alive, 2 deployment(s)")
    assert "head 10.77.0.1  alive" in text and "DEAD" in text
    assert "lmfleet.io/host=w1" in text
    assert "r1 RUNNING" in text and "r2 STARTING" in text
    lines = text.splitlines()
    assert any("r1 RUNNING" in line and line.rstrip().endswith("10.77.0.2") for line in lines)
    assert "tiny   3          1       120.5 ms" in text
    assert "problem: deployment lmfleet-tiny/LLMServer:tiny: 1/2 replicas running" in text
    assert "note: a note" in text


def test_render_gpu_column():
    raw = [{**RAY_NODES[1], "Resources": {"CPU": 8, "GPU": 8, "node:__internal_head__": 1}}]
    nodes = parse_nodes(raw, {HEAD: {"CPU": 8, "GPU": 6}}, {HEAD: [GpuMemory(0, 40 * 1024, 80 * 1024)]})
    assert "6/8 free mem free 40G" in render_status(ClusterStatus(nodes, []))


def test_json_round_trip():
    nodes = parse_nodes(RAY_NODES, AVAILABLE)
    st = ClusterStatus(nodes, parse_serve_details(serve_details(w2_state="STARTING"), nodes))
    data = json.loads(json.dumps(st.to_dict()))
    assert data["state"] == "degraded"
    assert data["problems"] == ["node 10.77.0.3 (cccccccc) is dead",
                                "deployment lmfleet-tiny/LLMServer:tiny: 1/2 replicas running"]
    assert [n["address"] for n in data["nodes"]] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert data["deployments"][0]["running"] == 1 and data["load"] is None and data["notes"] == []


def test_dead_node_is_a_note_once_replicas_are_replaced():
    nodes = parse_nodes(RAY_NODES, AVAILABLE)  # W2 dead
    details = serve_details()
    details["applications"]["lmfleet-tiny"]["deployments"]["LLMServer:tiny"]["replicas"][1]["node_id"] = W1
    st = ClusterStatus(nodes, parse_serve_details(details, nodes))
    assert st.state == "healthy"
    assert st.notes() == ["node 10.77.0.3 (cccccccc) is dead (its replicas were replaced)"]


def test_dead_node_without_deployments_is_degraded():
    st = ClusterStatus(parse_nodes(RAY_NODES, AVAILABLE), [], errors=["Ray Serve is not running"])
    assert st.state == "degraded" and st.notes() == ["Ray Serve is not running"]


@pytest.mark.parametrize("recording", ["h200x2_idle", "h200x2_busy", "l4x1", "no_driver"])
def test_gpu_memory_from_the_shared_probe(recording):
    """`cluster status` reads the same probe as `lmfleet check`; free is NVML's v1 ``free`` (as nvidia-smi)."""
    from pathlib import Path

    from lmfleet.cluster.gpu_probe import probe_gpus
    from lmfleet.cluster.probe import gpu_memory_from_probe
    from tests.support.nvml_replay import ReplayNVML

    rec = json.loads((Path(__file__).parent / "data" / "nvml" / f"{recording}.json").read_text())
    got = gpu_memory_from_probe(probe_gpus(ReplayNVML(rec), hostname="n"))
    assert [(m.index, m.free_mib, m.total_mib) for m in got] == [
        (i, g["memory"]["free"] // 2**20, g["memory"]["total"] // 2**20) for i, g in enumerate(rec["gpus"])]

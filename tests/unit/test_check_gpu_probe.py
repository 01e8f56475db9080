"""The node-local GPU probe on recorded NVML answers, and the placement of deployments onto them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmfleet.check.cluster import Link, check_gpu_fit, check_inventory, check_links
from lmfleet.cluster.gpu_probe import NodeGpus, probe_gpus, record_nvml
from lmfleet.check.hardware import Hardware, bandwidth_for, gpu_model, node_view_from_probe
from lmfleet.check.result import Status
from lmfleet.config import parse_config
from tests.support.nvml_replay import ReplayNVML

NVML = Path(__file__).parent / "data" / "nvml"
GiB = 1024**3


def replay(name: str, host: str = "gpu-node") -> NodeGpus:
    return probe_gpus(ReplayNVML(json.loads((NVML / f"{name}.json").read_text())), hostname=host)


@pytest.mark.parametrize("name,count,free,error", [
    ("h200x8_idle", 8, 8, None),
    ("h200x8_three_busy", 8, 6, None),  # GPU 2 (60 GiB) and 6 (117 GiB) busy; GPU 5 at 3.5 GiB is still free
    ("l4x1", 1, 1, None),
    ("no_driver", 0, 0, "NVML Shared Library Not Found"),
])
def test_probe_on_recorded_answers(name, count, free, error):
    node = replay(name)
    assert len(node.gpus) == count and len(node.free_gpus) == free
    assert (error in node.error) if error else node.error is None


def test_busy_gpu_names_processes():
    node = replay("h200x8_three_busy")
    g2 = node.gpus[2]
    assert not g2.free and g2.processes[0].pid == 41213 and g2.processes[0].name == "python3"
    assert g2.processes[0].used_bytes == 61440 * 1024**2
    assert node.gpus[5].free and node.gpus[5].processes[0].used_bytes is None  # NVML could not tell
    assert not node.gpus[6].free and node.gpus[6].processes == ()  # another container's memory


@pytest.mark.parametrize("fraction,free", [(0.0, 0), (0.05, 6), (0.5, 7), (1.0, 8)])
def test_busy_fraction_threshold(fraction, free):
    rec = json.loads((NVML / "h200x8_three_busy.json").read_text())
    assert len(probe_gpus(ReplayNVML(rec), busy_fraction=fraction).free_gpus) == free


def test_roundtrip_through_dict_and_recording():
    node = replay("h200x8_three_busy")
    assert NodeGpus.from_dict(json.loads(json.dumps(node.to_dict()))) == node
    rec = record_nvml(ReplayNVML(json.loads((NVML / "h200x8_three_busy.json").read_text())))
    assert probe_gpus(ReplayNVML(rec), hostname="gpu-node") == node


def test_probe_without_nvml_never_raises():
    class Broken:
        def nvmlInit(self):
            raise RuntimeError("Driver Not Loaded")

    assert probe_gpus(Broken(), hostname="h").error == "no NVIDIA driver/NVML: Driver Not Loaded"
    assert probe_gpus(hostname="h").hostname == "h"  # this machine: no GPU, but an answer


def hw(*names: str) -> Hardware:
    return Hardware(tuple(node_view_from_probe(replay(n, f"node{i}"), f"node{i}") for i, n in enumerate(names)), True)


def fleet(tp: int, pp: int = 1, replicas: int = 1, **cluster) -> object:
    return parse_config({"cluster": cluster, "models": [{
        "name": "m", "source": "deepseek-ai/DeepSeek-V3",
        "engine": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}, "deployment": {"replicas": replicas}}]})


@pytest.mark.parametrize("nodes,tp,pp,replicas,status,needle", [
    (("h200x8_idle",), 8, 1, 1, Status.PASS, "8 GPUs on node0"),
    (("h200x8_three_busy",), 8, 1, 1, Status.FAIL, "the largest node has 6 free"),
    (("h200x8_three_busy",), 4, 1, 1, Status.PASS, "4 GPUs"),
    (("h200x8_idle", "h200x8_idle", "h200x8_idle", "h200x8_idle"), 8, 4, 1, Status.PASS, "32 GPUs"),
    (("h200x8_idle", "h200x8_idle", "h200x8_idle", "h200x8_three_busy"), 8, 4, 1, Status.FAIL, "placed 3"),
    (("h200x8_idle", "h200x8_idle"), 8, 1, 3, Status.FAIL, "3 replica(s) = 24 GPUs"),
    (("l4x1", "l4x1"), 2, 1, 1, Status.WARN, "span nodes"),
    (("l4x1", "l4x1"), 4, 1, 1, Status.FAIL, "largest node has 1 free"),
])
def test_gpu_fit(nodes, tp, pp, replicas, status, needle):
    [r] = check_gpu_fit(fleet(tp, pp, replicas), hw(*nodes))
    assert r.status is status and needle in r.message, r.message


def test_fit_failure_names_node_and_numbers():
    [r] = check_gpu_fit(fleet(8), hw("h200x8_three_busy"))
    assert "node0" in r.message and "GPU 2 busy: 60.5/140.4 GiB used by pid 41213 python3" in r.message
    assert "GPU 6 busy" in r.message and "processes not visible" in r.message
    assert r.fix and "tensor_parallel_size" in r.fix


def test_no_gpu_nodes_are_reported():
    h = hw("no_driver")
    [inv] = check_inventory(h)
    assert inv.status is Status.PASS and "no GPUs" in inv.message and "NVML Shared Library Not Found" in inv.message
    [fit] = check_gpu_fit(fleet(1), h)
    assert fit.status is Status.PASS and "CPU" in fit.message
    [fit] = check_gpu_fit(fleet(1, gpus_per_node=8), h)  # the file promised GPUs
    assert fit.status is Status.FAIL


def test_inventory_warns_on_busy_gpus():
    results = check_inventory(hw("h200x8_idle", "h200x8_three_busy"))
    assert [r.status for r in results] == [Status.PASS, Status.WARN]


@pytest.mark.parametrize("gbps,tp,status,check", [
    (100.0, 2, Status.PASS, "network.links"),
    (1.0, 2, Status.WARN, "network.tp_link"),  # TP 2 on 1-GPU nodes crosses a 1 Gbit/s link
    (1.0, 1, Status.WARN, "network.links"),  # slow, but no TP across it
])
def test_links(gbps, tp, status, check):
    [r] = check_links(fleet(tp, min_link_gbps=10), hw("l4x1", "l4x1"), [Link("node0", "node1", gbps, 0.4, 64 << 20)])
    assert (r.status, r.check) == (status, check)


def test_links_single_node_skipped():
    assert check_links(fleet(1), hw("h200x8_idle"), [])[0].status is Status.SKIP


@pytest.mark.parametrize("spec,gib", [("h200", 140.4), ("H100", 79.6), ("80GiB", 80.0), ("24", 24.0)])
def test_gpu_presets(spec, gib):
    assert gpu_model(spec).memory_bytes / GiB == pytest.approx(gib, abs=0.1)


def test_gpu_preset_unknown():
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_model("tpu-v5")


@pytest.mark.parametrize("name,bw", [("NVIDIA H200", 4800), ("NVIDIA A100-SXM4-40GB", 1555), ("NVIDIA L4", 300),
                                     ("Mystery GPU", 1000)])
def test_bandwidth_lookup(name, bw):
    assert bandwidth_for(name) == bw


def test_fit_suggests_fewer_replicas_when_tp_fits():
    [r] = check_gpu_fit(fleet(8, 4, 2), hw("h200x8_idle", "h200x8_idle", "h200x8_idle", "h200x8_idle"))
    assert r.status is Status.FAIL and "64 GPUs" in r.message
    assert r.fix.startswith("lower min_replicas to 1")

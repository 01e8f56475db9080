"""`lmfleet check` for DeepSeek patterns: expert weights per rank, KV per pool, GPUs per pool, the KV transfer path."""

from __future__ import annotations

from typing import Any

import pytest

from lmfleet.check.cluster import Link, check_gpu_fit
from lmfleet.check.disaggregation import check_kv_transfer_path, check_kv_transfer_size
from lmfleet.check.hardware import Hardware, NodeView, gpu_model
from lmfleet.check.model_files import known_models
from lmfleet.cluster.nic_probe import RdmaPort, probe_rdma
from lmfleet.check.parallelism import check_expert_parallel
from lmfleet.check.planner import GiB, arch_from_config, plan_memory, routed_expert_params, weight_bytes
from lmfleet.check.result import Status
from lmfleet.check.runner import CheckOptions, run_checks
from lmfleet.config import parse_config

H200 = gpu_model("h200").memory_bytes


def arch(hub_id: str):
    return arch_from_config(known_models()[hub_id.lower()])


DSV3 = arch("deepseek-ai/DeepSeek-V3")
LLAMA8B = arch("meta-llama/Llama-3.1-8B-Instruct")
QWEN3_MOE = arch("Qwen/Qwen3-30B-A3B")


# ---- planner: weights per rank under DP/EP ------------------------------------------------------------------
@pytest.mark.parametrize("a", [DSV3, QWEN3_MOE], ids=["deepseek-v3", "qwen3-30b-a3b"])
@pytest.mark.parametrize("dp,tp", [(1, 4), (8, 1), (32, 1), (4, 2), (16, 4)])  # TP <= 4: no replicated K/V heads
def test_routed_experts_split_over_dp_x_tp_and_the_rest_over_tp(a, dp, tp):
    whole = weight_bytes(a, "auto", "fp8")[0]
    routed = routed_expert_params(a) * (1 + 4 / (128 * 128))  # fp8 bytes with block scales
    per_gpu = weight_bytes(a, "auto", "fp8", tp=tp, moe_ranks=dp * tp)[0]
    assert per_gpu == pytest.approx((whole - routed) / tp + routed / (dp * tp), rel=1e-6)
    plan = plan_memory(a, tp=tp, dp=dp, expert_parallel=True, quantization="fp8", gpu_memory_bytes=H200,
                       max_model_len=4096)
    assert plan.weight_bytes_per_gpu == per_gpu and plan.ep == dp * tp
    assert plan.experts_per_rank == a.num_routed_experts / (dp * tp)
    assert plan.expert_bytes_per_gpu == pytest.approx(routed / (dp * tp), rel=1e-6)


def test_dp_on_one_gpu_each_frees_memory_for_kv_as_experts_spread():
    kw: dict[str, Any] = dict(tp=1, expert_parallel=True, quantization="fp8", gpu_memory_bytes=H200,
                              gpu_memory_utilization=0.92, max_model_len=16384)
    plans = {dp: plan_memory(DSV3, dp=dp, **kw) for dp in (8, 16, 32)}
    assert plans[8].weight_bytes_per_gpu > plans[16].weight_bytes_per_gpu > plans[32].weight_bytes_per_gpu
    assert plans[8].kv_tokens < plans[16].kv_tokens < plans[32].kv_tokens
    # DeepSeek-V3 FP8: ~94 GiB per GPU at EP 8, ~37 GiB at EP 32 (8 of 256 experts, ~19 GiB of them per rank)
    assert 90 < plans[8].weight_bytes_per_gpu / GiB < 97 and 34 < plans[32].weight_bytes_per_gpu / GiB < 39
    assert 18 < plans[32].expert_bytes_per_gpu / GiB < 20
    # MLA: the KV latent is per token, not split (576 values x 61 layers x 2 bytes)
    assert plans[32].kv_bytes_per_token_per_gpu == 61 * 576 * 2


@pytest.mark.parametrize("dp", [1, 4])
def test_dense_models_are_unchanged_by_dp(dp):
    assert weight_bytes(LLAMA8B, tp=2, moe_ranks=dp * 2) == weight_bytes(LLAMA8B, tp=2)


# ---- parallel.expert ----------------------------------------------------------------------------------------
def _model(engine: dict[str, Any], deployment: dict[str, Any] | None = None, source: str = "deepseek-ai/DeepSeek-V3",
           cluster: dict[str, Any] | None = None):
    return parse_config({"cluster": cluster or {}, "models": [{"name": "ds", "source": source,
                                                               "engine": {"device": "gpu", **engine},
                                                               "deployment": deployment or {}}]})


@pytest.mark.parametrize("engine,a,status,text", [
    ({"data_parallel_size": 32, "enable_expert_parallel": True}, DSV3, Status.PASS, "8 of 256 routed experts per rank"),
    ({"data_parallel_size": 8, "tensor_parallel_size": 2, "enable_expert_parallel": True}, DSV3, Status.PASS,
     "EP 16 (DP 8 x TP 2): 16 of 256"),
    ({"data_parallel_size": 3, "enable_expert_parallel": True}, DSV3, Status.WARN, "does not divide 256"),
    ({"enable_expert_parallel": True}, LLAMA8B, Status.WARN, "dense model"),
    ({"enable_expert_parallel": True}, None, Status.WARN, "architecture is unknown"),
    ({"data_parallel_size": 2}, LLAMA8B, Status.PASS, "dense model"),
])
def test_expert_parallel_check(engine, a, status, text):
    (r,) = check_expert_parallel(_model(engine).models[0], a)
    assert r.status is status and text in r.message, r.message


@pytest.mark.parametrize("engine", [{}, {"data_parallel_size": 4}])
def test_no_expert_finding_without_ep_on_a_moe_model(engine):
    assert check_expert_parallel(_model(engine).models[0], DSV3) == []


def test_ep_on_a_model_without_config_is_a_warning_in_check():
    cfg = _model({"enable_expert_parallel": True}, source="example-org/unknown-moe")
    results, _ = run_checks(cfg, CheckOptions(offline=True, gpu=gpu_model("h200"), build_builtin=False))
    (r,) = [r for r in results if r.check == "parallel.expert"]
    assert r.status is Status.WARN and "unknown" in r.message


# ---- GPUs per pool ------------------------------------------------------------------------------------------
def _hw(nodes: int, gpus: int = 8) -> Hardware:
    return Hardware(tuple(NodeView(f"n{i}", gpus, gpus, H200, "NVIDIA H200") for i in range(nodes)), False, "test")


PD = {"disaggregation": {"kv_connector": "NixlConnector",
                         "prefill": {"replicas": 2, "engine": {"data_parallel_size": 8}},
                         "decode": {"engine": {"data_parallel_size": 16}}}}


@pytest.mark.parametrize("engine,deployment,nodes,expect", [
    ({"data_parallel_size": 32}, {}, 4, {"ds": (Status.PASS, "DP 32 x 1 replica(s) = 32 GPUs")}),
    ({"data_parallel_size": 8, "tensor_parallel_size": 4}, {}, 4, {"ds": (Status.PASS, "= 32 GPUs")}),
    ({"data_parallel_size": 8}, {"replicas": 3}, 2, {"ds": (Status.FAIL, "DP 8 x 3 replica(s) = 24 GPUs")}),
    ({}, PD, 4, {"ds/prefill": (Status.PASS, "DP 8 x 2 replica(s) = 16 GPUs"),
                 "ds/decode": (Status.PASS, "DP 16 x 1 replica(s) = 16 GPUs")}),
    ({}, PD, 3, {"ds/prefill": (Status.PASS, "= 16 GPUs"), "ds/decode": (Status.FAIL, "placed 8")}),
])
def test_gpu_fit_counts_dp_ranks_and_pools(engine, deployment, nodes, expect):
    results = check_gpu_fit(_model(engine, deployment), _hw(nodes))
    got = {r.subject: (r.status, r.message) for r in results}
    assert set(got) == set(expect)
    for subject, (status, text) in expect.items():
        assert got[subject][0] is status and text in got[subject][1], got[subject][1]


def test_pd_check_plans_memory_per_pool():
    cluster = {"head": {"address": "10.0.0.10"}, "workers": [{"address": f"10.0.0.1{i}"} for i in (1, 2, 3)],
               "gpus_per_node": 8, "gpu": "h200"}
    cfg = _model({"enable_expert_parallel": True, "quantization": "fp8", "max_model_len": 16384}, PD, cluster=cluster)
    results, _ = run_checks(cfg, CheckOptions(offline=True, build_builtin=False))
    fit = {r.subject: r for r in results if r.check == "memory.fit"}
    assert set(fit) == {"ds/prefill", "ds/decode"} and all(r.status is Status.PASS for r in fit.values())
    assert fit["ds/prefill"].data["ep"] == 8 and fit["ds/decode"].data["ep"] == 16
    assert fit["ds/prefill"].data["kv_tokens"] < fit["ds/decode"].data["kv_tokens"]  # fewer experts per decode GPU
    checks = {(r.check, r.subject): r.status for r in results}
    assert checks[("disagg.kv_size", "ds")] is Status.PASS
    assert checks[("disagg.kv_path", "ds")] is Status.SKIP  # offline: NICs unknown


# ---- the KV transfer path -----------------------------------------------------------------------------------
def test_kv_size_of_one_prompt():
    plan = plan_memory(DSV3, tp=1, dp=16, expert_parallel=True, quantization="fp8", gpu_memory_bytes=H200,
                       max_model_len=16384)
    r = check_kv_transfer_size(_model({}, PD).models[0], plan, 100)
    assert r.data["kv_bytes_per_prompt"] == 61 * 576 * 2 * 16384
    assert r.data["transfer_s"] == pytest.approx(61 * 576 * 2 * 16384 * 8 / 100e9)
    assert "92 ms" in r.message


IB = RdmaPort("mlx5_0", 1, "ACTIVE", "InfiniBand", 400.0)
DOWN = RdmaPort("mlx5_1", 1, "DOWN", "Ethernet", None)


@pytest.mark.parametrize("connector,nodes,rdma,links,status,text", [
    ("NixlConnector", 1, None, [], Status.PASS, "share one node"),
    ("NixlConnector", 4, None, [], Status.SKIP, "not known offline"),
    ("NixlConnector", 2, {"a": [IB], "b": [IB]}, [], Status.PASS, "RDMA on every node"),
    ("NixlConnector", 2, {"a": [IB], "b": [DOWN]}, [], Status.WARN, "no RDMA-capable NIC with an active port on b"),
    ("MooncakeConnector", 2, {"a": [], "b": []}, [Link("a", "b", 9.4, 0.8, 64 << 20)], Status.WARN,
     "slowest measured TCP link is a <-> b at 9.40 Gbit/s"),
    ("ExampleConnector", 1, None, [], Status.PASS, "files under /tmp"),
    ("ExampleConnector", 2, None, [], Status.WARN, "shared filesystem"),
    ("OffloadingConnector", 1, None, [], Status.WARN, "decode recomputes every prompt"),
])
def test_kv_transfer_path(connector, nodes, rdma, links, status, text):
    cfg = _model({}, {"disaggregation": {"kv_connector": connector}})
    (r,) = check_kv_transfer_path(cfg, _hw(nodes), links, rdma)
    assert r.status is status and text in r.message, r.message


def test_models_without_a_split_have_no_kv_path_finding():
    assert check_kv_transfer_path(_model({"data_parallel_size": 8}), _hw(4), [], None) == []


def _port(root, dev: str, port: int, state: str, layer: str, rate: str | None) -> None:
    d = root / dev / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "link_layer").write_text(layer + "\n")
    if rate is not None:
        (d / "rate").write_text(rate + "\n")


def test_rdma_probe_reads_sysfs(tmp_path):
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "InfiniBand", "400 Gb/sec (4X NDR)")
    _port(tmp_path, "mlx5_1", 1, "1: DOWN", "Ethernet", None)
    assert probe_rdma(str(tmp_path)) == [RdmaPort("mlx5_0", 1, "ACTIVE", "InfiniBand", 400.0),
                                         RdmaPort("mlx5_1", 1, "DOWN", "Ethernet", None)]
    assert probe_rdma(str(tmp_path / "absent")) == []

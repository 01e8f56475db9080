"""Config-level checks (parallelism, memory, timeouts, queue), exit codes, and `lmfleet check --offline` itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lmfleet.check.hardware import GPU_MODELS, Hardware, NodeView, hardware_from_config
from lmfleet.check.memory import check_memory
from lmfleet.check.model_files import known_models
from lmfleet.check.parallelism import check_parallelism, valid_tp_sizes
from lmfleet.check.planner import arch_from_config
from lmfleet.check.result import CheckResult, Status, exit_code
from lmfleet.check.timeouts import LoadAssumptions, check_timeouts, estimate_tpot_ms
from lmfleet.cli.main import app
from lmfleet.config import parse_config

H200 = GPU_MODELS["h200"]


def arch(hub_id: str):
    return arch_from_config(known_models()[hub_id.lower()])


def model(source: str = "meta-llama/Meta-Llama-3-70B-Instruct", engine: dict | None = None,
          deployment: dict | None = None, providers: list | None = None):
    cfg = parse_config({"models": [{"name": "m", "source": source, "engine": engine or {},
                                    "deployment": deployment or {}}], "providers": providers or []})
    return cfg, cfg.models[0]


def nodes(*gpus: int, gpu=H200) -> Hardware:
    return Hardware(tuple(NodeView(f"n{i}", g, g, gpu.memory_bytes, gpu.name) for i, g in enumerate(gpus)), False)


def by_check(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.check: r for r in results}


# (model, engine, node GPU counts, check id, status, text)
PARALLELISM = [
    ("meta-llama/Meta-Llama-3-70B-Instruct", {"tensor_parallel_size": 8}, (8,), "parallel.tp_heads", Status.PASS, "64"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", {"tensor_parallel_size": 3}, (8,), "parallel.tp_heads", Status.FAIL,
     "does not divide num_attention_heads=64"),
    ("Qwen/Qwen2.5-7B-Instruct", {"tensor_parallel_size": 3}, (8,), "parallel.tp_heads", Status.FAIL, "28"),
    ("Qwen/Qwen2.5-7B-Instruct", {"tensor_parallel_size": 7}, (8,), "parallel.tp_kv_heads", Status.FAIL, "tensor_parallel_size=7"),
    # 28 heads / 14 divides, but 4 KV heads and TP 14: neither divides the other
    ("Qwen/Qwen2.5-7B-Instruct", {"tensor_parallel_size": 14}, (16,), "parallel.tp_kv_heads", Status.FAIL,
     "num_key_value_heads=4"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", {"pipeline_parallel_size": 31}, (8,), "parallel.pp_layers", Status.FAIL,
     "num_hidden_layers=30"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", {"max_model_len": 32768}, (8,), "parallel.max_model_len", Status.FAIL,
     "max_position_embeddings=8192"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", {"tensor_parallel_size": 16}, (8, 8), "parallel.tp_spans_nodes",
     Status.WARN, "pipeline_parallel_size=2"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", {"tensor_parallel_size": 2}, (1, 1), "parallel.tp_spans_nodes",
     Status.WARN, "largest node has 1 GPUs"),
    # FP8 block 128: DeepSeek's moe_intermediate_size 2048 / TP 32 = 64 cannot be loaded
    ("deepseek-ai/DeepSeek-V3", {"tensor_parallel_size": 32}, (32,), "parallel.tp_quant_block", Status.FAIL,
     "/ tp 32 = 576 is not a multiple of the FP8 weight block 128"),
]


@pytest.mark.parametrize("source,engine,gpus,check,status,needle", PARALLELISM)
def test_parallelism(source, engine, gpus, check, status, needle):
    _, m = model(source, engine)
    block = 128 if "DeepSeek" in source else None
    r = by_check(check_parallelism(m, arch(source), nodes(*gpus), weight_block=block))[check]
    assert r.status is status and needle in r.message + (r.fix or ""), r.message


def test_valid_tp_sizes():
    assert valid_tp_sizes(arch("Qwen/Qwen2.5-7B-Instruct")) == [1, 2, 4, 28][:3] + [28]
    assert valid_tp_sizes(arch("meta-llama/Meta-Llama-3-70B-Instruct")) == [1, 2, 4, 8, 16, 32, 64]


# (model, engine, deployment, gpu, check id, status, text in message, text in fix)
MEMORY = [
    ("meta-llama/Meta-Llama-3-70B-Instruct", {"tensor_parallel_size": 1}, {}, "h100", "memory.fit", Status.FAIL,
     "weights need 131.4 GiB per GPU", "tensor_parallel_size=2, pipeline_parallel_size=1"),
    ("deepseek-ai/DeepSeek-V3", {"tensor_parallel_size": 8}, {}, "h100", "memory.fit", Status.FAIL,
     "(37.6B active)", "tensor_parallel_size=4, pipeline_parallel_size=3 (12 GPUs)"),
    ("deepseek-ai/DeepSeek-V3", {"tensor_parallel_size": 8, "max_model_len": 32768}, {"max_ongoing_requests": 16},
     "h200", "memory.fit", Status.PASS, "fp8", ""),
    ("deepseek-ai/DeepSeek-V3", {"tensor_parallel_size": 8}, {"max_ongoing_requests": 64}, "h200",
     "memory.kv_capacity", Status.WARN, "prefix cache", "max_ongoing_requests"),
    ("deepseek-ai/DeepSeek-V3", {"tensor_parallel_size": 8, "enable_prefix_caching": False},
     {"max_ongoing_requests": 64}, "h200", "memory.kv_capacity", Status.WARN, "preempted", ""),
    # Llama 3.1 8B keeps its 128K default context on a 24 GB GPU: vLLM refuses to start
    ("meta-llama/Llama-3.1-8B-Instruct", {}, {}, "l4", "memory.fit", Status.FAIL, "fewer than max_model_len=131072",
     "max_model_len <="),
    ("meta-llama/Llama-3.1-8B-Instruct", {"gpu_memory_utilization": 0.7}, {}, "l4", "memory.fit", Status.FAIL,
     "weights need 15.0 GiB per GPU", "pipeline_parallel_size=3 (3 GPUs)"),
]


@pytest.mark.parametrize("source,engine,deployment,gpu,check,status,needle,fix", MEMORY)
def test_memory(source, engine, deployment, gpu, check, status, needle, fix):
    _, m = model(source, engine, deployment)
    a = arch(source)
    results, _plan = check_memory(m, a, nodes(8, gpu=GPU_MODELS[gpu]), valid_tp_sizes(a))
    r = by_check(results)[check]
    assert r.status is status and needle in r.message, r.message
    assert fix in (r.fix or "")
    if r.status is Status.FAIL:
        assert "memory.kv_capacity" not in by_check(results)


def test_prefix_cache_note_only_when_enabled():
    _, m = model("deepseek-ai/DeepSeek-V3", {"tensor_parallel_size": 8, "enable_prefix_caching": False},
                 {"max_ongoing_requests": 64})
    a = arch("deepseek-ai/DeepSeek-V3")
    r = by_check(check_memory(m, a, nodes(8), valid_tp_sizes(a))[0])["memory.kv_capacity"]
    assert "prefix cache" not in r.message


# (deployment, load, providers, check, status, text)
TIMEOUTS = [
    ({"request_timeout_s": 30}, LoadAssumptions(tpot_ms=50, max_tokens=2048), [], "timeout.generation", Status.WARN,
     "~107 s"),
    ({"request_timeout_s": 600}, LoadAssumptions(tpot_ms=50, max_tokens=2048), [], "timeout.generation", Status.PASS,
     "2048 tokens x 50 ms"),
    ({"request_timeout_s": 600}, LoadAssumptions(tpot_ms=50, max_tokens=20000), [], "timeout.provider", Status.WARN,
     "timeouts.total_s=300"),
    ({"request_timeout_s": 60, "replicas": 1, "max_ongoing_requests": 8}, LoadAssumptions(tpot_ms=50, burst=64), [],
     "queue.burst", Status.WARN, "queues 7 wave(s)"),
    ({"request_timeout_s": 60, "replicas": 1, "max_ongoing_requests": 8}, LoadAssumptions(tpot_ms=50, burst=64),
     None, "queue.burst", Status.PASS, "overflow"),
    ({"max_ongoing_requests": 8, "autoscaling": {"target_ongoing_requests": 16, "max_replicas": 4}},
     LoadAssumptions(tpot_ms=20), [], "queue.autoscaling", Status.WARN, "target_ongoing_requests=16"),
]
PROVIDER = [{"name": "cloud", "base_url": "https://api.example.com/v1", "model_map": {"m": "org/m"}}]


@pytest.mark.parametrize("deployment,load,providers,check,status,needle", TIMEOUTS)
def test_timeouts_and_queue(deployment, load, providers, check, status, needle):
    cfg, m = model("meta-llama/Meta-Llama-3-8B-Instruct", {}, deployment, PROVIDER if providers is None else
                   PROVIDER if check == "timeout.provider" else providers)
    r = by_check(check_timeouts(m, cfg, None, load, on_gpu=True))[check]
    assert r.status is status and needle in r.message, r.message


@pytest.mark.parametrize("engine, admitted, status", [
    ({}, 64, Status.PASS),  # 64 admitted: a burst of 64 runs in one wave
    ({"max_num_seqs": 8}, 8, Status.WARN),  # vLLM runs 8 at once: 7 more waves queue
])
def test_queue_burst_counts_max_num_seqs(engine, admitted, status):
    """Capacity is replicas x min(max_ongoing_requests, max_num_seqs), the gateway's local_capacity."""
    cfg, m = model("meta-llama/Meta-Llama-3-8B-Instruct", engine,
                   {"request_timeout_s": 60, "replicas": 1, "max_ongoing_requests": 64})
    r = by_check(check_timeouts(m, cfg, None, LoadAssumptions(tpot_ms=50, burst=64), on_gpu=True))["queue.burst"]
    assert r.status is status and r.data["admitted"] == admitted, r.message


def test_tpot_estimate_grows_with_weights():
    _, m = model()
    a = arch("meta-llama/Meta-Llama-3-70B-Instruct")
    _, plan = check_memory(m.model_copy(update={"engine": m.engine.model_copy(update={"tensor_parallel_size": 4})}),
                           a, nodes(8, gpu=GPU_MODELS["a100-80"]), valid_tp_sizes(a))
    # 35 GB per GPU read per step at 2 TB/s x 0.6, times 2 under load: ~58 ms
    assert estimate_tpot_ms(plan, on_gpu=True, bandwidth_gbs=2039) == pytest.approx(58, rel=0.1)
    assert estimate_tpot_ms(None, on_gpu=True, bandwidth_gbs=None) == 20


@pytest.mark.parametrize("statuses,warn_ok,code", [
    ([], False, 0), ([Status.PASS, Status.SKIP], False, 0), ([Status.PASS, Status.WARN], False, 1),
    ([Status.WARN], True, 0), ([Status.WARN, Status.FAIL], True, 2), ([Status.FAIL], False, 2),
])
def test_exit_codes(statuses, warn_ok, code):
    assert exit_code([CheckResult("c", "s", st, "m") for st in statuses], warn_ok=warn_ok) == code


def test_hardware_from_config():
    cfg = parse_config({"cluster": {"gpus_per_node": 8, "head": {"address": "a"}, "workers": [{"address": "b", "gpus": 2}]},
                        "models": [{"name": "m", "source": "x/y"}]})
    hw = hardware_from_config(cfg, H200)
    assert [(n.name, n.gpus_total) for n in hw.nodes] == [("a", 8), ("b", 2)] and hw.gpu_memory_bytes == H200.memory_bytes
    assert hardware_from_config(cfg).gpu_memory_bytes is None


# ---- the CLI, offline ----------------------------------------------------------------------------------------

def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


BAD_FLEET = {"cluster": {"gpus_per_node": 8}, "models": [
    {"name": "llama", "source": "meta-llama/Meta-Llama-3-70B-Instruct", "engine": {"tensor_parallel_size": 3}}]}
OK_FLEET = {"cluster": {"gpus_per_node": 8}, "models": [
    {"name": "llama", "source": "meta-llama/Meta-Llama-3-70B-Instruct",
     "engine": {"tensor_parallel_size": 4, "max_model_len": 8192},
     "deployment": {"max_ongoing_requests": 16, "request_timeout_s": 900}}]}


@pytest.mark.parametrize("fleet,args,code", [
    (BAD_FLEET, ["--gpu", "h100"], 2),
    (OK_FLEET, ["--gpu", "h100"], 0),  # tokenizer skipped (hub id offline), everything else passes
    (OK_FLEET, ["--gpu", "h100", "--max-tokens", "100000", "--tpot-ms", "50"], 1),
    (OK_FLEET, ["--gpu", "h100", "--max-tokens", "100000", "--tpot-ms", "50", "--warn-ok"], 0),
])
def test_cli_offline_exit_codes(tmp_path, fleet, args, code):
    res = CliRunner().invoke(app, ["check", "-c", str(write(tmp_path, fleet)), "--offline", "--json", *args])
    assert res.exit_code == code, res.output
    report = json.loads(res.stdout)
    assert report["exit_code"] == code and report["mode"] == "offline"


def test_cli_table_names_the_fix(tmp_path):
    res = CliRunner().invoke(app, ["check", "-c", str(write(tmp_path, BAD_FLEET)), "--offline", "--gpu", "h100"])
    assert res.exit_code == 2
    assert "FAIL" in res.stdout and "tensor_parallel_size" in res.stdout


def test_cli_bad_gpu_flag(tmp_path):
    res = CliRunner().invoke(app, ["check", "-c", str(write(tmp_path, OK_FLEET)), "--offline", "--gpu", "tpu"])
    assert res.exit_code == 2 and "unknown GPU" in res.output


def test_cli_bad_config_exits_2(tmp_path):
    res = CliRunner().invoke(app, ["check", "-c", str(write(tmp_path, {"models": []})), "--offline"])
    assert res.exit_code == 2

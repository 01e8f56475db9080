"""The memory planner against published model sizes, published deployments, and vLLM's own KV report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmfleet.check.model_files import find_model_files, known_models
from lmfleet.check.planner import (
    GiB,
    PlanError,
    arch_from_config,
    kv_bytes_per_token,
    param_counts,
    plan_memory,
    pp_layer_split,
    weight_bytes,
)

DATA = Path(__file__).parent / "data"
MiB = 1024**2
H200, H100, A100_80, L4 = 143771 * MiB, 81559 * MiB, 81920 * MiB, 23034 * MiB


def arch(hub_id: str):
    return arch_from_config(known_models()[hub_id.lower()])


# (hub id, published total params in billions, published active params, source)
PUBLISHED_PARAMS = [
    ("deepseek-ai/DeepSeek-V3", 671, 37, "DeepSeek-V3 tech report: 671B total, 37B activated (MTP module excluded)"),
    ("deepseek-ai/DeepSeek-R1", 671, 37, "DeepSeek-R1 model card: 671B total, 37B activated"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", 70.6, 70.6, "HF model card: 70.6B"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", 8.03, 8.03, "HF model card: 8.03B"),
    ("Qwen/Qwen2.5-0.5B-Instruct", 0.49, 0.49, "Qwen2.5 card: 0.49B"),
    ("Qwen/Qwen2.5-7B-Instruct", 7.61, 7.61, "Qwen2.5 card: 7.61B"),
    ("Qwen/Qwen2.5-14B-Instruct", 14.7, 14.7, "Qwen2.5 card: 14.7B"),
    ("Qwen/Qwen2.5-32B-Instruct", 32.5, 32.5, "Qwen2.5 card: 32.5B"),
    ("Qwen/Qwen2.5-72B-Instruct", 72.7, 72.7, "Qwen2.5 card: 72.7B"),
    ("Qwen/Qwen3-30B-A3B", 30.5, 3.3, "Qwen3 card: 30.5B total, 3.3B activated"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", 46.7, 12.9, "Mistral: 46.7B total, 12.9B per token"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", 0.135, 0.135, "SmolLM2 card: 135M"),
]


@pytest.mark.parametrize("hub_id,total_b,active_b,source", PUBLISHED_PARAMS, ids=[p[0] for p in PUBLISHED_PARAMS])
def test_param_counts_match_published(hub_id, total_b, active_b, source):
    c = param_counts(arch(hub_id))
    assert c.total / 1e9 == pytest.approx(total_b, rel=0.02), source
    assert c.active / 1e9 == pytest.approx(active_b, rel=0.03), source


# KV bytes per token, whole model, bf16: 2 (K,V) x layers x kv_heads x head_dim x 2 bytes; MLA: layers x 576 x 2
KV_PER_TOKEN = [
    ("meta-llama/Meta-Llama-3-70B-Instruct", "auto", 1, 327_680),  # 80 x 8 x 128 x 2 x 2 = 320 KiB
    ("meta-llama/Meta-Llama-3-8B-Instruct", "auto", 1, 131_072),  # 128 KiB
    ("meta-llama/Meta-Llama-3-8B-Instruct", "fp8", 1, 65_536),
    ("meta-llama/Meta-Llama-3-70B-Instruct", "auto", 8, 40_960),  # 8 KV heads over TP 8: one each
    ("meta-llama/Meta-Llama-3-70B-Instruct", "auto", 16, 40_960),  # TP 16 > 8 KV heads: replicated, not smaller
    ("Qwen/Qwen2.5-7B-Instruct", "auto", 1, 57_344),  # 28 x 4 x 128 x 2 x 2
    ("deepseek-ai/DeepSeek-V3", "auto", 1, 70_272),  # MLA: 61 x (512 + 64) x 2
    ("deepseek-ai/DeepSeek-V3", "auto", 8, 70_272),  # latent replicated on every TP rank
    ("deepseek-ai/DeepSeek-V3", "fp8", 8, 35_136),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "auto", 1, 23_040),  # 30 x 3 x 64 x 2 x 2
]


@pytest.mark.parametrize("hub_id,kv_dtype,tp,expected", KV_PER_TOKEN)
def test_kv_bytes_per_token(hub_id, kv_dtype, tp, expected):
    assert kv_bytes_per_token(arch(hub_id), kv_dtype, tp=tp) == expected


# Published deployments: (hub id, gpu bytes, tp, pp, quantization, fits?, source)
PUBLISHED_FITS = [
    ("deepseek-ai/DeepSeek-V3", H200, 8, 1, None, True,
     "SGLang/vLLM DeepSeek docs: FP8 V3/R1 served on one 8xH200 node"),
    ("deepseek-ai/DeepSeek-R1", H200, 8, 1, None, True, "same architecture as V3"),
    ("deepseek-ai/DeepSeek-V3", H100, 8, 1, None, False,
     "SGLang DeepSeek docs: FP8 on H100 needs two 8-GPU nodes (~671 GB of weights > 8x80 GB)"),
    ("deepseek-ai/DeepSeek-V3", H100, 8, 2, None, True, "two 8xH100 nodes with PP 2"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", H100, 1, 1, None, False, "141 GB of bf16 weights > one 80 GB GPU"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", A100_80, 4, 1, None, True, "vLLM docs/common practice: 70B bf16 on 4xA100-80GB"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", H100, 1, 1, "fp8", False, "70 GB fp8 weights leave no KV room at 0.9 of 80 GB"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", L4, 1, 1, None, True, "Llama-3-8B bf16 (16 GB) is served on one 24 GB L4/A10"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", H100, 1, 1, None, False, "Mixtral bf16 needs ~94 GB"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", H100, 2, 1, None, True, "Mixtral bf16 on 2x80 GB"),
    ("Qwen/Qwen2.5-72B-Instruct", H100, 1, 1, None, False, "145 GB of bf16 weights"),
    ("Qwen/Qwen2.5-72B-Instruct-AWQ", H100, 1, 1, None, True, "Qwen docs: the AWQ 72B runs on one 80 GB GPU"),
    ("Qwen/Qwen2.5-32B-Instruct", H100, 1, 1, None, True, "65 GB bf16 on one 80 GB GPU, short context"),
]


@pytest.mark.parametrize("hub_id,gpu,tp,pp,quant,fits,source", PUBLISHED_FITS,
                         ids=[f"{p[0].split('/')[1]}-tp{p[2]}pp{p[3]}-{p[4] or 'auto'}-{p[1] // MiB}MiB" for p in PUBLISHED_FITS])
def test_published_deployments(hub_id, gpu, tp, pp, quant, fits, source):
    plan = plan_memory(arch(hub_id), tp=tp, pp=pp, quantization=quant, gpu_memory_bytes=gpu, max_model_len=4096)
    assert plan.fits is fits, f"{source}: {plan}"


def test_deepseek_v3_on_8xh200_numbers():
    """FP8 DeepSeek-V3 on one 8xH200 node: ~627 GiB of weights, ~78 GiB per GPU, ~45 GiB of KV cache per GPU."""
    plan = plan_memory(arch("deepseek-ai/DeepSeek-V3"), tp=8, gpu_memory_bytes=H200, max_model_len=32768)
    assert plan.quantization == "fp8" and plan.kv_cache_dtype == "bfloat16"
    assert plan.weight_bytes_total / GiB == pytest.approx(627, rel=0.01)  # checkpoint: 163 shards, ~642 GB incl. MTP
    assert plan.weight_bytes_per_gpu / GiB == pytest.approx(78.4, rel=0.01)
    assert 40 * GiB < plan.kv_bytes_per_gpu < 50 * GiB
    assert 600_000 < plan.kv_tokens < 750_000  # at 70,272 B/token
    assert plan.max_concurrency > 16  # many 32k-token requests at once


def test_weights_split_over_tp_and_pp():
    a = arch("meta-llama/Meta-Llama-3-70B-Instruct")
    whole = sum(weight_bytes(a))
    assert whole / 1e9 == pytest.approx(141.1, rel=0.01)  # 70.55B params x 2 bytes
    per_gpu = weight_bytes(a, tp=4, pp=2)
    assert len(per_gpu) == 2
    assert sum(per_gpu) * 4 == pytest.approx(whole, rel=0.01)  # no tied head: nothing duplicated
    assert weight_bytes(a, quantization="awq")[0] < 0.3 * whole


@pytest.mark.parametrize("layers,pp,sizes", [(61, 4, [15, 15, 16, 15]), (32, 2, [16, 16]), (30, 4, [7, 8, 8, 7]),
                                             (80, 3, [27, 27, 26]), (61, 3, [20, 21, 20]), (7, 2, [4, 3]),
                                             (4, 4, [1, 1, 1, 1])])
def test_pp_split_like_vllm(layers, pp, sizes):
    # what vllm.distributed.utils.get_pp_indices (0.32) returns for the same numbers
    assert [len(r) for r in pp_layer_split(layers, pp)] == sizes


def test_pp_larger_than_layers_is_an_error():
    with pytest.raises(PlanError, match="exceeds num_hidden_layers"):
        pp_layer_split(30, 31)


@pytest.mark.parametrize("kwargs,match", [
    ({}, "exactly one"),
    ({"gpu_memory_bytes": H100, "kv_cache_bytes": GiB}, "exactly one"),
    ({"gpu_memory_bytes": H100, "quantization": "int3"}, "unknown quantization"),
    ({"gpu_memory_bytes": H100, "kv_cache_dtype": "int2"}, "unknown kv_cache_dtype"),
])
def test_plan_errors(kwargs, match):
    with pytest.raises(PlanError, match=match):
        plan_memory(arch("meta-llama/Meta-Llama-3-8B-Instruct"), **kwargs)


def test_missing_config_fields():
    with pytest.raises(PlanError, match="no 'num_hidden_layers'"):
        arch_from_config({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10})


def test_cpu_plan_uses_the_kv_space_only():
    plan = plan_memory(arch("HuggingFaceTB/SmolLM2-135M-Instruct"), kv_cache_bytes=2 * GiB, max_model_len=4096)
    assert plan.reserve_bytes_per_gpu == 0
    assert plan.kv_tokens == 93_200  # 2 GiB / 23,040 B = 93,206 -> 5,825 blocks of 16


# ---- vLLM's own report (recorded by benchmarks/planner_vs_vllm.py) --------------------------------------------

REPORT = json.loads((DATA / "vllm_kv_report.json").read_text())


@pytest.mark.parametrize("name", sorted(REPORT["models"]))
def test_planner_matches_vllm_kv_report(name):
    rec = REPORT["models"][name]
    a = arch_from_config(rec["config"])
    kv_space = REPORT["kv_cache_gib"] * GiB
    # the KV space vLLM was given, against planner bytes/token x the tokens vLLM reported
    assert kv_bytes_per_token(a) * rec["kv_tokens"] == pytest.approx(kv_space, rel=0.10)
    plan = plan_memory(a, kv_cache_bytes=kv_space, max_model_len=rec["max_model_len"])
    assert plan.kv_tokens == pytest.approx(rec["kv_tokens"], rel=0.10)
    assert plan.max_concurrency == pytest.approx(rec["max_concurrency"], rel=0.10)
    assert any("KV cache size" in line for line in rec["log_lines"])


def test_known_models_cite_their_source():
    for cfg in {id(c): c for c in known_models().values()}.values():
        assert cfg["_source"].startswith("https://huggingface.co/") and cfg["_note"]
        arch_from_config(cfg)


def test_local_folder_config_is_read(tmp_path):
    cfg = dict(known_models()["huggingfacetb/smollm2-135m-instruct"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    files = find_model_files(str(tmp_path))
    assert files.folder == tmp_path and files.config["num_hidden_layers"] == 30


def test_unknown_hub_id_is_reported():
    files = find_model_files("nobody/NoSuchModel-7B")
    assert files.config is None and "not one of lmfleet's known models" in files.origin


# ---- the example fleets (examples/*.yaml), offline ---------------------------------------------------------------

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_fleets_plan(path):
    from lmfleet.check.hardware import gpu_model
    from lmfleet.check.result import Status
    from lmfleet.check.runner import CheckOptions, run_checks
    from lmfleet.config import load_config

    cfg = load_config(path)
    on_gpu = cfg.cluster.gpus_per_node > 0 or any(n.gpus for n in [cfg.cluster.head, *cfg.cluster.workers] if n)
    results, _ = run_checks(cfg, CheckOptions(offline=True, gpu=gpu_model("h200") if on_gpu else None,
                                              build_builtin=False))
    fits = [r for r in results if r.check == "memory.fit"]
    assert fits and all(r.status in (Status.PASS, Status.SKIP) for r in fits), [r.message for r in fits]
    for m in cfg.models:
        tp = m.engine.tensor_parallel_size
        per_node = max([cfg.cluster.gpus_per_node] + [n.gpus or 0 for n in [cfg.cluster.head, *cfg.cluster.workers] if n])
        spans = any(r.check == "parallel.tp_spans_nodes" and r.subject == m.name for r in results)
        assert spans == (per_node > 0 and tp > per_node), m.name


# (example file, model, gpu, fits?, why) - the examples/ fleets' replicas on named GPUs
EXAMPLE_PLANS = [
    ("deepseek-4x8-h200.yaml", "deepseek-v3", H200, True, "TP 8 x PP 4 on H200: ~20 GiB of weights per GPU"),
    ("deepseek-4x8-h200.yaml", "deepseek-v3", H100, True, "the same split fits 80 GB GPUs too"),
    ("multi-vps-32b.yaml", "r1-distill-qwen-32b", 46068 * MiB, True, "TP 2 on two 48 GB L40S: ~31 GiB of weights each"),
    ("multi-vps-32b.yaml", "r1-distill-qwen-32b", 24564 * MiB, False, "two 24 GB RTX 4090s cannot hold 61 GiB of weights"),
    ("default.yaml", "smollm2-135m-instruct", L4, True, "a 135M model fits anything"),
]


@pytest.mark.parametrize("fname,name,gpu,fits,why", EXAMPLE_PLANS, ids=[f"{p[0]}-{p[2] // MiB}MiB" for p in EXAMPLE_PLANS])
def test_example_fleet_plans(fname, name, gpu, fits, why):
    from lmfleet.check.memory import plan_for
    from lmfleet.config import load_config

    path = Path(__file__).parents[2] / "examples" / fname
    if not path.exists():
        pytest.skip(f"{path} not written yet")
    m = load_config(path).model(name)
    cfg = dict(known_models().get(m.source.lower()) or json.loads((DATA / "vllm_kv_report.json").read_text())
               ["models"]["smollm2"]["config"])
    plan = plan_for(m, arch_from_config(cfg), gpu_memory_bytes=gpu)
    assert plan.fits is fits, f"{why}: {plan}"

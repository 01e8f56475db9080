"""Parallelism sanity: the shapes vLLM will refuse (or run slowly) before an hour of weight loading."""

from __future__ import annotations

from lmfleet.check.hardware import Hardware
from lmfleet.check.planner import ModelArch
from lmfleet.check.result import CheckResult, failed, passed, warned
from lmfleet.config.models import ModelConfig


def _divisors_up_to(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def valid_tp_sizes(a: ModelArch, limit: int = 64) -> list[int]:
    """TP sizes vLLM accepts for this model: dividing the attention heads, and the KV-head rule."""
    out = []
    for tp in _divisors_up_to(a.num_attention_heads, limit):
        if a.is_mla or (a.num_kv_heads % tp == 0 if a.num_kv_heads >= tp else tp % a.num_kv_heads == 0):
            out.append(tp)
    return out


def check_parallelism(m: ModelConfig, a: ModelArch, hw: Hardware | None = None, *,
                      weight_block: int | None = None) -> list[CheckResult]:
    """Checks on TP/PP/max_model_len against the architecture (and node sizes when known)."""
    e, subj, out = m.engine, m.name, []
    tp, pp = e.tensor_parallel_size, e.pipeline_parallel_size
    ok_tps = valid_tp_sizes(a)
    if a.num_attention_heads % tp:
        out.append(failed("parallel.tp_heads", subj,
                          f"tensor_parallel_size={tp} does not divide num_attention_heads={a.num_attention_heads}; "
                          f"vLLM refuses to start",
                          f"use a tensor_parallel_size from {ok_tps}", tp=tp, heads=a.num_attention_heads))
    elif not a.is_mla and (a.num_kv_heads % tp if a.num_kv_heads >= tp else tp % a.num_kv_heads):
        out.append(failed("parallel.tp_kv_heads", subj,
                          f"num_key_value_heads={a.num_kv_heads} and tensor_parallel_size={tp}: one must divide the other",
                          f"use a tensor_parallel_size from {ok_tps}", tp=tp, kv_heads=a.num_kv_heads))
    else:
        msg = f"TP {tp} divides {a.num_attention_heads} attention heads"
        msg += " (MLA)" if a.is_mla else f" and fits {a.num_kv_heads} KV heads"
        out.append(passed("parallel.tp_heads", subj, msg, tp=tp))
    if weight_block and tp > 1:
        widths = {"intermediate_size": a.intermediate_size}
        if a.is_moe:
            widths["moe_intermediate_size"] = a.moe_intermediate_size
        bad = {k: v for k, v in widths.items() if v and (v // tp) % weight_block}
        if bad:
            k, v = next(iter(bad.items()))
            ok = [t for t in ok_tps if all((w // t) % weight_block == 0 for w in widths.values() if w)]
            out.append(failed("parallel.tp_quant_block", subj,
                              f"{k}={v} / tp {tp} = {v // tp} is not a multiple of the FP8 weight block {weight_block}; "
                              f"vLLM fails loading the weights",
                              f"use tensor_parallel_size in {ok} (and pipeline parallelism for more GPUs)"))
    if pp > a.num_layers:
        out.append(failed("parallel.pp_layers", subj,
                          f"pipeline_parallel_size={pp} > num_hidden_layers={a.num_layers}",
                          f"use pipeline_parallel_size <= {a.num_layers}"))
    else:
        out.append(passed("parallel.pp_layers", subj, f"PP {pp} <= {a.num_layers} layers"))
    mml = e.max_model_len or a.max_position_embeddings
    if mml > a.max_position_embeddings:
        out.append(failed("parallel.max_model_len", subj,
                          f"max_model_len={mml} > the model's max_position_embeddings={a.max_position_embeddings}",
                          f"set engine.max_model_len <= {a.max_position_embeddings}"))
    else:
        out.append(passed("parallel.max_model_len", subj, f"max_model_len {mml} <= context {a.max_position_embeddings}"))
    if hw is not None and hw.max_gpus_per_node > 0 and tp > hw.max_gpus_per_node:
        per_node = hw.max_gpus_per_node
        better_tp = max((t for t in ok_tps if t <= per_node), default=1)
        out.append(warned(
            "parallel.tp_spans_nodes", subj,
            f"TP {tp} needs {tp} GPUs in one all-reduce group but the largest node has {per_node} GPUs: every layer's "
            f"all-reduce would cross the network (tens of times per token), slowing decode several times over",
            f"keep TP within a node: tensor_parallel_size={better_tp} and pipeline_parallel_size="
            f"{pp * max(1, tp // better_tp)} (pipeline stages only pass activations between nodes)",
            tp=tp, gpus_per_node=per_node))
    return out


def check_expert_parallel(m: ModelConfig, a: ModelArch | None) -> list[CheckResult]:
    """Data/expert parallelism against the architecture: EP needs a MoE model; experts per EP rank."""
    e, subj = m.engine, m.name
    dp, tp = e.data_parallel_size, e.tensor_parallel_size
    if not e.enable_expert_parallel:
        if a is not None and dp > 1 and not a.is_moe:
            return [passed("parallel.expert", subj, f"DP {dp} of a dense model: {dp} independent engines in one gang "
                           "(DP attention pays off for MoE models; plain replicas restart one at a time)")]
        return []
    if a is None:
        return [warned("parallel.expert", subj, "enable_expert_parallel is set but the model's architecture is "
                       "unknown here (no config.json): whether it is a mixture of experts, and the expert weights per "
                       "rank, are not checked",
                       "point source at a checkpoint folder or a known model, or check on a machine that has it")]
    if not a.is_moe:
        return [warned("parallel.expert", subj, f"enable_expert_parallel on a dense model ({a.model_type}, no routed "
                       "experts): it changes nothing", "remove engine.enable_expert_parallel")]
    ep, experts = dp * tp, a.num_routed_experts
    if experts % ep:
        return [warned("parallel.expert", subj,
                       f"EP {ep} (DP {dp} x TP {tp}) does not divide {experts} routed experts: ranks hold "
                       f"{experts // ep} or {experts // ep + 1}, and the fuller ranks set the pace",
                       f"use DP x TP from {[d for d in _divisors_up_to(experts, 1024) if d > 1][:8]} or enable_eplb "
                       "with redundant experts", ep=ep, experts=experts)]
    return [passed("parallel.expert", subj, f"EP {ep} (DP {dp} x TP {tp}): {experts // ep} of {experts} routed "
                   f"experts per rank, {a.num_experts_per_tok} active per token", ep=ep, experts_per_rank=experts // ep)]

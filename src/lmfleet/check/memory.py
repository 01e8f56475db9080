"""Memory checks: run the planner for one model on the known hardware and say what to change."""

from __future__ import annotations

from lmfleet.check.hardware import Hardware
from lmfleet.check.planner import GiB, MemoryPlan, ModelArch, PlanError, plan_memory
from lmfleet.check.result import CheckResult, failed, passed, skipped, warned
from lmfleet.config.models import ModelConfig

CPU_DEFAULT_KV_GIB = 4.0  # vLLM's CPU default when VLLM_CPU_KVCACHE_SPACE is unset


def _gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB"


def plan_for(m: ModelConfig, a: ModelArch, *, gpu_memory_bytes: int | None, tp: int | None = None,
             pp: int | None = None) -> MemoryPlan:
    """The planner called with a model's engine settings (GPU when ``gpu_memory_bytes``, else the CPU KV space)."""
    e = m.engine
    kw = dict(
        tp=tp or e.tensor_parallel_size, pp=pp or e.pipeline_parallel_size, dtype=e.dtype, quantization=e.quantization,
        kv_cache_dtype=e.kv_cache_dtype, max_model_len=e.max_model_len,
        max_num_batched_tokens=e.max_num_batched_tokens or 8192, max_num_seqs=e.max_num_seqs or 256,
        enforce_eager=e.enforce_eager, dp=e.data_parallel_size, expert_parallel=e.enable_expert_parallel,
    )
    if gpu_memory_bytes:
        return plan_memory(a, gpu_memory_bytes=gpu_memory_bytes, gpu_memory_utilization=e.gpu_memory_utilization, **kw)
    return plan_memory(a, kv_cache_bytes=int((e.cpu_kvcache_space_gib or CPU_DEFAULT_KV_GIB) * GiB), **kw)


def smallest_fit(m: ModelConfig, a: ModelArch, gpu_memory_bytes: int, valid_tps: list[int],
                 gpus_per_node: int | None = None) -> tuple[int, int] | None:
    """The fewest GPUs (tp, pp) at which the model fits (ties: fewer pipeline stages), TP kept within a node."""
    fits = []
    for tp in valid_tps:
        if gpus_per_node and tp > gpus_per_node:
            continue
        for pp in (1, 2, 3, 4, 6, 8, 12, 16):
            if pp > a.num_layers:
                break
            try:
                if plan_for(m, a, gpu_memory_bytes=gpu_memory_bytes, tp=tp, pp=pp).fits:
                    fits.append((tp * pp, pp, tp))
                    break
            except PlanError:
                continue
    if not fits:
        return None
    _, pp, tp = min(fits)
    return tp, pp


def _dp_facts(plan: MemoryPlan, a: ModelArch) -> str:
    """Data/expert-parallel facts of a plan: routed-expert weights per rank, and that each DP rank has its own KV."""
    if plan.dp == 1 and not plan.ep:
        return ""
    out = f"; DP {plan.dp}: each rank holds the numbers above and its own KV cache"
    if a.is_moe:
        out += (f"; routed experts {_gib(plan.expert_bytes_per_gpu)} per GPU"
                + (f" ({plan.experts_per_rank:g} of {a.num_routed_experts} experts per rank, EP {plan.ep})" if plan.ep
                   else f" (every expert sliced over DP x TP = {plan.dp * plan.tp} ranks)"))
    return out


def check_memory(m: ModelConfig, a: ModelArch, hw: Hardware, valid_tps: list[int]) -> tuple[list[CheckResult], MemoryPlan | None]:
    subj, e = m.name, m.engine
    gpu_mem = hw.gpu_memory_bytes
    try:
        plan = plan_for(m, a, gpu_memory_bytes=gpu_mem)
    except PlanError as err:
        return [failed("memory.plan", subj, str(err), "fix the engine settings named above")], None
    where = f"{hw.gpu_name or 'GPU'} ({_gib(gpu_mem)})" if gpu_mem else "CPU engine"
    facts = (f"{plan.params_total / 1e9:.2f}B params"
             + (f" ({plan.params_active / 1e9:.1f}B active)" if a.is_moe else "")
             + f", {plan.dtype}{'/' + plan.quantization if plan.quantization else ''}: weights {_gib(plan.weight_bytes_total)}, "
             f"{_gib(plan.weight_bytes_per_gpu)} per {'GPU' if gpu_mem else 'worker'} at TP {plan.tp} x PP {plan.pp}; "
             f"KV {plan.kv_bytes_per_token_per_gpu / 1024:.1f} KiB/token per {'GPU' if gpu_mem else 'engine'}"
             + _dp_facts(plan, a))
    data = plan.as_dict()
    out: list[CheckResult] = []
    if gpu_mem and plan.kv_bytes_per_gpu <= 0:
        fit = smallest_fit(m, a, gpu_mem, valid_tps, hw.max_gpus_per_node or None)
        fix = (f"use tensor_parallel_size={fit[0]}, pipeline_parallel_size={fit[1]} ({fit[0] * fit[1]} GPUs)" if fit
               else "quantize (fp8, awq) or use larger GPUs")
        out.append(failed(
            "memory.fit", subj,
            f"on {where}: weights need {_gib(plan.weight_bytes_per_gpu)} per GPU + {_gib(plan.reserve_bytes_per_gpu)} "
            f"activation/graph reserve, but gpu_memory_utilization={e.gpu_memory_utilization} allows "
            f"{_gib(plan.budget_bytes_per_gpu)}. {facts}", fix, **data))
        return out, plan
    if plan.kv_tokens < plan.max_model_len:
        out.append(failed(
            "memory.fit", subj,
            f"on {where}: the KV cache holds {plan.kv_tokens} tokens, fewer than max_model_len={plan.max_model_len}; "
            f"vLLM refuses to start. {facts}",
            f"set engine.max_model_len <= {plan.kv_tokens}, raise gpu_memory_utilization, or add GPUs", **data))
        return out, plan
    out.append(passed(
        "memory.fit", subj,
        f"on {where}: {facts}; KV cache {_gib(max(plan.kv_bytes_per_gpu, 0) if gpu_mem else plan.budget_bytes_per_gpu)} "
        f"= {plan.kv_tokens:,} tokens = {plan.max_concurrency:.1f} sequences of {plan.max_model_len} tokens"
        + (f" per rank, {plan.max_concurrency * plan.dp:.1f} per DP group of {plan.dp}" if plan.dp > 1 else ""), **data))
    # sequences running at once: what Serve admits, capped by vLLM's batch size
    need = min(e.max_num_seqs or 256, m.deployment.max_ongoing_requests)
    full = need * plan.max_model_len
    prefix_on = e.enable_prefix_caching is not False  # vLLM's default is on
    if full > plan.kv_tokens:
        safe = max(1, int(plan.max_concurrency))
        msg = (f"max_ongoing_requests={m.deployment.max_ongoing_requests} requests of up to {plan.max_model_len} tokens "
               f"need {full:,} KV tokens; the cache holds {plan.kv_tokens:,} ({plan.max_concurrency:.1f} full-length "
               f"sequences): long requests get preempted and recomputed")
        if prefix_on:
            msg += "; the prefix cache shares that space, so cached prefixes are evicted first and hit rates collapse"
        out.append(warned("memory.kv_capacity", subj, msg,
                          f"lower deployment.max_ongoing_requests to ~{safe}, lower engine.max_model_len to "
                          f"~{plan.kv_tokens // need}, or give the KV cache more memory",
                          kv_tokens=plan.kv_tokens, needed_tokens=full, prefix_caching=prefix_on))
    else:
        out.append(passed("memory.kv_capacity", subj,
                          f"{need} x {plan.max_model_len} tokens fit in {plan.kv_tokens:,} KV tokens"
                          + (" with room for the prefix cache" if prefix_on else "")))
    if not gpu_mem and e.cpu_kvcache_space_gib is not None and e.cpu_kvcache_space_gib != int(e.cpu_kvcache_space_gib):
        out.append(warned("memory.cpu_kv_space", subj,
                          f"cpu_kvcache_space_gib={e.cpu_kvcache_space_gib}: vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer",
                          "use a whole number of GiB"))
    return out, plan


def check_host_memory(m: ModelConfig, plan: MemoryPlan, host_bytes: int, host: str = "this machine") -> CheckResult:
    """CPU engines: weights + KV space against the host's RAM."""
    need = plan.weight_bytes_total + plan.budget_bytes_per_gpu
    if need > 0.8 * host_bytes:
        return warned("memory.host", m.name,
                      f"weights {_gib(plan.weight_bytes_total)} + KV {_gib(plan.budget_bytes_per_gpu)} = {_gib(need)} "
                      f"exceeds 80% of {host}'s {_gib(host_bytes)} RAM",
                      "lower engine.cpu_kvcache_space_gib or run on a bigger machine")
    return passed("memory.host", m.name, f"weights + KV ({_gib(need)}) fit in {host}'s {_gib(host_bytes)} RAM")


def no_arch(m: ModelConfig, origin: str) -> CheckResult:
    return skipped("memory.fit", m.name, f"no config.json to plan with: {origin}")

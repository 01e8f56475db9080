"""Memory planner: will a model fit, and how much KV cache is left? A pure function of numbers.

No I/O, no torch: the inputs are a model's architecture (:class:`ModelArch`, built from a
``config.json`` dict by :func:`arch_from_config`) and the engine/hardware numbers; the output is a
:class:`MemoryPlan`.

Formulas (``L`` layers, ``h`` hidden size, ``V`` vocab, ``n_q``/``n_kv`` attention/KV heads,
``d`` head dim, ``I`` MLP intermediate size)::

    parameters per layer
      attention (GQA/MHA)   h*n_q*d + 2*h*n_kv*d + n_q*d*h            (q, k, v, o projections)
      attention (MLA)       h*r_q + r_q*n_q*(d_nope+d_rope)           (q_a, q_b; h*n_q*(d_nope+d_rope) if r_q=0)
                            + h*(r_kv+d_rope) + r_kv*n_q*(d_nope+d_v) (kv_a with the shared rope key, kv_b)
                            + n_q*d_v*h                               (o)
      dense MLP (gated)     3*h*I
      MoE MLP               E_routed*3*h*I_moe + E_shared*3*h*I_moe + h*E_routed (router)
    embeddings              V*h, plus V*h again for the LM head unless tied

    weight bytes            bytes_per_param(quant) * quantizable params + 2 * the rest
        bf16/fp16 2, fp32 4, fp8 1 (+ one fp32 scale per 128x128 block), awq/gptq int4 0.5
        (+ an fp16 scale and a 4-bit zero per group of 128); embeddings, LM head, norms and MoE
        routers stay in 16 bit.
    split over GPUs         layers are cut into PP stages the way vLLM does (``L // pp`` each, the
                            remainder to the stages before the last); each stage's bytes / TP.
                            The first stage holds the embedding, the last the LM head.
    data parallel (DP)      each DP rank holds the attention, dense MLP, shared experts and embeddings
                            (split by its own TP), while the routed experts of every MoE layer are split
                            over all DP x TP ranks: sliced with plain DP (vLLM flattens TP across DP for
                            MoE), whole experts per rank with expert parallelism (EP size = DP x TP,
                            ``E_routed / (DP x TP)`` experts per rank). The bytes per GPU are the same.

    KV bytes per token per layer
      GQA/MHA               2 * n_kv * d * kv_bytes          (one K and one V per KV head)
      MLA                   (r_kv + d_rope) * kv_bytes       (the compressed latent; not split by TP)
    per GPU                 GQA: KV heads split over TP (replicated when n_kv < TP); layers of the stage

    per DP rank             each rank has its own KV cache and its own sequences (MLA: the latent is
                            replicated over TP, so DP attention is how MLA models scale KV capacity)

    KV budget per GPU       gpu_mem * gpu_memory_utilization - weights_per_gpu - reserve
      reserve               activation peak of one step (max_num_batched_tokens tokens through the
                            widest layer, plus fp32 logits of max_num_seqs rows) + non-torch memory
                            (CUDA context, NCCL buffers, CUDA graphs): see :func:`activation_reserve_bytes`
    CPU engines             the KV budget is VLLM_CPU_KVCACHE_SPACE itself (``kv_cache_bytes=``)

    KV tokens               floor(KV budget / (block_size * kv_per_token_per_gpu)) * block_size
    max concurrency         KV tokens / max_model_len  (vLLM's "Maximum concurrency ... x")

This matches vLLM's own KV report exactly for Llama-shaped models on the CPU engine (see
tests/unit/test_check_planner.py and benchmarks/planner_vs_vllm.py). The reserve is an estimate:
vLLM profiles it on the real GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lmfleet.check.arch import ModelArch, ParamCounts, PlanError, arch_from_config, param_counts

GiB = 1024**3

__all__ = [
    "GiB",
    "ModelArch",
    "MemoryPlan",
    "ParamCounts",
    "PlanError",
    "activation_reserve_bytes",
    "arch_from_config",
    "bytes_per_param",
    "kv_bytes_per_token",
    "param_counts",
    "plan_memory",
    "pp_layer_split",
    "routed_expert_params",
    "resolve_dtypes",
    "weight_bytes",
]


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_INT4 = {"awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors-w4a16", "int4"}


def bytes_per_param(quantization: str | None, dtype: str) -> float:
    """Bytes per quantizable weight (scales included) for a vLLM ``quantization`` and ``dtype``."""
    if quantization is None:
        if dtype not in _DTYPE_BYTES:
            raise PlanError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
        return float(_DTYPE_BYTES[dtype])
    q = quantization.lower()
    if q in ("fp8", "fbgemm_fp8", "compressed-tensors"):
        return 1.0 + 4.0 / (128 * 128)  # block scales in fp32
    if q in _INT4:
        return 0.5 + (2.0 + 0.5) / 128  # fp16 scale + 4-bit zero point per group of 128
    if q == "bitsandbytes":
        return 0.5 + 4.0 / 64  # nf4 with an fp32 absmax per 64 weights
    raise PlanError(f"unknown quantization {quantization!r}; the planner knows fp8, awq, gptq, bitsandbytes")


def resolve_dtypes(a: ModelArch, dtype: str = "auto", quantization: str | None = None,
                   kv_cache_dtype: str = "auto") -> tuple[str, str | None, str]:
    """vLLM's defaults: ``auto`` dtype is the checkpoint's, except that fp32 checkpoints load as bf16; the
    checkpoint's ``quantization_config`` applies unless overridden; ``auto`` KV dtype is the model dtype."""
    d = ("bfloat16" if a.torch_dtype in ("float32", "float") else a.torch_dtype) if dtype == "auto" else dtype
    d = {"half": "float16", "float": "float32"}.get(d, d)
    q = quantization or a.checkpoint_quant
    kv = d if kv_cache_dtype == "auto" else kv_cache_dtype
    return d, q, kv


def pp_layer_split(num_layers: int, pp: int) -> list[range]:
    """Layer ranges per pipeline stage, as vLLM's ``get_pp_indices`` cuts them."""
    if pp > num_layers:
        raise PlanError(f"pipeline_parallel_size={pp} exceeds num_hidden_layers={num_layers}")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


def routed_expert_params(a: ModelArch, layers: range | None = None) -> int:
    """Parameters of the routed experts (not shared experts, not routers) in ``layers`` (default: all)."""
    rng = layers if layers is not None else range(a.num_layers)
    return sum(a.num_routed_experts * 3 * a.hidden_size * a.moe_intermediate_size for i in rng if a.is_moe_layer(i))


def weight_bytes(a: ModelArch, dtype: str = "auto", quantization: str | None = None, *, tp: int = 1, pp: int = 1,
                 moe_ranks: int | None = None) -> list[int]:
    """Weight bytes on one GPU of each pipeline stage (a list of ``pp`` numbers). ``tp=pp=1``: the whole model.

    ``moe_ranks``: the ranks the routed experts are split over (DP x TP under data parallelism; default ``tp``)."""
    d, q, _ = resolve_dtypes(a, dtype, quantization)
    counts = param_counts(a)
    qb = bytes_per_param(q, d)
    rest_b = 2 if q else _DTYPE_BYTES[d]  # embeddings, head, routers: 16 bit under quantization
    moe_ranks = moe_ranks or tp
    out = []
    for s, rng in enumerate(pp_layer_split(a.num_layers, pp)):
        total = 0.0
        for i in rng:
            quant = counts.per_layer_quantizable[i]
            total += quant * qb + (counts.per_layer[i] - quant) * rest_b
        routed = routed_expert_params(a, rng) * qb
        if s == 0:
            total += counts.embedding * rest_b
        if s == pp - 1:
            # a tied head is a second copy when it lives on another stage than the embedding
            total += (counts.lm_head or (counts.embedding if pp > 1 else 0)) * rest_b
        # K/V projections are replicated, not split, on ranks beyond the number of KV heads
        replicated = 0.0
        if not a.is_mla and a.num_kv_heads < tp:
            replicated = len(rng) * 2 * a.hidden_size * a.head_dim * (1 - a.num_kv_heads / tp) * qb
        out.append(int((total - routed) / tp + routed / moe_ranks + replicated))
    return out


def kv_bytes_per_token(a: ModelArch, kv_cache_dtype: str = "auto", dtype: str = "auto", *, tp: int = 1,
                       layers: range | None = None) -> int:
    """KV-cache bytes one token takes on one GPU holding ``layers`` (default: all) at tensor parallelism ``tp``."""
    _, _, kv = resolve_dtypes(a, dtype, None, kv_cache_dtype)
    if kv not in _DTYPE_BYTES:
        raise PlanError(f"unknown kv_cache_dtype {kv!r}")
    eb = _DTYPE_BYTES[kv]
    n = len(layers) if layers is not None else a.num_layers
    if a.is_mla:
        return n * (a.kv_lora_rank + a.qk_rope_head_dim) * eb
    kv_heads_per_gpu = max(1, math.ceil(a.num_kv_heads / tp))
    return n * 2 * kv_heads_per_gpu * a.head_dim * eb


def activation_reserve_bytes(a: ModelArch, *, tp: int = 1, max_num_batched_tokens: int = 8192,
                             max_num_seqs: int = 256, enforce_eager: bool = False, dtype_bytes: int = 2) -> int:
    """Estimated non-weight, non-KV memory of one GPU: one step's activation peak plus non-torch memory.

    peak = tokens * (2*h + 3*widest_mlp/tp + 3*attn_width/tp) * dtype_bytes + max_num_seqs * V/tp * 4 (fp32 logits)
    (residual + normed input; gate_up and the activated product; q/k/v and attention output)
    non-torch = 1.0 GiB (CUDA context, NCCL/cuBLAS workspaces) + 1.0 GiB of CUDA graphs unless enforce_eager.
    """
    if a.is_moe:
        mlp = max(a.intermediate_size if a.first_k_dense else 0, a.moe_intermediate_size * max(1, a.num_experts_per_tok))
    else:
        mlp = a.intermediate_size
    attn = a.num_attention_heads * max(a.head_dim, a.qk_nope_head_dim + a.qk_rope_head_dim)
    act = max_num_batched_tokens * (2 * a.hidden_size + 3 * mlp / tp + 3 * attn / tp) * dtype_bytes
    logits = max_num_seqs * a.vocab_size / tp * 4
    return int(act + logits + GiB + (0 if enforce_eager else GiB))


@dataclass(frozen=True)
class MemoryPlan:
    """The outcome of :func:`plan_memory`, all sizes in bytes, per GPU unless named ``_total``."""

    tp: int
    pp: int
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    max_model_len: int
    params_total: int
    params_active: int
    weight_bytes_total: int
    weight_bytes_per_gpu: int  # the fullest stage
    kv_bytes_per_token_total: int  # the whole model, unsplit
    kv_bytes_per_token_per_gpu: int  # the fullest stage at this TP
    budget_bytes_per_gpu: int  # gpu_mem * utilization (or the CPU KV space)
    reserve_bytes_per_gpu: int
    kv_bytes_per_gpu: int  # what is left for the KV cache (negative: weights do not fit)
    kv_tokens: int
    max_concurrency: float  # kv_tokens / max_model_len
    notes: tuple[str, ...] = field(default_factory=tuple)
    dp: int = 1  # data-parallel ranks: each holds the per-GPU numbers above and its own KV cache
    ep: int = 0  # expert-parallel size (DP x TP) when expert parallelism is on, else 0
    expert_bytes_per_gpu: int = 0  # routed-expert weights on one GPU of the fullest stage
    experts_per_rank: float = 0.0  # routed experts per GPU under EP (E / ep); 0 without EP

    @property
    def fits(self) -> bool:
        """Weights and reserve fit, and at least one max_model_len sequence fits in the KV cache."""
        return self.kv_bytes_per_gpu > 0 and self.kv_tokens >= self.max_model_len

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["notes"] = list(self.notes)
        d["fits"] = self.fits
        return d


def plan_memory(
    a: ModelArch,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "auto",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    gpu_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    kv_cache_bytes: int | None = None,
    reserve_bytes: int | None = None,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    enforce_eager: bool = False,
    block_size: int = 16,
    dp: int = 1,
    expert_parallel: bool = False,
) -> MemoryPlan:
    """Plan one replica's memory on GPUs of ``gpu_memory_bytes`` each, or with a fixed ``kv_cache_bytes`` (CPU).

    Exactly one of ``gpu_memory_bytes`` and ``kv_cache_bytes`` must be given. vLLM applies
    ``gpu_memory_utilization`` to cudaMemGetInfo's total, which is nvidia-smi's total less the driver's
    reserve (616 MiB on an H200): ``GpuInfo.memory_usable`` from the probe. Given nvidia-smi's total instead,
    the budget is 0.9 x that reserve too large; on 2x H200 the plan still held, because the reserve estimate
    is larger than what was measured (docs/gpu_proof.md).
    """
    if (gpu_memory_bytes is None) == (kv_cache_bytes is None):
        raise PlanError("give exactly one of gpu_memory_bytes (GPU engines) and kv_cache_bytes (CPU engines)")
    if tp < 1 or pp < 1 or dp < 1:
        raise PlanError(f"tp={tp}, pp={pp} and dp={dp} must be >= 1")
    d, q, kv = resolve_dtypes(a, dtype, quantization, kv_cache_dtype)
    mml = max_model_len or a.max_position_embeddings
    counts = param_counts(a)
    per_stage = weight_bytes(a, d, q, tp=tp, pp=pp, moe_ranks=dp * tp)
    stages = pp_layer_split(a.num_layers, pp)
    qb = bytes_per_param(q, d)
    expert_per_stage = [int(routed_expert_params(a, r) * qb / (dp * tp)) for r in stages]
    ep = dp * tp if expert_parallel and a.is_moe else 0
    kv_per_stage = [kv_bytes_per_token(a, kv, d, tp=tp, layers=r) for r in stages]
    notes = []
    if not a.is_mla and a.num_kv_heads < tp:
        notes.append(f"num_key_value_heads={a.num_kv_heads} < tp={tp}: each KV head is replicated on {tp // a.num_kv_heads} GPUs")
    if a.is_mla and tp > 1:
        notes.append("MLA: the compressed KV latent is replicated on every TP rank (not split)")
    if kv_cache_bytes is not None:
        budget = int(kv_cache_bytes)
        reserve = 0
        left = [budget] * pp
    else:
        budget = int(gpu_memory_bytes * gpu_memory_utilization)
        reserve = reserve_bytes if reserve_bytes is not None else activation_reserve_bytes(
            a, tp=tp, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager, dtype_bytes=_DTYPE_BYTES.get(d, 2) if not q else 2)
        left = [budget - w - reserve for w in per_stage]
    # every stage must hold the same number of tokens: the scarcest stage decides
    tokens_per_stage = [max(0, lft) // (block_size * kvb) * block_size for lft, kvb in zip(left, kv_per_stage)]
    worst = min(range(pp), key=lambda s: tokens_per_stage[s])
    kv_tokens = tokens_per_stage[worst]
    return MemoryPlan(
        tp=tp, pp=pp, dtype=d, quantization=q, kv_cache_dtype=kv, max_model_len=mml,
        params_total=counts.total, params_active=counts.active,
        weight_bytes_total=sum(weight_bytes(a, d, q)),
        weight_bytes_per_gpu=max(per_stage),
        kv_bytes_per_token_total=kv_bytes_per_token(a, kv, d),
        kv_bytes_per_token_per_gpu=max(kv_per_stage),
        budget_bytes_per_gpu=budget,
        reserve_bytes_per_gpu=reserve,
        kv_bytes_per_gpu=min(left),
        kv_tokens=kv_tokens,
        max_concurrency=kv_tokens / mml,
        notes=tuple(notes),
        dp=dp,
        ep=ep,
        expert_bytes_per_gpu=max(expert_per_stage),
        experts_per_rank=a.num_routed_experts / ep if ep else 0.0,
    )

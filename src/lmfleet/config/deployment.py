"""``models[].deployment``: replicas, autoscaling, Ray Serve's request router and the prefill/decode split."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmfleet.config.base import Strict
from lmfleet.config.engine import EngineConfig

class AutoscalingConfig(Strict):
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


class PrefixAwareConfig(Strict):
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


class PoolConfig(Strict):
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


class DisaggregationConfig(Strict):
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


class DeploymentConfig(Strict):
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

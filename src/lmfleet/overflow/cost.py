"""What one request cost, served externally or locally. Pure functions plus a small rate meter.

External (provider prices, USD per 1M tokens)::

    cost = input_tokens * input_per_1m / 1e6 + output_tokens * output_per_1m / 1e6

Local: the deployment costs a fixed amount per hour whether busy or not::

    hourly = gpu_hour_usd * gpus_per_replica * replicas      (GPU engines)
    hourly = node_hour_usd * replicas                         (CPU-only engines)

and that cost is spread over the output tokens the deployment actually served::

    usd_per_output_token = hourly / max(measured_output_tokens_per_hour, min_output_tokens_per_hour)
    measured_output_tokens_per_hour = output tokens served in the trailing window * 3600 / window_s
    request cost = output_tokens * usd_per_output_token

Per-request attribution at the gateway: keep one :class:`LocalCostMeter` per model, call
``meter.record(output_tokens)`` when a local request finishes, then
``cost = meter.request_cost_usd(output_tokens)`` and write that number to the ledger.

The floor ``min_output_tokens_per_hour`` (``CostConfig``, default 10,000/h) keeps a request in an
otherwise idle hour from being charged the whole hour; the price of idle capacity is then
deliberately *not* attributed to any request (it is the cost of keeping the fleet up, visible as
``hourly x hours`` minus the ledger's local total). Under steady load the per-request costs of a
window add up to the hourly cost of that window. Input (prompt) tokens are not charged separately
locally: their prefill cost is part of the same hour.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from lmfleet.config.models import ModelConfig, ProviderPrice

__all__ = ["LocalCostMeter", "external_cost_usd", "local_hourly_cost_usd", "local_usd_per_token"]


def external_cost_usd(input_tokens: int, output_tokens: int, price: ProviderPrice) -> float:
    return input_tokens * price.input_per_1m / 1e6 + output_tokens * price.output_per_1m / 1e6


def local_hourly_cost_usd(model: ModelConfig, *, uses_gpus: bool, replicas: int | None = None) -> float:
    """Hourly cost of the model's deployment. ``replicas``: those up now (default: the configured minimum).

    A replica holds data_parallel_size x tensor_parallel_size x pipeline_parallel_size GPUs; a prefill/decode split
    costs both pools (``replicas`` then scales the decode pool; the prefill pool counts at its configured size)."""
    if model.deployment.disaggregation is not None:
        return (local_hourly_cost_usd(model.pool_model("prefill"), uses_gpus=uses_gpus)
                + local_hourly_cost_usd(model.pool_model("decode"), uses_gpus=uses_gpus, replicas=replicas))
    n = replicas if replicas is not None else model.deployment.min_replicas()
    if uses_gpus:
        e = model.engine
        gpus_per_replica = e.data_parallel_size * e.tensor_parallel_size * e.pipeline_parallel_size
        return model.cost.gpu_hour_usd * gpus_per_replica * n
    return model.cost.node_hour_usd * n


def local_usd_per_token(hourly_cost_usd: float, interval_s: float, tokens_served: int,
                        min_tokens_per_hour: float = 0.0) -> float:
    """USD per token when ``tokens_served`` tokens were served in ``interval_s`` seconds.

    ``hourly_cost * (interval_s / 3600) / max(tokens_served, min_tokens_per_hour * interval_s / 3600)``;
    0 when nothing was served and there is no floor (nothing to charge).
    """
    if interval_s <= 0:
        raise ValueError(f"{interval_s=} must be > 0")
    hours = interval_s / 3600.0
    denom = max(float(tokens_served), min_tokens_per_hour * hours)
    return 0.0 if denom <= 0 else hourly_cost_usd * hours / denom


class LocalCostMeter:
    """Trailing-window output-token counter for one local model, turning hourly cost into $/token.

    The window's interval is ``min(window_s, now - started)`` so a freshly started gateway does not
    divide a few seconds of tokens by a whole hour.

    With several gateways (workers, other nodes) each sees only its share of the tokens: the others' window
    counts, shared through the gateway registry, come in by :meth:`set_peer_tokens` and count with this
    gateway's own (otherwise N gateways would each charge ~N x the real cost per token). A peer count older
    than ``peer_ttl_s`` is ignored.
    """

    peer_ttl_s = 10.0

    def __init__(self, hourly_cost_usd: float, *, window_s: float = 3600.0, min_tokens_per_hour: float = 10_000.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hourly_cost_usd = hourly_cost_usd
        self.window_s = window_s
        self.min_tokens_per_hour = min_tokens_per_hour
        self._clock = clock
        self._started = clock()
        self._events: deque[tuple[float, int]] = deque()
        self._tokens = 0
        self._peer: tuple[float, int] | None = None  # (set_at, other gateways' tokens in their windows)

    @classmethod
    def for_model(cls, model: ModelConfig, *, uses_gpus: bool, replicas: int | None = None,
                  clock: Callable[[], float] = time.monotonic) -> "LocalCostMeter":
        return cls(local_hourly_cost_usd(model, uses_gpus=uses_gpus, replicas=replicas),
                   window_s=model.cost.attribution_window_s,
                   min_tokens_per_hour=model.cost.min_output_tokens_per_hour, clock=clock)

    def record(self, output_tokens: int, now: float | None = None) -> None:
        t = self._clock() if now is None else now
        self._events.append((t, output_tokens))
        self._tokens += output_tokens

    def window_tokens(self, now: float | None = None) -> int:
        """Output tokens this gateway recorded in the trailing window (what it reports to its peers)."""
        t = self._clock() if now is None else now
        while self._events and self._events[0][0] <= t - self.window_s:
            self._tokens -= self._events.popleft()[1]
        return self._tokens

    def set_peer_tokens(self, tokens: int, now: float | None = None) -> None:
        """The other gateways' window counts for this model, summed (from the gateway registry)."""
        self._peer = (self._clock() if now is None else now, max(0, int(tokens)))

    def usd_per_output_token(self, now: float | None = None) -> float:
        t = self._clock() if now is None else now
        tokens = self.window_tokens(t)
        if self._peer is not None and t - self._peer[0] <= self.peer_ttl_s:
            tokens += self._peer[1]
        interval = max(1.0, min(self.window_s, t - self._started))
        return local_usd_per_token(self.hourly_cost_usd, interval, tokens, self.min_tokens_per_hour)

    def request_cost_usd(self, output_tokens: int, now: float | None = None) -> float:
        return output_tokens * self.usd_per_output_token(now)

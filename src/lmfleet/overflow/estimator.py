"""Predicted wait before a request's first token if it were sent to the local engines now.

The model
---------
The local deployment runs at most ``C`` requests at once (``capacity``, see :func:`local_capacity`);
the rest wait (in Ray Serve's router or vLLM's waiting queue), first come, first served. A new
request finds ``n`` requests in flight (``signals.in_flight``). It gets a slot when
``q = n - C + 1`` of them have finished (``q <= 0``: a slot is free now). Slots free up at the
measured drain rate ``r`` (completions per second while busy), so::

    wait = max(0, q) / r + first_token(prefill, decoding)

where ``first_token(prefill, decoding)`` is the time to the first token of a request that has its slot: the
prefill of its prompt and of the prompts ahead of it still without a first token, slowed by the sequences
decoding beside it. With a free slot now: ``prefill`` = its prompt + the prompts prefilling now, ``decoding`` =
the other requests in flight; when it queues, it starts as one of a full engine's requests ends, the queue ahead
already prefilled: ``prefill`` = its prompt, ``decoding`` = ``C - 1``. The function is fitted on recent
unqueued requests' TTFTs (:mod:`lmfleet.overflow.first_token`); until enough were seen, the median of those TTFTs
(``base_ttft``) stands for every prompt and load. One median for all made an idle engine's estimate too high (it
is taken among busier moments) and a full one's too low.

When the engine reports its own counts, they refine the capacity: with ``waiting > 0`` the engine is saturated at
``running`` sequences (KV-cache limits can hold it below ``max_num_seqs``), so ``C = min(C, running)``; and the
queue is at least ``waiting + 1``. The in-flight count ``n`` is the gateway's own (known at once, no poll lag),
the other gateways' last reports added.

Assumptions (and what they cost)
--------------------------------
* FIFO and steady state: completions arrive at the average rate of the trailing window. Under
  steady overload this is the engine's throughput, and the estimate tracks the real wait; after a
  sudden change the window (``signal_window_s``) needs to roll over before it does.
* The drain rate measured while the engine was only partly busy understates its capacity, so right
  after load ramps up the estimate is too high (conservative: it overflows early, never late).
* Request lengths are not known in advance; a queue of long generations drains slower than the
  window's average, a queue of short ones faster.

Drain rate unknown in the current window (fewer than ``min_completions`` completions, as on a slow engine whose
requests each take a good part of the window): the last rate measured (``last_drain_rps``), whatever its age. The
cold default below is a guess; on a CPU replica whose requests take 40 s it is 4x too fast.

Cold start (no measurements): the drain rate defaults to ``C / cold_service_s`` (every slot
busy for ``cold_service_s`` per request, 10 s by default: pessimistic for chat models) and
the first-token time to ``cold_ttft_s``. An idle engine then predicts ``cold_ttft_s`` (1 s, under the
2.5 s default threshold: stay local); a queue predicts several seconds per queued slot-round.
"""

from __future__ import annotations

from lmfleet.config.models import ModelConfig
from lmfleet.overflow.signals import QueueSignals

__all__ = ["estimate_wait_ms", "first_token_s", "local_capacity"]


def local_capacity(model: ModelConfig, replicas: int | None = None) -> int:
    """Requests the model's deployment runs concurrently: replicas x per-replica limit.

    The per-replica limit is ``min(max_ongoing_requests, engine.max_num_seqs)`` (Ray Serve sends a
    replica at most ``max_ongoing_requests``; vLLM runs at most ``max_num_seqs`` of them).
    ``replicas``: the number currently up (autoscaling), else the configured minimum.

    Data parallel (``engine.data_parallel_size`` = D): each replica is D ranks, each its own Serve replica with its
    own request cap, so a replica runs D x the per-rank limit. A prefill/decode split: the decode pool's, where
    requests spend their time generating (``replicas`` then counts decode replicas).
    """
    if model.deployment.disaggregation is not None:
        return local_capacity(model.pool_model("decode"), replicas)
    per_replica = model.deployment.max_ongoing_requests
    if model.engine.max_num_seqs is not None:
        per_replica = min(per_replica, model.engine.max_num_seqs)
    n = replicas if replicas is not None else model.deployment.min_replicas()
    return max(1, n) * per_replica * model.engine.data_parallel_size


def estimate_wait_ms(
    signals: QueueSignals,
    capacity: int,
    *,
    prompt_tokens: int | None = None,
    cold_service_s: float = 10.0,
    cold_ttft_s: float = 1.0,
) -> float:
    """Predicted milliseconds until this request's first token if it is sent locally now.

    ``capacity``: concurrent requests the local engines run (:func:`local_capacity`).
    ``prompt_tokens``: the request's prompt (None: a typical one, e.g. for a dashboard's figure).
    ``cold_service_s`` / ``cold_ttft_s``: defaults while nothing was measured (module docstring).
    """
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    slots = capacity
    if signals.engine_waiting and signals.engine_running:
        slots = min(slots, signals.engine_running)
    ahead = signals.in_flight - slots + 1
    if signals.engine_waiting:
        ahead = max(ahead, signals.engine_waiting + 1)
    queued = ahead > 0
    if queued:  # it starts as one of a full engine's requests ends; those ahead have been prefilled by then
        prefill, decoding = prompt_tokens, slots - 1
    else:
        prefill = None if prompt_tokens is None else prompt_tokens + signals.prefill_tokens
        decoding = max(0, signals.in_flight - signals.prefilling)
    first_s = first_token_s(signals, prefill, decoding, cold_ttft_s)
    if not queued:
        return first_s * 1000.0
    drain = signals.drain_rps or signals.last_drain_rps or slots / cold_service_s
    return (ahead / drain + first_s) * 1000.0


def first_token_s(signals: QueueSignals, prefill_tokens: int | None, decoding: int, cold_ttft_s: float = 1.0) -> float:
    """Seconds from a slot to the first token with ``prefill_tokens`` to prefill up to the request's own (None: a
    typical figure) beside ``decoding`` requests generating: the fitted first-token model, else the median
    unqueued TTFT, else ``cold_ttft_s``."""
    if signals.first_token is not None:
        return signals.first_token.predict_s(prefill_tokens, decoding)
    return signals.base_ttft_s if signals.base_ttft_s is not None else cold_ttft_s

"""Predicted wait before a request's first token if it were sent to the local engines now.

The model
---------
The local deployment runs at most ``C`` requests at once (``capacity``, see :func:`local_capacity`);
the rest wait (in Ray Serve's router or vLLM's waiting queue), first come, first served. A new
request finds ``n`` requests in flight (``signals.in_flight``). It gets a slot when
``q = n - C + 1`` of them have finished (``q <= 0``: a slot is free now). Slots free up at the
measured drain rate ``r`` (completions per second while busy), so::

    wait = max(0, q) / r + base_ttft

where ``base_ttft`` is the prefill time of a request that does not queue (the prefill line's, below,
:mod:`lmfleet.overflow.signals`). When the engine reports its own counts, they refine the capacity: with
``waiting > 0`` the engine is saturated at ``running`` sequences (KV-cache limits can hold it below
``max_num_seqs``), so ``C = min(C, running)``; and the queue is at least ``waiting + 1``.

Prefill work
------------
The gateway fits a line through the TTFTs of the requests that did not queue against their prefill work: its
TTFT ``base_ttft`` at the samples' median work (``base_prefill_tokens``) and its slope, the prefill time per token
(``prefill_s_per_token``). A request's work is its prompt plus the prompts still waiting for their first token
(``signals.pending_prefill_tokens``)::

    work = prompt_tokens + pending_prefill_tokens
    base_ttft' = max(0, base_ttft + prefill_s_per_token * (work - base_prefill_tokens))

This is what a long prompt costs, and what a request early in a burst pays for the prompts that arrived just
before it: vLLM prefills those first, even when a slot is free. It also works the other way: after a spell of
long prompts the base TTFT is theirs, and a short chat on the idle engine is predicted at its own, shorter
prefill. Without a measured slope the term is 0.

While the line is stale (``signals.prefill_stale``: nothing in flight and its newest sample over a minute old)
``base_ttft'`` is at most ``cold_ttft_s + prefill_s_per_token * work``, so a line that samples slowed by something
it does not see cannot hold an idle engine over the threshold for longer than that minute.

The prefill gate
----------------
With ``overflow.prefill_gate`` on, a gated request's prompts ahead go to the engine one at a time (per replica),
each after the one before has its first token, and each then costs its own service time: its prefill, an engine
step and a round trip (:mod:`lmfleet.overflow.signals`, the gate's service line ``s(tokens)``). So for a request
that would pass the gate (:func:`gate_wait_s`) while a slot is free (``q <= 0``)::

    wait = sum(s(t_i) for held prompts) + sum(max(0, s(t_h) - elapsed_h) for prompts through the gate)
           (both shared among the gate's limit, one per running replica)
           + k x (pending prompts that did not pass the gate) + s(prompt_tokens)

Behind a full engine (``q > 0``) the held prompts wait for slots more than for the gate, and the queue term with
the prefill line decides, as for a request that does not pass the gate. ``s`` takes the prefill line's slope ``k``
until its own samples span enough tokens to measure one. A prefill line fitted on TTFTs by the tokens ahead puts
the step each held prompt adds into its slope, so it undercounts a queue of short prompts (each a whole step) and
overcounts a few long ones. Until the service line has its samples, ``s`` is the prefill line's TTFT of a prompt
alone at the engine, ``base_ttft + k x (tokens - base tokens)``: each held prompt still costs a step of its own,
where pricing it on the slope alone let a burst right after a spell without the gate (overflow off) pass the gate
at a few milliseconds a prompt. While the prefill line is stale, the prefill line decides.

Assumptions (and what they cost)
--------------------------------
* FIFO and steady state: completions arrive at the average rate of the trailing window. Under
  steady overload this is the engine's throughput, and the estimate tracks the real wait; after a
  sudden change the window (``signal_window_s``) needs to roll over before it does.
* The drain rate measured while the engine was only partly busy understates its capacity, so right
  after load ramps up the estimate is too high (conservative: it overflows early, never late).
* Request lengths are not known in advance; a queue of long generations drains slower than the
  window's average, a queue of short ones faster.

Cold start (no measurements): the drain rate defaults to ``C / cold_service_s`` (every slot
busy for ``cold_service_s`` per request, 10 s by default: pessimistic for chat models) and
``base_ttft`` to ``cold_ttft_s``. An idle engine then predicts ``cold_ttft_s`` (1 s, under the
2.5 s default threshold: stay local); a queue predicts several seconds per queued slot-round.

With a threshold under ``cold_ttft_s`` an idle engine would be predicted over it for ever: every request would go
to a provider, and none would measure the engine. So while no TTFT is measured (or the prefill line is stale) and
nothing is in flight, a
``cold_ttft_s`` above the threshold is replaced by ``EXPLORE_SHARE`` of the threshold (:func:`cold_ttft_for`): the
next request is tried locally and measured; if the engine is slower than the threshold, the measured base TTFT
then spills the requests after it.

Until the window holds enough completions for a measured rate (``MIN_COMPLETIONS``), the ones it holds still
count (:func:`drain_rate`): the cold rate is a prior worth ``MIN_COMPLETIONS`` completions, and the window's ``n``
completions over its ``busy_s`` busy seconds update it as a gamma prior on a Poisson rate is updated::

    r = (n + MIN_COMPLETIONS) / (busy_s + MIN_COMPLETIONS / r_cold)

A burst of long generations that has kept every slot busy for 20 s with two completions predicts a slot-round of
about 5 s, not the cold 1.25 s; a new burst a second old predicts about the cold rate. The measured rate
(``n / busy_s``) takes over once the window holds ``MIN_COMPLETIONS`` completions.
"""

from __future__ import annotations

from lmfleet.config.models import ModelConfig
from lmfleet.overflow.signals import MIN_COMPLETIONS, QueueSignals

__all__ = ["EXPLORE_SHARE", "cold_ttft_for", "drain_rate", "estimate_wait_ms", "gate_wait_s", "local_capacity",
           "prefill_excess_s", "queue_position", "serving_capacity"]

EXPLORE_SHARE = 0.5
"""While no TTFT is measured and nothing is in flight, a cold prefill time above the threshold is replaced by this
share of it (:func:`cold_ttft_for`)."""


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


def serving_capacity(model: ModelConfig, full: int, running_replicas: int) -> int:
    """The capacity to count while ``running_replicas`` Serve replicas of the model run (Serve's status): ``full``
    when at least the configured number run (or the count is unknown: 0), else that share of it, at least 1.

    During a rolling replacement of its engines or after a lost node the estimate then counts the missing
    capacity, so requests over the threshold spill instead of queueing on the replicas left. With autoscaling
    the configured number is ``min_replicas``; a prefill/decode split keeps ``full`` (its pools' replicas are
    not told apart in the count)."""
    if model.deployment.disaggregation is not None or running_replicas <= 0:
        return full
    target = model.deployment.min_replicas() * model.engine.data_parallel_size
    if running_replicas >= target:
        return full
    return max(1, full * running_replicas // target)


def estimate_wait_ms(
    signals: QueueSignals,
    capacity: int,
    *,
    cold_service_s: float = 10.0,
    cold_ttft_s: float = 1.0,
    prompt_tokens: int = 0,
    gated: bool = False,
    gate_limit: int = 1,
) -> float:
    """Predicted milliseconds until this request's first token if it is sent locally now.

    ``capacity``: concurrent requests the local engines run (:func:`local_capacity`).
    ``cold_service_s`` / ``cold_ttft_s``: defaults while nothing was measured (module docstring).
    ``prompt_tokens``: the request's prompt (0: unknown, e.g. the model's figure on a dashboard).
    ``gated``: the request would pass ``overflow.prefill_gate``, which lets ``gate_limit`` prompts through at once
    (:func:`gate_wait_s`).
    """
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    slots, ahead = queue_position(signals, capacity)
    queue_s = ahead / drain_rate(signals, slots, cold_service_s) if ahead > 0 else 0.0
    gate_s = gate_wait_s(signals, prompt_tokens, gate_limit) if gated and ahead <= 0 else None
    if gate_s is not None:
        return gate_s * 1000.0
    base_s = signals.base_ttft_s if signals.base_ttft_s is not None else cold_ttft_s
    base_s = max(0.0, base_s + prefill_excess_s(signals, prompt_tokens))
    if signals.prefill_stale and signals.base_ttft_s is not None:
        base_s = min(base_s, cold_ttft_s + (signals.prefill_s_per_token or 0.0) * _work(signals, prompt_tokens))
    return (queue_s + base_s) * 1000.0


def queue_position(signals: QueueSignals, capacity: int) -> tuple[int, int]:
    """``(slots, ahead)``: the slots the engines run now (``capacity``, or the engine's running count while it
    reports waiting requests) and the completions a new request waits for before one is free (<= 0: one is free now;
    at least the engine's waiting count + 1). Pure."""
    slots = capacity
    if signals.engine_waiting and signals.engine_running:
        slots = min(slots, signals.engine_running)
    ahead = signals.in_flight - slots + 1
    if signals.engine_waiting:
        ahead = max(ahead, signals.engine_waiting + 1)
    return slots, ahead


def drain_rate(signals: QueueSignals, slots: int, cold_service_s: float) -> float:
    """Completions per second the estimate counts on: the measured ``drain_rps``, else the cold rate
    ``slots / cold_service_s`` updated by the window's completions and busy seconds (module docstring). Pure."""
    if signals.drain_rps:
        return signals.drain_rps
    prior = slots / cold_service_s
    return (signals.completions_in_window + MIN_COMPLETIONS) / (max(0.0, signals.busy_s) + MIN_COMPLETIONS / prior)


def cold_ttft_for(signals: QueueSignals, cold_ttft_s: float, threshold_ms: float) -> float:
    """The ``cold_ttft_s`` to estimate with (module docstring): ``EXPLORE_SHARE x threshold`` when it is above the
    threshold while no base TTFT is measured (or the prefill line is stale) and nothing is in flight, else
    ``cold_ttft_s`` unchanged."""
    if ((signals.base_ttft_s is None or signals.prefill_stale) and signals.in_flight == 0
            and cold_ttft_s * 1000.0 > threshold_ms):
        return EXPLORE_SHARE * threshold_ms / 1000.0
    return cold_ttft_s


def gate_wait_s(signals: QueueSignals, prompt_tokens: int, limit: int = 1) -> float | None:
    """Seconds to a gated request's first token while a slot is free (module docstring, the prefill gate): each
    prompt in the gate's queue ahead of it costs its service time on the gate's service line (a prompt already
    through the gate, what is left of it), shared among the ``limit`` prompts the gate lets through at once, then its
    own; prompts at the engine that did not pass the gate add the prefill line's slope per token. Until the service
    line has a slope (its samples too close in size), the prefill line's slope from the service line's base; until
    it has samples, the prefill line itself. None while no TTFT is measured or the prefill line is stale. Pure."""
    if signals.prefill_stale:
        return None
    if signals.gate_base_s is not None:
        # the service line's slope once its samples span enough tokens to measure one, else the prefill line's: a
        # flat line fitted on short prompts alone would price a long prompt at a short one's service
        k = signals.gate_s_per_token if signals.gate_s_per_token is not None else (signals.prefill_s_per_token or 0.0)
        base, x0 = signals.gate_base_s, signals.gate_base_tokens or 0.0
    elif signals.base_ttft_s is not None:
        k, base, x0 = signals.prefill_s_per_token or 0.0, signals.base_ttft_s, signals.base_prefill_tokens or 0.0
    else:
        return None

    def service(tokens: int) -> float:
        return max(0.0, base + k * (tokens - x0))

    ahead = 0.0
    queued = 0
    for tokens, elapsed in signals.gate_queue:
        queued += tokens
        ahead += service(tokens) if elapsed is None else max(0.0, service(tokens) - elapsed)
    ungated = max(0, signals.pending_prefill_tokens - queued) * (signals.prefill_s_per_token or 0.0)
    return ahead / max(1, limit) + ungated + service(max(0, prompt_tokens))


def prefill_excess_s(signals: QueueSignals, prompt_tokens: int) -> float:
    """Seconds a request of ``prompt_tokens`` waits for prefill beyond the base TTFT (module docstring); negative
    when its work is below the base samples' median."""
    k = signals.prefill_s_per_token
    if not k:
        return 0.0
    return k * (_work(signals, prompt_tokens) - (signals.base_prefill_tokens or 0.0))


def _work(signals: QueueSignals, prompt_tokens: int) -> int:
    return max(0, prompt_tokens) + signals.pending_prefill_tokens

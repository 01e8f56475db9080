"""The oracle: the cheapest set of requests to spill so that every request kept local meets the TTFT SLO.

An offline bound for the benchmark, not an online policy: it sees the whole trace (every arrival and every
request's length) in advance, which no router can. A policy's spend divided by the oracle's says how much the
lack of foresight (and the estimate's errors) cost.

The local model (:class:`LocalServiceModel`, fitted on the benchmark's measured local answers)
---------------------------------------------------------------------------------------------
* One replica runs at most ``slots`` requests at once (its effective batch: ``max_num_seqs``, or fewer when
  the KV cache holds it lower); further requests wait, first come first served, for the first slot to free.
* Prefill is serial: a request's prompt is processed once it has a slot and every earlier request's prompt is
  done, at ``prefill_s_per_token`` per prompt token (a vLLM engine's chunked prefill shares one token budget per
  step, so simultaneous prompts queue behind each other). Its first token comes ``prefill_base_s`` after its
  prompt is done (that part holds up no other prompt), and its slot frees ``output_tokens * decode_s_per_token``
  after that. Per request, in arrival order::

      start = max(arrival, first slot free, previous prompt done)
      prompt done = start + prompt_tokens * prefill_s_per_token
      TTFT = prompt done + prefill_base_s - arrival;  slot frees at TTFT + arrival + output_tokens * decode_s_per_token

  On an idle replica a request's TTFT is ``prefill_s = prefill_base_s + prompt_tokens * prefill_s_per_token``.
  A kept request meets the SLO when its TTFT is ``<= slo_s``.
* The coefficients are fitted on measured requests (:meth:`LocalServiceModel.fit`): the prefill line by least
  absolute deviations (the gateway's fit, :func:`lmfleet.overflow.signals.prefill_line`: the few answers slowed by
  other work -- prompts that joined their engine step after them, a burst's decoding -- do not pull it, as they would
  a least-squares line, toward a flat slope and a high base) on (prompt tokens, TTFT) of local answers that did not
  queue -- no free slot, or another request still
  before its first token, when they arrived (the benchmark takes them from every policy's rounds: an overloaded
  ``local only`` run has few, each round counted on its own) -- and the decode rate as the median time per output
  token after the first, under the ``local only`` run's load.
* A spilled request costs the provider's price for its prompt and output tokens (nano-dollars) and uses no
  local slot; the provider is assumed to meet the SLO (its TTFT is the benchmark's to report).

Assumptions: decode does not depend on how many requests share the replica (it is measured at the ``local only``
run's load, so a lightly loaded stretch of the trace is served slower than it would be, and a heavier one faster),
nor does a prompt's prefill slow the decode beside it; no prefix-cache hits beyond those in the measured run; one
replica (``slots`` covers several replicas only as one pooled queue).

The search
----------
Removing a request from the first-come-first-served queue never delays another: every slot, and the time the
prefill is free, are no later without it. So a spill only helps the requests kept. :func:`oracle_spill` walks
the trace in arrival order, keeps each request that meets the SLO behind those kept so far, and when one would
miss it spills the cheapest of: the request itself, or one earlier kept request still in the replica (queued or
running) when it arrives whose removal lets it meet the SLO. A second pass then spills a kept request wherever that
lets spilled requests worth more come back (the greedy's commonest mistake: keeping one long request that pushes
several cheaper ones out). The result is feasible, so its spend is an upper bound on the cheapest; on traces of up
to :data:`EXACT_LIMIT` requests :func:`exact_spill` tries every subset and returns the true minimum (the tests
compare the two).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lmfleet.config.models import ProviderPrice
from lmfleet.overflow.cost import external_cost_usd
from lmfleet.overflow.money import usd_to_nusd
from lmfleet.overflow.signals import prefill_line

__all__ = [
    "EXACT_LIMIT",
    "LocalServiceModel",
    "OracleResult",
    "ServiceSample",
    "TracedRequest",
    "exact_spill",
    "kept_ttfts_s",
    "oracle_spill",
    "spill_cost_nusd",
]

EXACT_LIMIT = 16
"""Most requests :func:`exact_spill` takes (it simulates every subset: 2^n of them)."""


class TracedRequest(Protocol):
    """One request of a trace (``lmfleet.bench.trace.TraceRequest`` is one)."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...


@dataclass(frozen=True)
class ServiceSample:
    """One request of the ``local only`` run: its lengths and timings (seconds)."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    queued: bool
    """It waited for a slot, or arrived while another request was still before its first token (its TTFT is not
    its prefill time alone)."""


@dataclass(frozen=True)
class LocalServiceModel:
    """One replica as the oracle models it (module docstring)."""

    slots: int
    prefill_base_s: float
    prefill_s_per_token: float
    decode_s_per_token: float

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots={self.slots} must be >= 1")
        for name in ("prefill_base_s", "prefill_s_per_token", "decode_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def prefill_s(self, r: TracedRequest) -> float:
        """Its TTFT on an idle replica."""
        return self.prefill_base_s + r.prompt_tokens * self.prefill_s_per_token

    def service_s(self, r: TracedRequest) -> float:
        """How long it holds its slot, from its start."""
        return self.prefill_s(r) + r.output_tokens * self.decode_s_per_token

    @classmethod
    def fit(cls, samples: Sequence[ServiceSample], slots: int,
            decode_samples: Sequence[ServiceSample] | None = None) -> "LocalServiceModel":
        """Fit the prefill line on ``samples`` and the decode rate on ``decode_samples`` (default: ``samples``;
        module docstring). Needs two unqueued requests of different prompt lengths, and one request with more
        than one output token."""
        unqueued = [s for s in samples if not s.queued]
        xs = [float(s.prompt_tokens) for s in unqueued]
        if len(set(xs)) < 2:
            raise ValueError(f"fitting the prefill line needs unqueued requests of at least two prompt lengths; "
                             f"got {len(unqueued)} unqueued, prompt lengths {sorted(set(xs))}")
        line = prefill_line(list(zip(xs, (s.ttft_s for s in unqueued))), min_spread=1, min_pairs=1)
        assert line is not None  # None only without samples
        slope = line.slope or 0.0
        base = line.base_ttft_s - slope * line.base_work
        per_token = [(s.e2e_s - s.ttft_s) / (s.output_tokens - 1)
                     for s in (samples if decode_samples is None else decode_samples) if s.output_tokens > 1]
        if not per_token:
            raise ValueError("fitting the decode rate needs a request with more than one output token")
        return cls(slots=slots, prefill_base_s=max(0.0, base), prefill_s_per_token=max(0.0, slope),
                   decode_s_per_token=max(0.0, statistics.median(per_token)))


@dataclass(frozen=True)
class OracleResult:
    spilled: tuple[int, ...]
    """Trace indices sent to the provider, ascending."""
    spend_nusd: int
    """What the spilled requests cost at the provider's price."""
    exact: bool
    """True: the minimum (every subset tried); False: the greedy's feasible upper bound."""


def spill_cost_nusd(r: TracedRequest, price: ProviderPrice) -> int:
    return usd_to_nusd(external_cost_usd(r.prompt_tokens, r.output_tokens, price))


_State = tuple[list[float], float]
"""The replica before a request starts: its slots' free times (a heap) and when the prefill is next free."""


def _empty(model: LocalServiceModel) -> _State:
    return [float("-inf")] * model.slots, float("-inf")


def _admit(free: list[float], prefill_free: float, r: TracedRequest,
           model: LocalServiceModel) -> tuple[float, float, float]:
    """Start ``r`` on the replica (module docstring): takes its slot from ``free`` and gives it back with the time it
    frees (in place). Returns its TTFT, when the prefill is next free, and when its slot frees."""
    start = max(r.arrival_s, heapq.heappop(free), prefill_free)
    end = start + model.service_s(r)
    heapq.heappush(free, end)
    # only the per-token part holds up the next prompt; the base follows it
    return start + model.prefill_s(r) - r.arrival_s, start + r.prompt_tokens * model.prefill_s_per_token, end


def kept_ttfts_s(trace: Sequence[TracedRequest], kept: Sequence[int], model: LocalServiceModel) -> list[float]:
    """TTFT of each kept request (trace indices, in arrival order) on the modelled replica."""
    order = sorted(kept, key=lambda i: (trace[i].arrival_s, i))
    free, prefill_free = _empty(model)
    out = []
    for i in order:
        ttft, prefill_free, _ = _admit(free, prefill_free, trace[i], model)
        out.append(ttft)
    return out


def _meets(trace: Sequence[TracedRequest], kept: Sequence[int], model: LocalServiceModel, slo_s: float) -> bool:
    return all(t <= slo_s for t in kept_ttfts_s(trace, kept, model))


def oracle_spill(trace: Sequence[TracedRequest], model: LocalServiceModel, slo_ms: float,
                 price: ProviderPrice, *, swap_pass: bool = True) -> OracleResult:
    """A cheap spill set meeting the SLO for every kept request: the search of the module docstring
    (``swap_pass=False``: the greedy alone)."""
    slo_s = slo_ms / 1000.0
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, i))
    cost = [spill_cost_nusd(r, price) for r in trace]
    # Per kept request, in order: the replica before it started, and when its slot frees; and the replica after
    # the last one.
    kept: list[int] = []
    states: list[_State] = []
    ends: list[float] = []
    after: _State = _empty(model)
    spilled: list[int] = []

    def replay(from_pos: int, ids: list[int]) -> tuple[list[_State], list[float], float | None, _State]:
        """Simulate ``ids`` from the replica before kept position ``from_pos``: their states and slot ends, the
        last one's TTFT, and the replica after them."""
        free, prefill_free = states[from_pos] if from_pos < len(states) else after
        free = list(free)
        ss, es, ttft = [], [], None
        for i in ids:
            ss.append((list(free), prefill_free))
            ttft, prefill_free, end = _admit(free, prefill_free, trace[i], model)
            es.append(end)
        return ss, es, ttft, (free, prefill_free)

    for i in order:
        ss, es, ttft, last = replay(len(kept), [i])
        if ttft is not None and ttft <= slo_s:
            kept.append(i)
            states.extend(ss)
            ends.extend(es)
            after = last
            continue
        best_pos, best_cost = None, cost[i]
        arrival = trace[i].arrival_s
        for pos in range(len(kept) - 1, -1, -1):
            if cost[kept[pos]] >= best_cost or ends[pos] <= arrival:
                continue  # dearer than spilling i, or no longer in the replica when i arrives (not searched)
            _, _, t, _ = replay(pos, kept[pos + 1:] + [i])
            if t is not None and t <= slo_s:
                best_pos, best_cost = pos, cost[kept[pos]]
        if best_pos is None:
            spilled.append(i)
            continue
        spilled.append(kept[best_pos])
        rest = kept[best_pos + 1:] + [i]
        ss, es, _, after = replay(best_pos, rest)
        kept[best_pos:] = rest
        states[best_pos:] = ss
        ends[best_pos:] = es
    if swap_pass:
        kept, spilled = _swap_pass(trace, model, slo_s, cost, kept, spilled)
    return OracleResult(tuple(sorted(spilled)), sum(cost[j] for j in spilled), exact=False)


def _swap_pass(trace: Sequence[TracedRequest], model: LocalServiceModel, slo_s: float, cost: list[int],
               kept: list[int], spilled: list[int]) -> tuple[list[int], list[int]]:
    """Spill one kept request where that lets spilled requests worth more come back (dearest first).

    The greedy decides at each miss without seeing later ones; this repairs its commonest mistake, keeping
    one long request that then pushes several cheaper ones out. The candidates to bring back arrive while the
    spilled request's slot time (plus the SLO) would have run. Each check simulates from the kept request's
    position only until the replica frees no later than in the current run (:func:`_feasible_from`)."""
    arrival = [r.arrival_s for r in trace]
    spilled_sorted = sorted(spilled, key=lambda i: (arrival[i], i))
    states, position = _states(trace, model, kept)
    for j in sorted(kept, key=lambda i: (-cost[i], i)):
        pos = position.get(j)
        if pos is None:
            continue
        start = max(states[pos][0][0], states[pos][1])
        free_end = start + model.service_s(trace[j]) + slo_s  # j's slot time, and the SLO after it
        lo = bisect.bisect_left(spilled_sorted, (arrival[j], j), key=lambda i: (arrival[i], i))
        hi = bisect.bisect_right(spilled_sorted, (free_end, len(trace)), key=lambda i: (arrival[i], i))
        window = spilled_sorted[lo:hi]
        if sum(cost[i] for i in window) <= cost[j]:
            continue
        back: list[int] = []  # in arrival order, as the window is
        for c in window:
            if _feasible_from(trace, model, slo_s, kept, states, position, pos, {j}, [*back, c]):
                back.append(c)
        if sum(cost[i] for i in back) > cost[j]:
            kept = sorted([i for i in kept if i != j] + back, key=lambda i: (arrival[i], i))
            spilled = [i for i in spilled if i not in back] + [j]
            spilled_sorted = sorted(spilled, key=lambda i: (arrival[i], i))
            states, position = _states(trace, model, kept)
    return kept, spilled


def _states(trace: Sequence[TracedRequest], model: LocalServiceModel,
            kept: list[int]) -> tuple[list[_State], dict[int, int]]:
    """Before each kept request starts: its slots' free times, sorted, and when the prefill is next free, all
    floored at its arrival; and each kept request's position."""
    free, prefill_free = _empty(model)
    out: list[_State] = []
    for i in kept:
        a = trace[i].arrival_s
        out.append((sorted(max(v, a) for v in free), max(prefill_free, a)))
        _, prefill_free, _ = _admit(free, prefill_free, trace[i], model)
    return out, {i: k for k, i in enumerate(kept)}


def _feasible_from(trace: Sequence[TracedRequest], model: LocalServiceModel, slo_s: float, kept: list[int],
                   states: list[_State], position: dict[int, int], pos: int, removed: set[int],
                   added: list[int]) -> bool:
    """Whether ``kept`` less ``removed`` plus ``added`` (all at or after ``kept[pos]``) meets the SLO.

    Requests before ``pos`` are unchanged. Simulation stops at the first unchanged request after the last
    change whose slots (sorted free times) each free no later, and whose prefill is free no later, than in the
    current run (all floored at its arrival): from there on every request starts no later than it does now, and
    the current run meets the SLO.
    """
    last_change = max([trace[i].arrival_s for i in added] + [trace[kept[pos]].arrival_s])
    rest = (kept[k] for k in range(pos, len(kept)) if kept[k] not in removed)
    key = lambda i: (trace[i].arrival_s, i)  # noqa: E731
    free, prefill_free = list(states[pos][0]), states[pos][1]
    for i in heapq.merge(rest, added, key=key):
        a = trace[i].arrival_s
        k = position.get(i)
        if k is not None and a > last_change and max(prefill_free, a) <= states[k][1] and all(
                x <= y for x, y in zip(sorted(max(v, a) for v in free), states[k][0])):
            return True  # the replica frees no later than in the current, feasible run: so does every start
        ttft, prefill_free, _ = _admit(free, prefill_free, trace[i], model)
        if ttft > slo_s:
            return False
    return True


def exact_spill(trace: Sequence[TracedRequest], model: LocalServiceModel, slo_ms: float,
                price: ProviderPrice) -> OracleResult:
    """The cheapest spill set, by trying every subset (ties: fewest requests, then lowest indices)."""
    n = len(trace)
    if n > EXACT_LIMIT:
        raise ValueError(f"exact_spill takes at most {EXACT_LIMIT} requests (2^n subsets); got {n}: "
                         "use oracle_spill")
    slo_s = slo_ms / 1000.0
    cost = [spill_cost_nusd(r, price) for r in trace]
    best: tuple[int, int, tuple[int, ...]] | None = None
    for k in range(n + 1):
        for spill in itertools.combinations(range(n), k):
            c = sum(cost[j] for j in spill)
            if best is not None and (c, k) >= best[:2]:
                continue
            kept = [i for i in range(n) if i not in spill]
            if _meets(trace, kept, model, slo_s):
                best = (c, k, spill)
    if best is None:  # unreachable: spilling every request meets the SLO vacuously
        raise RuntimeError("no spill set met the SLO")
    return OracleResult(best[2], best[0], exact=True)

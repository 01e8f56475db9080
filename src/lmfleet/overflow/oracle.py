"""The oracle: the cheapest set of requests to spill so that every request kept local meets the TTFT SLO.

An offline bound for the benchmark, not an online policy: it sees the whole trace (every arrival and every
request's length) in advance, which no router can. A policy's spend divided by the oracle's says how much the
lack of foresight (and the estimate's errors) cost.

The local model (:class:`LocalServiceModel`, measured in the benchmark's ``local only`` run)
------------------------------------------------------------------------------------------
* One replica runs at most ``slots`` requests at once (its effective batch: ``max_num_seqs``, or fewer when
  the KV cache holds it lower); further requests wait, first come first served, for the first slot to free.
* A request holds its slot for its service time ``prefill_s + output_tokens * decode_s_per_token``, where
  ``prefill_s = prefill_base_s + prompt_tokens * prefill_s_per_token`` is its TTFT had it not queued.
  The coefficients are fitted on measured requests (:meth:`LocalServiceModel.fit`): the prefill line by least
  squares on (prompt tokens, TTFT) of local answers that did not queue -- no free slot, or another request still
  before its first token, when they arrived (the benchmark takes them from every policy's rounds: an overloaded
  ``local only`` run has few, each round counted on its own) -- and the decode rate as the median time per output
  token after the first, under the ``local only`` run's load.
* A kept request's TTFT is ``start - arrival + prefill_s``; it meets the SLO when that is ``<= slo_s``.
* A spilled request costs the provider's price for its prompt and output tokens (nano-dollars) and uses no
  local slot; the provider is assumed to meet the SLO (its TTFT is the benchmark's to report).

Assumptions: service times do not depend on how many requests share the replica (decode is measured at the
``local only`` run's load, so a lightly loaded stretch of the trace is served slower than it would be, and a
heavier one faster); no prefix-cache hits beyond those in the measured run; one replica (``slots`` covers
several replicas only as one pooled queue).

The search
----------
Removing a request from a first-come-first-served queue never delays another (every slot frees no later),
so a spill only helps the requests kept. :func:`oracle_spill` walks the trace in arrival order, keeps each
request that meets the SLO behind those kept so far, and when one would miss it spills the cheapest of: the
request itself, or one earlier kept request still in the replica (queued or running) when it arrives whose
removal lets it meet the SLO. A second pass then spills a kept request wherever that lets spilled requests
worth more come back (the greedy's commonest mistake: keeping one long request that pushes several cheaper
ones out; on the tests' five-minute bursty trace it cut the spend by 12 %). The result is feasible, so its spend is
an upper bound on the cheapest; on traces of up to :data:`EXACT_LIMIT` requests :func:`exact_spill` tries every
subset and returns the true minimum (the tests compare the two).
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
        return self.prefill_base_s + r.prompt_tokens * self.prefill_s_per_token

    def service_s(self, r: TracedRequest) -> float:
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
        ys = [s.ttft_s for s in unqueued]
        slope, base = statistics.linear_regression(xs, ys)
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


def kept_ttfts_s(trace: Sequence[TracedRequest], kept: Sequence[int], model: LocalServiceModel) -> list[float]:
    """TTFT of each kept request (trace indices, in arrival order) on the modelled replica."""
    order = sorted(kept, key=lambda i: (trace[i].arrival_s, i))
    free = [float("-inf")] * model.slots
    out = []
    for i in order:
        r = trace[i]
        start = max(r.arrival_s, heapq.heappop(free))
        heapq.heappush(free, start + model.service_s(r))
        out.append(start - r.arrival_s + model.prefill_s(r))
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
    # Per kept request, in order: the slot heap before it started, and when its slot frees.
    kept: list[int] = []
    heaps: list[list[float]] = []
    ends: list[float] = []
    spilled: list[int] = []

    def replay(from_pos: int, ids: list[int]) -> tuple[list[list[float]], list[float], float | None]:
        """Simulate ``ids`` from the state before kept position ``from_pos``; the last one's TTFT."""
        free = list(heaps[from_pos]) if from_pos < len(heaps) else _heap_after(heaps, ends, model)
        hs, es, ttft = [], [], None
        for i in ids:
            r = trace[i]
            hs.append(list(free))
            start = max(r.arrival_s, heapq.heappop(free))
            es.append(start + model.service_s(r))
            heapq.heappush(free, es[-1])
            ttft = start - r.arrival_s + model.prefill_s(r)
        return hs, es, ttft

    for i in order:
        hs, es, ttft = replay(len(kept), [i])
        if ttft is not None and ttft <= slo_s:
            kept.append(i)
            heaps.extend(hs)
            ends.extend(es)
            continue
        best_pos, best_cost = None, cost[i]
        arrival = trace[i].arrival_s
        for pos in range(len(kept) - 1, -1, -1):
            if cost[kept[pos]] >= best_cost or ends[pos] <= arrival:
                continue  # dearer than spilling i, or no longer in the replica when i arrives (not searched)
            _, _, t = replay(pos, kept[pos + 1:] + [i])
            if t is not None and t <= slo_s:
                best_pos, best_cost = pos, cost[kept[pos]]
        if best_pos is None:
            spilled.append(i)
            continue
        spilled.append(kept[best_pos])
        rest = kept[best_pos + 1:] + [i]
        hs, es, _ = replay(best_pos, rest)
        kept[best_pos:] = rest
        heaps[best_pos:] = hs
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
    position only until every slot frees no later than in the current run (:func:`_feasible_from`)."""
    arrival = [r.arrival_s for r in trace]
    spilled_sorted = sorted(spilled, key=lambda i: (arrival[i], i))
    heaps, position = _heaps(trace, model, kept)
    for j in sorted(kept, key=lambda i: (-cost[i], i)):
        pos = position.get(j)
        if pos is None:
            continue
        free_end = heaps[pos][0] + model.service_s(trace[j]) + slo_s  # j's slot time, and the SLO after it
        lo = bisect.bisect_left(spilled_sorted, (arrival[j], j), key=lambda i: (arrival[i], i))
        hi = bisect.bisect_right(spilled_sorted, (free_end, len(trace)), key=lambda i: (arrival[i], i))
        window = spilled_sorted[lo:hi]
        if sum(cost[i] for i in window) <= cost[j]:
            continue
        back: list[int] = []  # in arrival order, as the window is
        for c in window:
            if _feasible_from(trace, model, slo_s, kept, heaps, position, pos, {j}, [*back, c]):
                back.append(c)
        if sum(cost[i] for i in back) > cost[j]:
            kept = sorted([i for i in kept if i != j] + back, key=lambda i: (arrival[i], i))
            spilled = [i for i in spilled if i not in back] + [j]
            spilled_sorted = sorted(spilled, key=lambda i: (arrival[i], i))
            heaps, position = _heaps(trace, model, kept)
    return kept, spilled


def _heaps(trace: Sequence[TracedRequest], model: LocalServiceModel,
           kept: list[int]) -> tuple[list[list[float]], dict[int, int]]:
    """Before each kept request starts: its slots' free times, sorted and floored at its arrival; and each
    kept request's position."""
    free = [float("-inf")] * model.slots
    slots = []
    for i in kept:
        a = trace[i].arrival_s
        slots.append(sorted(max(v, a) for v in free))
        start = max(a, heapq.heappop(free))
        heapq.heappush(free, start + model.service_s(trace[i]))
    return slots, {i: k for k, i in enumerate(kept)}


def _feasible_from(trace: Sequence[TracedRequest], model: LocalServiceModel, slo_s: float, kept: list[int],
                   heaps: list[list[float]], position: dict[int, int], pos: int, removed: set[int],
                   added: list[int]) -> bool:
    """Whether ``kept`` less ``removed`` plus ``added`` (all at or after ``kept[pos]``) meets the SLO.

    Requests before ``pos`` are unchanged. Simulation stops at the first unchanged request after the last
    change whose slots (sorted free times, floored at its arrival) each free no later than in the current run:
    from there on every request starts no later than it does now, and the current run meets the SLO.
    """
    last_change = max([trace[i].arrival_s for i in added] + [trace[kept[pos]].arrival_s])
    rest = (kept[k] for k in range(pos, len(kept)) if kept[k] not in removed)
    key = lambda i: (trace[i].arrival_s, i)  # noqa: E731
    free = list(heaps[pos])
    for i in heapq.merge(rest, added, key=key):
        a = trace[i].arrival_s
        k = position.get(i)
        if k is not None and a > last_change and all(
                x <= y for x, y in zip(sorted(max(v, a) for v in free), heaps[k])):
            return True  # every slot frees no later than in the current, feasible run: so does every start
        start = max(a, heapq.heappop(free))
        if start - a + model.prefill_s(trace[i]) > slo_s:
            return False
        heapq.heappush(free, start + model.service_s(trace[i]))
    return True


def _heap_after(heaps: list[list[float]], ends: list[float], model: LocalServiceModel) -> list[float]:
    """The slot heap after the last kept request started (or the empty replica's)."""
    if not heaps:
        return [float("-inf")] * model.slots
    free = list(heaps[-1])
    heapq.heapreplace(free, ends[-1])
    return free


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

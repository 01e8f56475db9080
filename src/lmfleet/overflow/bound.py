"""A lower bound on the oracle's spend: the cheapest spill set on an engine that prefills as fast as it ever did.

The oracle (:mod:`lmfleet.overflow.oracle`) models the engine and can be wrong both ways, so a policy's spend over
the oracle's says nothing for certain. This bound relaxes the engine instead of modelling it:

* Its only limit is prefill: the engine serves prompts first come first served at no more than ``rate`` prompt
  tokens per second, with nothing else in its way -- no decoding beside the prompts, no slot limit, no fixed
  latency, no step that ends after a first token is due. Under that engine, a kept request ``i`` has its first
  token no earlier than ``a_s + W(s..i) / rate`` for every kept request ``s`` sent at or before it (``a`` the
  send times, ``W(s..i)`` the prompt tokens of the kept requests from ``s`` to ``i``, ``i`` included): none of
  that work could start before ``a_s``, and all of it comes first. Its TTFT is the largest of those, the backlog
  of a fluid queue drained at ``rate`` (:func:`fluid_ttfts_s`).
* ``rate`` is the fastest the engine ever went on the measured runs (:func:`demonstrated_rate`): the smallest rate
  under which no local answer came before its fluid TTFT.

Any spill set that meets the SLO on the real engine (no faster than ``rate``) meets it on the relaxed one, so the
relaxed engine's cheapest spill set (:func:`bound_spill_nusd`, exact) costs no more than the true oracle's, and a
policy's spend over it is an upper bound on the policy's spend over the true oracle's. It is loose where the
relaxation drops what limits the engine: decoding (an output-heavy mix bounds at or near 0) and slots. What it
rests on: that the engine never prefilled faster than on the fastest stretch measured (sound for the runs
measured, an assumption for others), and that the provider meets the SLO for every spilled request (as the oracle
assumes).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmfleet.overflow.oracle import TracedRequest

__all__ = ["bound_spill_nusd", "demonstrated_rate", "fluid_ttfts_s"]


def fluid_ttfts_s(kept: Sequence[TracedRequest], rate: float) -> list[float]:
    """Each request's TTFT on the relaxed engine (module docstring), ``kept`` in arrival order."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be > 0 tokens/s")
    out, backlog, prev = [], 0.0, None
    for r in kept:
        if prev is not None:
            backlog = max(0.0, backlog - rate * (r.arrival_s - prev))
        prev = r.arrival_s
        backlog += r.prompt_tokens
        out.append(backlog / rate)
    return out


def demonstrated_rate(rounds: Sequence[Sequence[tuple[TracedRequest, float]]]) -> float:
    """The smallest prefill rate (tokens/s) under which no measured local answer came before its fluid TTFT: the
    largest ``W(s..i) / (ttft_i + a_i - a_s)`` over each round's answers ``(request, ttft_s)`` (every request that
    reached the engine in that round, in any order; they are sorted by arrival). Raises ValueError without an
    answer."""
    best = 0.0
    for answers in rounds:
        got = sorted(answers, key=lambda x: x[0].arrival_s)
        for i, (ri, ttft) in enumerate(got):
            done = ri.arrival_s + ttft  # its first token: all of W(s..i) was prefilled by then
            work = 0
            for s in range(i, -1, -1):
                rs = got[s][0]
                work += rs.prompt_tokens
                span = done - rs.arrival_s
                if span > 0:
                    best = max(best, work / span)
    if best <= 0:
        raise ValueError("no local answer with a prompt to measure the prefill rate on")
    return best


def bound_spill_nusd(trace: Sequence[TracedRequest], rate: float, slo_s: float, cost_nusd: Sequence[int]) -> int:
    """The cheapest spend (nano-dollars) that meets the SLO for every kept request of ``trace`` on the relaxed
    engine (module docstring): exact, over the Pareto front of (fluid backlog, spend) after each request in
    arrival order -- keeping a request adds its prompt to the backlog and is allowed while the backlog stays within
    ``rate * slo_s``; spilling it adds its cost."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be > 0 tokens/s")
    cap = rate * slo_s
    front: list[tuple[float, int]] = [(0.0, 0)]  # (backlog, spend): backlog ascending, spend strictly descending
    prev = None
    for i in sorted(range(len(trace)), key=lambda k: (trace[k].arrival_s, k)):
        r = trace[i]
        drain = 0.0 if prev is None else rate * (r.arrival_s - prev)
        prev = r.arrival_s
        drained = [(max(0.0, b - drain), c) for b, c in front]
        options = [(b + r.prompt_tokens, c) for b, c in drained if b + r.prompt_tokens <= cap]
        options += [(b, c + cost_nusd[i]) for b, c in drained]
        front = _pareto(options)
    return min(c for _, c in front)


def _pareto(states: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The states no other beats on both backlog and spend."""
    out: list[tuple[float, int]] = []
    for b, c in sorted(states):
        if not out or c < out[-1][1]:
            out.append((b, c))
    return out

"""The oracle on tiny traces whose cheapest spill set is known by hand, the serial-prefill model, the greedy against
the exact search, and the least-squares fit."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from lmfleet.bench.trace import TraceSpec, bursty_trace
from lmfleet.config.models import ProviderPrice
from lmfleet.overflow.oracle import (
    EXACT_LIMIT,
    LocalServiceModel,
    OracleResult,
    ServiceSample,
    exact_spill,
    kept_ttfts_s,
    oracle_spill,
    spill_cost_nusd,
)

# 1 ms per prompt token, 10 ms per output token; one request at a time.
ONE_SLOT = LocalServiceModel(slots=1, prefill_base_s=0.0, prefill_s_per_token=0.001, decode_s_per_token=0.01)
TWO_SLOTS = LocalServiceModel(slots=2, prefill_base_s=0.0, prefill_s_per_token=0.001, decode_s_per_token=0.01)
PRICE = ProviderPrice(input_per_1m=1000.0, output_per_1m=1000.0)  # 1e6 nano-dollars per token
SLO_MS = 500.0


@dataclass(frozen=True)
class Req:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@pytest.mark.parametrize("model, trace, spilled", [
    # alone and quick: kept
    (ONE_SLOT, [Req(0.0, 100, 10)], ()),
    # its prefill alone (1 s) is past the SLO: spilled
    (ONE_SLOT, [Req(0.0, 1000, 10)], (0,)),
    # B waits behind A (TTFT 1.19 s): B is the cheaper one to spill (110 tokens against 200)
    (ONE_SLOT, [Req(0.0, 100, 100), Req(0.01, 100, 10)], (1,)),
    # A (110 tokens) holds the slot for 1.01 s; B (220 tokens) would wait: spilling A is cheaper
    (ONE_SLOT, [Req(0.0, 10, 100), Req(0.01, 200, 20)], (0,)),
    # two slots: B's prompt waits for A's (TTFT 0.2 s), C waits for A's slot (0.2 s) and still makes it
    (TWO_SLOTS, [Req(0.0, 100, 10), Req(0.0, 100, 100), Req(0.05, 100, 10)], ()),
    # two slots, two long prompts at once: the second's prefill queues behind the first's (TTFT 0.6 s), so the
    # cheaper one is spilled though a slot is free for it
    (TWO_SLOTS, [Req(0.0, 300, 10), Req(0.0, 300, 5)], (1,)),
    # two slots, both busy for 1.1 s: the third one is the cheapest to spill
    (TWO_SLOTS, [Req(0.0, 100, 100), Req(0.0, 100, 100), Req(0.05, 100, 10)], (2,)),
    # an idle gap between requests: nobody waits
    (ONE_SLOT, [Req(0.0, 100, 100), Req(2.0, 100, 100), Req(4.0, 100, 100)], ()),
])
def test_hand_traces(model, trace, spilled):
    spend = sum(spill_cost_nusd(trace[i], PRICE) for i in spilled)
    assert oracle_spill(trace, model, SLO_MS, PRICE) == OracleResult(spilled, spend, exact=False)
    assert exact_spill(trace, model, SLO_MS, PRICE) == OracleResult(spilled, spend, exact=True)


def test_one_dear_spill_that_saves_two_cheap_ones_is_found():
    # A (150 tokens, 1.05 s of slot) delays B and C (100 tokens each). Deciding at B without seeing C spills B,
    # then C (200); the swap pass then finds that spilling A alone (150) lets both through.
    trace = [Req(0.0, 50, 100), Req(0.1, 90, 10), Req(0.2, 90, 10)]
    assert exact_spill(trace, ONE_SLOT, SLO_MS, PRICE).spilled == (0,)
    assert oracle_spill(trace, ONE_SLOT, SLO_MS, PRICE) == OracleResult((0,), 150 * 10**6, exact=False)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_is_feasible_and_never_below_the_exact_minimum(seed):
    rng = random.Random(seed)
    model = LocalServiceModel(slots=rng.choice([1, 2, 3]), prefill_base_s=0.02, prefill_s_per_token=0.0005,
                              decode_s_per_token=0.01)
    t, trace = 0.0, []
    for _ in range(rng.randint(1, 10)):
        t += rng.expovariate(4.0)
        trace.append(Req(t, rng.choice([50, 200, 800]), rng.choice([5, 40, 120])))
    greedy = oracle_spill(trace, model, SLO_MS, PRICE)
    exact = exact_spill(trace, model, SLO_MS, PRICE)
    kept = [i for i in range(len(trace)) if i not in greedy.spilled]
    assert all(x <= SLO_MS / 1000 for x in kept_ttfts_s(trace, kept, model))
    assert greedy.spend_nusd >= exact.spend_nusd


def test_exact_refuses_long_traces():
    with pytest.raises(ValueError, match="use oracle_spill"):
        exact_spill([Req(float(i), 1, 1) for i in range(EXACT_LIMIT + 1)], ONE_SLOT, SLO_MS, PRICE)


def test_the_benchmarks_trace_is_feasible_and_the_swap_pass_pays():
    # five minutes of the benchmark's bursty trace (~600 requests) on an 8-slot replica of ~3 requests/s
    trace = bursty_trace(TraceSpec(capacity_rps=3.0, duration_s=300.0), seed=1)
    model = LocalServiceModel(slots=8, prefill_base_s=0.05, prefill_s_per_token=0.0004, decode_s_per_token=0.03)
    got = oracle_spill(trace, model, 2500.0, PRICE)
    kept = [i for i in range(len(trace)) if i not in got.spilled]
    assert 0 < len(got.spilled) < len(trace)
    assert max(kept_ttfts_s(trace, kept, model)) <= 2.5
    assert got.spend_nusd < oracle_spill(trace, model, 2500.0, PRICE, swap_pass=False).spend_nusd


@pytest.mark.parametrize("model, trace, ttfts", [
    # three slots, three prompts at once: they prefill one after another (0.1 s each), and each first token comes
    # the base (0.2 s) after its own prompt is done -- the base holds up no other prompt
    (LocalServiceModel(3, 0.2, 0.001, 0.01), [Req(0.0, 100, 10)] * 3, [0.3, 0.4, 0.5]),
    # two slots: C (at 0.05 s) waits for A's slot (free at 0.4 s), then its own 50 tokens and the base
    (LocalServiceModel(2, 0.2, 0.001, 0.01), [Req(0.0, 100, 10), Req(0.0, 100, 10), Req(0.05, 50, 10)],
     [0.3, 0.4, 0.6]),
    # one slot: the slot, not the prefill, holds B back (A's slot frees at 0.1 + 0.05 + 10 * 0.01 = 0.25 s)
    (LocalServiceModel(1, 0.05, 0.001, 0.01), [Req(0.0, 100, 10), Req(0.1, 100, 10)], [0.15, 0.3]),
    # the prefill idle again by the time the next one comes: no wait
    (LocalServiceModel(2, 0.0, 0.001, 0.5), [Req(0.0, 100, 10), Req(0.2, 100, 10)], [0.1, 0.1]),
])
def test_kept_ttfts_by_hand(model, trace, ttfts):
    assert kept_ttfts_s(trace, range(len(trace)), model) == pytest.approx(ttfts)


@pytest.mark.parametrize("seed", range(10))
def test_removing_a_request_never_delays_another(seed):
    # the search's premise (module docstring): every slot and the prefill free no later without it
    rng = random.Random(seed)
    model = LocalServiceModel(slots=rng.choice([1, 2, 4]), prefill_base_s=rng.choice([0.0, 0.1]),
                              prefill_s_per_token=0.001, decode_s_per_token=0.01)
    t, trace = 0.0, []
    for _ in range(30):
        t += rng.expovariate(5.0)
        trace.append(Req(t, rng.choice([20, 200, 800]), rng.choice([5, 40, 120])))
    every = kept_ttfts_s(trace, range(len(trace)), model)
    gone = rng.randrange(len(trace))
    less = kept_ttfts_s(trace, [i for i in range(len(trace)) if i != gone], model)
    assert all(x <= y + 1e-12 for x, y in zip(less, every[:gone] + every[gone + 1:]))


def test_fit_from_a_local_only_run():
    # prefill 0.05 s + 1 ms/token; 20 ms per output token after the first; queued requests' TTFTs are ignored
    samples = [
        ServiceSample(100, 11, ttft_s=0.15, e2e_s=0.15 + 10 * 0.02, queued=False),
        ServiceSample(300, 21, ttft_s=0.35, e2e_s=0.35 + 20 * 0.02, queued=False),
        ServiceSample(200, 1, ttft_s=9.0, e2e_s=9.0, queued=True),
    ]
    m = LocalServiceModel.fit(samples, slots=4)
    assert m.slots == 4
    assert m.prefill_base_s == pytest.approx(0.05)
    assert m.prefill_s_per_token == pytest.approx(0.001)
    assert m.decode_s_per_token == pytest.approx(0.02)
    # the decode rate from other samples (the local only run's load) when given
    slow = [ServiceSample(100, 11, ttft_s=5.0, e2e_s=5.0 + 10 * 0.2, queued=True)]
    m2 = LocalServiceModel.fit(samples, slots=4, decode_samples=slow)
    assert (m2.prefill_base_s, m2.prefill_s_per_token) == (m.prefill_base_s, m.prefill_s_per_token)
    assert m2.decode_s_per_token == pytest.approx(0.2)


@pytest.mark.parametrize("samples, words", [
    ([ServiceSample(100, 5, 0.1, 0.2, False)], "two prompt lengths"),
    ([ServiceSample(100, 1, 0.1, 0.1, False), ServiceSample(200, 1, 0.2, 0.2, False)], "more than one output"),
])
def test_fit_says_what_it_needs(samples, words):
    with pytest.raises(ValueError, match=words):
        LocalServiceModel.fit(samples, slots=1)


def test_model_checks():
    with pytest.raises(ValueError, match="slots=0"):
        LocalServiceModel(0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="decode_s_per_token=-1"):
        LocalServiceModel(1, 0.0, 0.0, -1.0)


def test_fit_is_not_pulled_by_a_slowed_answer():
    # four answers on the line 0.05 s + 1 ms/token, and a short prompt slowed by 2 s (a burst's prompts joined its
    # engine step): least squares would flatten the slope and lift the base; least absolute deviations does not
    on_line = [ServiceSample(n, 11, ttft_s=0.05 + n * 0.001, e2e_s=0.25 + n * 0.001, queued=False)
               for n in (100, 300, 500, 700)]
    slowed = ServiceSample(120, 11, ttft_s=2.2, e2e_s=2.4, queued=False)
    m = LocalServiceModel.fit([*on_line, slowed], slots=4)
    assert m.prefill_s_per_token == pytest.approx(0.001, rel=0.01)
    assert m.prefill_base_s == pytest.approx(0.05, abs=0.005)

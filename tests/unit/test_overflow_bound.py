"""The lower bound on the oracle's spend (lmfleet.overflow.bound): the relaxed engine's TTFTs, the demonstrated
prefill rate, and the cheapest spill set (exact, against every subset; never above the oracle's on the oracle's own
model)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from lmfleet.config.models import ProviderPrice
from lmfleet.overflow.bound import bound_spill_nusd, demonstrated_rate, fluid_ttfts_s
from lmfleet.overflow.oracle import LocalServiceModel, exact_spill, spill_cost_nusd


@dataclass(frozen=True)
class R:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 10


@pytest.mark.parametrize("kept,rate,want", [
    ([R(0, 100)], 100, [1.0]),                               # alone: its prompt at the rate
    ([R(0, 100), R(0, 100)], 100, [1.0, 2.0]),               # together: the second waits for the first
    ([R(0, 100), R(0.5, 100)], 100, [1.0, 1.5]),             # half the first was done when the second came
    ([R(0, 100), R(2, 100)], 100, [1.0, 1.0]),               # the engine was idle again
    ([R(0, 300), R(1, 0), R(1, 100)], 100, [3.0, 2.0, 3.0]),  # an empty prompt waits for the backlog
])
def test_fluid_ttfts(kept, rate, want):
    assert fluid_ttfts_s(kept, rate) == pytest.approx(want)


@pytest.mark.parametrize("rounds,want", [
    ([[(R(0, 100), 1.0)]], 100),                              # one answer: its prompt over its TTFT
    ([[(R(0, 100), 1.0), (R(0, 100), 1.5)]], 200 / 1.5),     # both prompts by the second's first token
    ([[(R(1, 100), 0.5)], [(R(0, 100), 2.0)]], 200),          # the fastest round counts
    ([[(R(0.5, 100), 1.0), (R(0, 100), 1.0)]], 200 / 1.5),   # any order: sorted by arrival
])
def test_demonstrated_rate(rounds, want):
    assert demonstrated_rate(rounds) == pytest.approx(want)


def test_no_measured_answer_is_an_error():
    with pytest.raises(ValueError, match="no local answer"):
        demonstrated_rate([[]])
    with pytest.raises(ValueError, match="rate"):
        fluid_ttfts_s([R(0, 1)], 0)


def test_no_answer_comes_before_its_fluid_ttft_at_the_demonstrated_rate():
    rnd = random.Random(3)
    answers = [(R(rnd.uniform(0, 10), rnd.randint(1, 500)), rnd.uniform(0.2, 3)) for _ in range(30)]
    rate = demonstrated_rate([answers])
    got = sorted(answers, key=lambda a: a[0].arrival_s)
    fluid = fluid_ttfts_s([r for r, _ in got], rate)
    assert all(ttft >= f - 1e-9 for (_, ttft), f in zip(got, fluid))
    assert any(ttft == pytest.approx(f) for (_, ttft), f in zip(got, fluid))  # and one is tight: the smallest rate


@pytest.mark.parametrize("trace,cost,want", [
    ([R(0, 100), R(0, 100)], [5, 7], 0),          # both fit: 2 s of prefill within 2.5 s
    ([R(0, 200), R(0, 100)], [9, 7], 7),          # 3 s: spill one, the later one (the one that misses)...
    ([R(0, 200), R(0, 100)], [5, 7], 5),          # ...or the earlier, when it is cheaper
    ([R(0, 300), R(0, 10)], [1, 1], 1),           # alone over the SLO: spilled whatever it costs
    ([R(0, 200), R(1, 100), R(2, 100)], [4, 3, 3], 0),  # drained in between: all fit
])
def test_cheapest_spill_on_the_relaxed_engine(trace, cost, want):
    assert bound_spill_nusd(trace, 100, 2.5, cost) == want


def _brute(trace, rate, slo_s, cost) -> int:
    best = sum(cost)
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, i))
    for k in range(len(trace) + 1):
        for spill in itertools.combinations(range(len(trace)), k):
            kept = [trace[i] for i in order if i not in spill]
            if all(t <= slo_s for t in fluid_ttfts_s(kept, rate)):
                best = min(best, sum(cost[i] for i in spill))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_the_front_finds_the_cheapest_of_every_subset(seed):
    rnd = random.Random(seed)
    n = rnd.randint(1, 10)
    trace = [R(round(rnd.uniform(0, 6), 2), rnd.randint(10, 400)) for _ in range(n)]
    cost = [rnd.randint(1, 100) for _ in range(n)]
    assert bound_spill_nusd(trace, 150, 2.0, cost) == _brute(trace, 150, 2.0, cost)


@pytest.mark.parametrize("seed", range(15))
def test_never_above_the_oracle_on_the_oracles_own_model(seed):
    """The oracle's model prefills at 1 / prefill_s_per_token with more in the way (slots, base, decode): on it the
    relaxed engine at that rate is a lower bound, and so is its cheapest spend."""
    rnd = random.Random(100 + seed)
    n = rnd.randint(2, 9)
    trace = [R(round(rnd.uniform(0, 5), 2), rnd.randint(20, 800), rnd.randint(1, 60)) for _ in range(n)]
    model = LocalServiceModel(slots=rnd.randint(1, 3), prefill_base_s=rnd.uniform(0, 0.3),
                              prefill_s_per_token=0.002, decode_s_per_token=0.02)
    price = ProviderPrice(input_per_1m=0.5, output_per_1m=1.5)
    cost = [spill_cost_nusd(r, price) for r in trace]
    assert bound_spill_nusd(trace, 1 / 0.002, 2.0, cost) <= exact_spill(trace, model, 2000, price).spend_nusd

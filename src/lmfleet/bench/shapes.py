"""Synthetic load shapes beside the gamma bursts of :func:`lmfleet.bench.trace.bursty_trace`.

Each shape is a pure generator of (capacity, duration, seed): the same arguments give the same trace. Rates are
multiples of the local capacity (requests/s measured on the shape's own mix), so that one shape means the same
pressure on any engine:

- ``gamma``: :func:`~lmfleet.bench.trace.bursty_trace` (bursts of 3.5x capacity over a mean of 0.7x, gamma gaps);
- ``onoff``: square bursts: ``on_load`` x capacity for ``on_s`` seconds, then ``off_load`` for the rest of each
  ``period_s``; Poisson arrivals within;
- ``ramp``: a slow ramp from ``start_load`` to ``end_load`` x capacity over the whole duration;
- ``prefill``: steady Poisson arrivals at ``mean_load`` x capacity, most of them long prompts with short answers;
- ``output``: the same, short prompts with long answers (decode-bound).

Arrivals come from the rate by the same construction as the gamma trace: gaps of unit mean in "rate time"
(the integral of the rate), mapped back to seconds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from lmfleet.bench.mix import BenchInputError
from lmfleet.bench.trace import TraceRequest, TraceSpec, bursty_trace

__all__ = ["SHAPES", "Mix", "Shape", "arrivals", "onoff_trace", "output_trace", "prefill_trace", "ramp_trace",
           "shape_trace"]

SHAPES = ("gamma", "onoff", "ramp", "prefill", "output")


@dataclass(frozen=True)
class Mix:
    """Requests of a shape: with probability ``long_share`` a long prompt, else a chat; token counts uniform."""

    long_share: float = 0.2
    chat_prompt: tuple[int, int] = (20, 200)
    chat_output: tuple[int, int] = (16, 128)
    long_prompt: tuple[int, int] = (1000, 3000)
    long_output: tuple[int, int] = (16, 64)

    def sample(self, rng: random.Random) -> tuple[int, int, str]:
        if rng.random() < self.long_share:
            return rng.randint(*self.long_prompt), rng.randint(*self.long_output), "long"
        return rng.randint(*self.chat_prompt), rng.randint(*self.chat_output), "chat"


DEFAULT_MIX = Mix()
PREFILL_MIX = Mix(long_share=0.7, long_prompt=(1500, 3000), long_output=(4, 16))
OUTPUT_MIX = Mix(long_share=0.0, chat_prompt=(20, 120), chat_output=(200, 500))


def arrivals(load_at: Callable[[float], float], capacity_rps: float, duration_s: float, rng: random.Random,
             burstiness: float = 1.0, step_s: float = 0.01) -> list[float]:
    """Arrival times in [0, duration_s) at ``load_at(t)`` x capacity: gamma gaps of shape ``burstiness`` (1:
    Poisson) and unit mean in rate time, placed by integrating the rate in steps of ``step_s``."""
    if not capacity_rps > 0 or not duration_s > 0:
        raise BenchInputError(f"need capacity_rps={capacity_rps} > 0 and duration_s={duration_s} > 0")
    out: list[float] = []
    target = rng.gammavariate(burstiness, 1.0 / burstiness)
    units = 0.0
    k = 0
    while (t := k * step_s) < duration_s:
        rate = max(0.0, load_at(t)) * capacity_rps
        left = step_s  # of this step, after the arrivals placed in it
        while rate > 0 and units + rate * left >= target:
            dt = (target - units) / rate
            t, left = t + dt, left - dt
            if t >= duration_s:
                return out
            out.append(t)
            units, target = 0.0, rng.gammavariate(burstiness, 1.0 / burstiness)
        units += rate * left
        k += 1
    return out


def _trace(times: list[float], mix: Mix, rng: random.Random) -> list[TraceRequest]:
    out = []
    for i, t in enumerate(times):
        prompt, output, kind = mix.sample(rng)
        out.append(TraceRequest(i, t, prompt, output, kind))
    return out


def onoff_trace(capacity_rps: float, duration_s: float, seed: int, *, on_load: float = 2.5, off_load: float = 0.2,
                on_s: float = 10.0, period_s: float = 40.0, mix: Mix = DEFAULT_MIX) -> list[TraceRequest]:
    """Square bursts (module docstring)."""
    if not 0 < on_s < period_s:
        raise BenchInputError(f"on/off shape: need 0 < on_s={on_s} < period_s={period_s}")
    rng = random.Random(seed)
    times = arrivals(lambda t: on_load if t % period_s < on_s else off_load, capacity_rps, duration_s, rng)
    return _trace(times, mix, rng)


def ramp_trace(capacity_rps: float, duration_s: float, seed: int, *, start_load: float = 0.3,
               end_load: float = 1.8, mix: Mix = DEFAULT_MIX) -> list[TraceRequest]:
    """A linear ramp of the rate (module docstring)."""
    rng = random.Random(seed)
    times = arrivals(lambda t: start_load + (end_load - start_load) * t / duration_s, capacity_rps, duration_s, rng)
    return _trace(times, mix, rng)


def steady_trace(capacity_rps: float, duration_s: float, seed: int, mix: Mix,
                 mean_load: float = 0.9) -> list[TraceRequest]:
    rng = random.Random(seed)
    return _trace(arrivals(lambda _t: mean_load, capacity_rps, duration_s, rng), mix, rng)


def prefill_trace(capacity_rps: float, duration_s: float, seed: int, *, mean_load: float = 0.9) -> list[TraceRequest]:
    """Long prompts, short answers, at a steady rate (module docstring)."""
    return steady_trace(capacity_rps, duration_s, seed, PREFILL_MIX, mean_load)


def output_trace(capacity_rps: float, duration_s: float, seed: int, *, mean_load: float = 0.9) -> list[TraceRequest]:
    """Short prompts, long answers, at a steady rate (module docstring)."""
    return steady_trace(capacity_rps, duration_s, seed, OUTPUT_MIX, mean_load)


@dataclass(frozen=True)
class Shape:
    """A named shape at a capacity and duration, with the knobs every figure must name."""

    name: str
    capacity_rps: float
    duration_s: float
    params: dict

    def describe(self) -> str:
        knobs = ", ".join(f"{k} {v}" for k, v in self.params.items())
        return f"shape {self.name} ({knobs}), {self.duration_s:g} s at capacity {self.capacity_rps:.2f} req/s"


def shape_params(name: str, short: bool = False) -> dict:
    """Each shape's knobs; ``short`` (a smoke run of seconds): short bursts and periods, so that it sees some."""
    if name == "gamma":
        return dict(burst_s=2.0, burst_every_s=12.0, long_prompt=(200, 600)) if short else \
            dict(burst_s=8.0, burst_every_s=45.0)
    if name == "onoff":
        return dict(on_load=2.5, off_load=0.2, on_s=2.0 if short else 10.0, period_s=8.0 if short else 40.0)
    if name == "ramp":
        return dict(start_load=0.3, end_load=1.8)
    if name in ("prefill", "output"):
        return dict(mean_load=0.9)
    raise BenchInputError(f"shape {name!r}: expected one of {SHAPES}")


def shape_trace(name: str, capacity_rps: float, duration_s: float, seed: int,
                short: bool = False) -> tuple[list[TraceRequest], Shape]:
    """The named shape's trace and its description (``short``: :func:`shape_params`)."""
    params = shape_params(name, short)
    if name == "gamma":
        spec = TraceSpec(capacity_rps=capacity_rps, duration_s=duration_s, **params)
        trace = bursty_trace(spec, seed)
        params = dict(mean_load=spec.mean_load, burst_load=spec.burst_load, burstiness=spec.burstiness, **params)
    else:
        trace = {"onoff": onoff_trace, "ramp": ramp_trace, "prefill": prefill_trace,
                 "output": output_trace}[name](capacity_rps, duration_s, seed, **params)
        mix = {"prefill": PREFILL_MIX, "output": OUTPUT_MIX}.get(name, DEFAULT_MIX)
        params = dict(params, mix=asdict(mix))
    return trace, Shape(name, capacity_rps, duration_s, params)

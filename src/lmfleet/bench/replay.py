"""Replaying recorded traffic: read a trace, cut a window, fit its time and tokens to the engine under test.

The format is the Azure LLM inference trace's (a CSV with ``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``;
:data:`AZURE_ATTRIBUTION`); anyone's own traffic in those three columns replays the same way.

A replay is described by a :class:`ReplaySpec` (``azure:PATH[:OPTION=VALUE...]``, :func:`parse_replay`):

- the window: ``start`` seconds after the trace's first arrival, then ``duration`` seconds or ``requests``
  requests (the whole trace if neither);
- time: the window's arrivals are multiplied by one factor, so the burst shape is kept and only the pace changes.
  ``load=X`` picks the factor that makes the window's mean rate X times a measured capacity, ``rate=R`` one that
  makes it R requests/s, ``speed=S`` plays it S times faster than recorded; none: as recorded. The window's
  mean rate is its request count over its length (``duration``, else the span of its arrivals);
- tokens: both counts multiplied by ``tokens=F`` (1 by default), at least 1 each, and capped by the model's
  context: the output to ``max_model_len - 1``, then the prompt to what is left (long prompts are cut, the recorded
  outputs kept).

Everything here is pure; :func:`read_trace_file` is the one function that reads a file.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from lmfleet.bench.mix import BenchInputError
from lmfleet.bench.trace import TraceRequest

__all__ = ["AZURE_ATTRIBUTION", "Recorded", "Replay", "ReplaySpec", "cap_tokens", "parse_azure", "parse_replay",
           "read_trace_file", "replay", "time_factor", "window"]

AZURE_ATTRIBUTION = ("Azure LLM inference trace 2023 (Azure Public Dataset; Patel et al., \"Splitwise: Efficient "
                     "generative LLM inference using phase splitting\", ISCA 2024), CC-BY 4.0")
"""Credit owed wherever the Azure trace or figures derived from it are published."""

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class Recorded:
    """One recorded request: its arrival (seconds after the trace's first) and token counts."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ReplaySpec:
    """Which trace, which window, and the time and token factors (module docstring)."""

    path: Path
    start_s: float = 0.0
    duration_s: float | None = None
    requests: int | None = None
    load: float | None = None
    rate_rps: float | None = None
    speed: float | None = None
    tokens: float = 1.0

    def __post_init__(self) -> None:
        if self.start_s < 0:
            raise BenchInputError(f"trace start={self.start_s:g} must be >= 0 seconds")
        for name in ("duration_s", "requests", "load", "rate_rps", "speed"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise BenchInputError(f"trace {name}={value!r} must be > 0")
        if not self.tokens > 0:
            raise BenchInputError(f"trace tokens={self.tokens!r} must be > 0")
        paced = [n for n in ("load", "rate_rps", "speed") if getattr(self, n) is not None]
        if len(paced) > 1:
            raise BenchInputError(f"trace: give one of load=, rate=, speed= (got {', '.join(paced)})")


OPTIONS = {"start": ("start_s", float), "duration": ("duration_s", float), "requests": ("requests", int),
           "load": ("load", float), "rate": ("rate_rps", float), "speed": ("speed", float), "tokens": ("tokens", float)}


def parse_replay(text: str, default_path: Path | None = None) -> ReplaySpec:
    """``azure[:PATH][:start=S][:duration=D|:requests=N][:load=X|:rate=R|:speed=S][:tokens=F]``, e.g.
    ``azure:../shared/traces/AzureLLMInferenceTrace_code.csv:start=600:requests=250:load=1.3:tokens=0.25``;
    without a PATH, ``default_path``."""
    kind, _, rest = text.partition(":")
    if kind != "azure":
        raise BenchInputError(f"--trace {text!r}: expected azure[:PATH][:OPTION=VALUE...] with options "
                              f"{sorted(OPTIONS)} (a CSV with columns {', '.join(COLUMNS)})")
    parts = rest.split(":") if rest else []
    # the path ends at the first part that is an option (a path may hold ':' itself)
    first = next((i for i, p in enumerate(parts) if "=" in p and p.partition("=")[0] in OPTIONS), len(parts))
    path, values = ":".join(parts[:first]), {}
    for opt in parts[first:]:
        key, _, value = opt.partition("=")
        if key not in OPTIONS:
            raise BenchInputError(f"--trace option {opt!r}: expected one of {sorted(OPTIONS)}")
        field_name, cast = OPTIONS[key]
        try:
            values[field_name] = cast(value)
        except ValueError:
            what = "a whole number" if cast is int else "a number"
            raise BenchInputError(f"--trace option {opt!r}: {value!r} is not {what}") from None
    if not path and default_path is None:
        raise BenchInputError(f"--trace {text!r}: no file path (azure:PATH[:OPTION=VALUE...])")
    if "requests" in values and "duration_s" in values:
        raise BenchInputError(f"--trace {text!r}: give duration= or requests=, not both")
    return ReplaySpec(Path(path) if path else default_path, **values)


def _timestamp(text: str) -> tuple[datetime, float]:
    """The time to the second, and the fraction apart (the Azure trace has 7 digits; datetime takes 6)."""
    second, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(second), float(f"0.{frac}") if frac else 0.0


def parse_azure(text: str, source: str = "trace") -> list[Recorded]:
    """The trace's rows in arrival order, arrivals relative to the first."""
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or set(COLUMNS) - set(reader.fieldnames):
        raise BenchInputError(f"{source}: columns {reader.fieldnames}; expected {', '.join(COLUMNS)}")
    rows = []
    for line, row in enumerate(reader, start=2):
        try:
            rows.append((*_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
        except (TypeError, ValueError):
            raise BenchInputError(f"{source}:{line}: {row} is not TIMESTAMP, ContextTokens, GeneratedTokens") from None
    if not rows:
        raise BenchInputError(f"{source}: no requests")
    rows.sort()
    second0, frac0 = rows[0][:2]
    return [Recorded((second - second0).total_seconds() + frac - frac0, p, o) for second, frac, p, o in rows]


def read_trace_file(path: Path) -> list[Recorded]:
    if not path.is_file():
        raise BenchInputError(f"trace {path} does not exist (the Azure trace lives in ../shared/traces/ beside the "
                              "checkout)")
    return parse_azure(path.read_text(), str(path))


def window(trace: Sequence[Recorded], start_s: float = 0.0, duration_s: float | None = None,
           requests: int | None = None) -> tuple[list[Recorded], float]:
    """The requests from ``start_s`` on, for ``duration_s`` seconds or ``requests`` requests, arrivals relative to
    ``start_s``; and the window's length (``duration_s``, else the span from ``start_s`` to the last arrival)."""
    picked = [r for r in trace if r.arrival_s >= start_s and (duration_s is None or r.arrival_s < start_s + duration_s)]
    if requests is not None:
        picked = picked[:requests]
    if not picked:
        end = trace[-1].arrival_s if trace else 0.0
        raise BenchInputError(f"the trace window from {start_s:g} s holds no request (the trace ends at {end:.0f} s)")
    out = [Recorded(r.arrival_s - start_s, r.prompt_tokens, r.output_tokens) for r in picked]
    length = duration_s if duration_s is not None else out[-1].arrival_s
    return out, length


def time_factor(n: int, length_s: float, target_rps: float) -> float:
    """What to multiply arrival times by so that ``n`` requests over ``length_s`` seconds average ``target_rps``."""
    if n <= 0 or length_s <= 0 or target_rps <= 0:
        raise BenchInputError(f"cannot pace {n} requests over {length_s:g} s to {target_rps:g} req/s "
                              "(a window of one instant, or nothing to pace)")
    return n / (length_s * target_rps)


def cap_tokens(prompt: int, output: int, factor: float, max_model_len: int | None) -> tuple[int, int]:
    """Both counts times ``factor`` (at least 1 each), the output then the prompt capped by the context."""
    p, o = max(1, round(prompt * factor)), max(1, round(output * factor))
    if max_model_len:
        if max_model_len < 2:
            raise BenchInputError(f"{max_model_len=} leaves no room for one prompt and one output token")
        o = min(o, max_model_len - 1)
        p = min(p, max_model_len - o)
    return p, o


@dataclass(frozen=True)
class Replay:
    """A replay's requests and what was done to them (for every figure's header and JSON)."""

    requests: list[TraceRequest]
    trace: str
    start_s: float
    length_s: float
    recorded_requests: int
    recorded_rps: float
    time_factor: float
    mean_rps: float
    load: float | None
    capacity_rps: float | None
    token_factor: float
    max_model_len: int | None
    capped: int
    """Requests whose tokens the context cut."""
    pace: str
    """How the time factor was chosen."""
    attribution: str

    def header(self) -> dict:
        """Everything but the requests."""
        return {k: v for k, v in asdict(self).items() if k != "requests"}

    def describe(self) -> str:
        text = (f"trace {self.trace}, window {self.start_s:g}-{self.start_s + self.length_s:.1f} s "
                f"({len(self.requests)} of {self.recorded_requests} requests, {self.recorded_rps:.2f} req/s "
                f"recorded), time x {self.time_factor:.3g} (mean {self.mean_rps:.3g} req/s: {self.pace}), tokens x "
                f"{self.token_factor:g}")
        if self.max_model_len:
            text += f" capped at {self.max_model_len} (prompt + output; {self.capped} cut)"
        return text + (f"; {self.attribution}" if self.attribution else "")


def replay(spec: ReplaySpec, trace: Sequence[Recorded], *, capacity_rps: float | None = None,
           max_model_len: int | None = None) -> Replay:
    """The spec's window of ``trace``, paced and scaled (module docstring). ``load=`` needs ``capacity_rps``."""
    picked, length = window(trace, spec.start_s, spec.duration_s, spec.requests)
    n = len(picked)
    pace = "as recorded"
    if spec.load is not None:
        pace = f"{spec.load:g} x capacity {capacity_rps or 0:.3g} req/s"
        if not capacity_rps:
            raise BenchInputError("trace load= is a multiple of the measured capacity; none was measured "
                                  "(use rate= or speed=)")
        factor = time_factor(n, length, spec.load * capacity_rps)
    elif spec.rate_rps is not None:
        factor, pace = time_factor(n, length, spec.rate_rps), f"rate {spec.rate_rps:g} req/s asked"
    elif spec.speed:
        factor, pace = 1.0 / spec.speed, f"played {spec.speed:g}x as fast as recorded"
    else:
        factor = 1.0
    out, capped = [], 0
    for i, r in enumerate(picked):
        p, o = cap_tokens(r.prompt_tokens, r.output_tokens, spec.tokens, max_model_len)
        capped += (p, o) != cap_tokens(r.prompt_tokens, r.output_tokens, spec.tokens, None)
        out.append(TraceRequest(i, r.arrival_s * factor, p, o, "trace"))
    name = spec.path.name
    return Replay(out, name, spec.start_s, length, len(trace), n / length if length else float("nan"), factor,
                  n / (length * factor) if length else float("nan"), spec.load, capacity_rps, spec.tokens,
                  max_model_len, capped, pace, AZURE_ATTRIBUTION if name.startswith("AzureLLMInferenceTrace") else "")

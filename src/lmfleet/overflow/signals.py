"""Per-model load signals measured at the gateway: in-flight count, drain rate, recent TTFT.

The gateway owns one :class:`LoadTracker` per local model and reports each locally served
request to it (overflowed requests are not reported: they do not load the local engine)::

    ticket = tracker.on_start(prompt_tokens)
    ...                                   # first streamed token arrives
    tracker.on_first_token(ticket)        # streamed requests only: a non-streamed answer's
                                          # latency is not a TTFT and would inflate base_ttft
    ...
    tracker.on_finish(ticket, output_tokens, ok=True)
    signals = tracker.snapshot()          # -> QueueSignals, fed to estimate_wait_ms()

Every method takes an optional ``now`` (seconds, the same clock as the tracker's ``clock``,
``time.monotonic`` by default) so tests drive time by hand.

How the figures are measured
----------------------------
* **Drain rate** (completions/s, output tokens/s): completions in the trailing window divided by
  the *busy* time in that window (time with at least one local request in flight). Dividing by
  busy time, not wall time, keeps an idle spell from making the engine look slow; while the
  engine is saturated (the only time the rate matters, see the estimator) busy time is wall time.
  With fewer than ``min_completions`` (:data:`MIN_COMPLETIONS`) completions in the window the rate is unknown
  (``None``); the window's completions and busy seconds are reported all the same (``completions_in_window``,
  ``busy_s``), and the estimator weighs them against its cold-start prior.
* **Recent TTFT**: median of the most recent ``ttft_samples`` (256) TTFT samples of the trailing
  window -- of all of them while the window holds no more than that.
* **Prefill line** (the TTFT of a request that does not queue, by its prefill work): the requests that found a
  free slot when they started (their position, in-flight count including themselves and the other gateways' last
  reported in-flight, was <= ``capacity``) give samples of their TTFT against the prefill work they waited for
  (their own prompt plus the work ahead of them, below). Over the last ``prefill_samples`` (64) such samples of the
  last ``prefill_ttl_s`` (600 s), :func:`prefill_line` fits ``ttft = base_ttft + k x (work - base_work)`` by
  least absolute deviations (a median regression, not least squares: the few samples slowed by other work, a
  burst's decoding, do not move it), with ``base_work`` the samples' median work: ``base_ttft_s`` is the line's
  TTFT there, ``prefill_s_per_token`` its slope ``k``. Until at least ``PREFILL_MIN_PAIRS`` pairs of samples lie
  ``PREFILL_MIN_SPREAD`` tokens apart there is no slope (None) and ``base_ttft_s`` is the samples' median TTFT; a
  negative slope is clamped at 0 (the same median). With no sample left, the estimator's cold default
  (``cold_ttft_s``). The fit is recomputed at most once a second. Fitting intercept and slope together, over
  minutes, keeps an idle engine from being predicted at a burst's slow TTFTs: those samples waited for the
  burst's prompts, which the line puts into its slope, and a request on the idle engine waits for its own. One
  guard remains: while nothing is in flight and the newest sample is older than ``idle_reset_s`` (60 s),
  ``prefill_stale`` is set (:func:`line_is_stale`), and the estimator predicts the prefill at most at its cold
  default plus the slope's cost of the work. Samples slowed by something the line does not see would otherwise
  hold an idle engine over the threshold: every request would overflow, and none would come back to measure it
  again.
* **The gate's service line** (``overflow.prefill_gate`` on): a prompt through the gate is alone at the engine
  before its first token, so the time from passing the gate (:meth:`LoadTracker.on_gate_enter`) to its first token
  is its own service: its prefill plus about one engine step and a round trip. Over the last ``prefill_samples``
  gated prompts of the last ``prefill_ttl_s`` that started with a free slot, :func:`prefill_line` fits that time
  against the prompt's tokens (``gate_base_s`` at ``gate_base_tokens``, slope ``gate_s_per_token``); from
  :data:`GATE_MIN_SAMPLES` samples on. ``gate_queue`` lists the prompts waiting in the gate or through it without
  a first token (:meth:`LoadTracker.on_gate_wait`), so the estimator can price each prompt ahead of a gated
  request on that line: a prompt held in the gateway costs a whole step of its own, which a line through TTFTs by
  tokens ahead puts only into its slope.
* **Prefill work ahead** (tokens): the prompt tokens of the local streamed requests in flight that have not had a
  first token yet (``pending_prefill_tokens``; a non-streamed request reports no first token and is left out):
  vLLM prefills them before a newer request's prompt (first come, first served, in chunks), so they delay its
  first token even when a slot is free -- early in a burst, and behind a long prompt.
* **Engine stats** (optional): vLLM's ``num_requests_running`` / ``num_requests_waiting`` as last
  set by :meth:`LoadTracker.set_engine_stats`; reported only while younger than ``engine_stats_ttl_s``.
* **Other gateways** (optional, several gateway processes or nodes): their in-flight requests to
  this model and their drain rates, as last set by :meth:`LoadTracker.set_peer_load`, are added to
  this gateway's own (same ``engine_stats_ttl_s``), so every gateway estimates the queue they all
  feed and N gateways overflow at the point one would.

Cost per request
----------------
Every call runs on the gateway's event loop once per request, so none of them walks the window:
the completion count, token sum and busy time are running totals, updated when a sample enters
and when it expires (each sample expires once: amortised O(1)); the recent TTFT is read by index
from a sorted list of at most ``ttft_samples`` values, kept beside the samples in arrival order (an
insert or a removal is a binary search plus a memmove of at most that many floats); the prefill line
is refitted at most once a second over at most ``prefill_samples`` samples (about a millisecond at 64).
Cost per call is therefore independent of the request rate.

The one approximation is the recent TTFT above ``ttft_samples`` samples per window (above ~8.5
requests/s with the default 30 s window and 256 samples): it is then the exact median of the last
256 samples, a shorter trailing window of 256 / rate seconds, not of the whole window. For a
steady TTFT distribution the rank error of a median of n samples has a standard deviation of
1 / (2 sqrt(n)): with n = 256 the value reported lies within +-3.1 percentiles of the window's
true median about two times in three, and within +-6.25 percentiles 95 % of the time. Under
changing load it follows the newest samples, which is the figure an operator wants. The recent
TTFT is reported (``/admin/state``, ``lmfleet status``), not used by the queue estimate. Below
256 samples per window every figure is exact.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lmfleet.overflow.prefill_fit import PREFILL_MIN_PAIRS, PREFILL_MIN_SPREAD, PrefillLine, prefill_line, prefill_slope

__all__ = ["GATE_MIN_SAMPLES", "MIN_COMPLETIONS", "PREFILL_MIN_PAIRS", "PREFILL_MIN_SPREAD", "PREFILL_SAMPLES",
           "PREFILL_TTL_S", "LoadTracker", "PrefillLine", "QueueSignals", "Ticket", "line_is_stale", "prefill_line",
           "prefill_slope"]

MIN_COMPLETIONS = 3
"""Completions the window must hold before the measured drain rate is reported, by default."""
PREFILL_SAMPLES = 64
"""Unqueued requests the prefill line is fitted over (the most recent), by default."""
PREFILL_TTL_S = 600.0
"""Seconds a prefill sample counts, by default."""
GATE_MIN_SAMPLES = 8
"""Gated prompts the gate's service line needs before it counts (fewer: the prefill line alone)."""
IDLE_RESET_S = 60.0
"""Seconds after its newest sample that an idle engine's prefill line is stale, by default (:func:`line_is_stale`)."""


@dataclass(frozen=True)
class QueueSignals:
    """One model's load at one instant (see the module docstring for how each figure is measured)."""

    now: float
    in_flight: int
    """Local requests started and not finished (queued at Ray Serve / vLLM, or running)."""
    drain_rps: float | None
    """Completions per busy second over the window; None until ``min_completions`` were seen."""
    output_tps: float | None
    """Output tokens per busy second over the window; None when ``drain_rps`` is None."""
    ttft_s: float | None
    """Median TTFT of the window's last ``ttft_samples`` samples (includes queueing); None without samples."""
    base_ttft_s: float | None
    """TTFT of a request that does not queue, with ``base_prefill_tokens`` of prefill work (the prefill line's
    value there); None without samples."""
    completions_in_window: int
    engine_running: int | None = None
    engine_waiting: int | None = None
    pending_prefill_tokens: int = 0
    """Prompt tokens of the local streamed requests in flight that have not had a first token yet."""
    prefill_s_per_token: float | None = None
    """Seconds of TTFT per token of prefill work (prompt + work ahead): the prefill line's slope; None: unmeasured."""
    base_prefill_tokens: float | None = None
    """Median prefill work (prompt + work ahead) of the prefill line's samples; None without samples."""
    prefill_stale: bool = False
    """Nothing in flight and the prefill line's newest sample older than ``idle_reset_s`` (:func:`line_is_stale`)."""
    busy_s: float = 0.0
    """Seconds of the window with a local request of this gateway in flight (the drain rate's denominator)."""
    gate_queue: tuple[tuple[int, float | None], ...] = ()
    """The prompts in ``overflow.prefill_gate`` without a first token yet, in arrival order: ``(prompt tokens,
    seconds since it passed the gate)``, None while it waits in the gateway."""
    gate_base_s: float | None = None
    """The gate's service line (module docstring): a gated prompt's time from passing the gate to its first token,
    at ``gate_base_tokens`` prompt tokens; None without enough samples (:data:`GATE_MIN_SAMPLES`)."""
    gate_base_tokens: float | None = None
    gate_s_per_token: float | None = None
    """The gate's service line's slope (seconds per prompt token); None: unmeasured."""

    @property
    def line_measured(self) -> bool:
        """The prefill line has a base TTFT and a slope from this engine's requests and is not stale."""
        return self.base_ttft_s is not None and self.prefill_s_per_token is not None and not self.prefill_stale


@dataclass(frozen=True)
class Ticket:
    """Handle for one local request, returned by :meth:`LoadTracker.on_start`."""

    started_at: float
    position: int
    """In-flight count at start, this request and the other gateways' included (1 = the engine was idle)."""
    prompt_tokens: int
    pending_ahead: int = 0
    """Prompt tokens of the local requests in flight without a first token when it started (prefill work ahead)."""


def line_is_stale(newest_at: float | None, now: float, in_flight: int, idle_reset_s: float = IDLE_RESET_S) -> bool:
    """Whether the prefill line is stale (module docstring): nothing in flight and the newest sample
    (``newest_at``; None: none) older than ``idle_reset_s``. Pure."""
    return in_flight == 0 and newest_at is not None and now - newest_at > idle_reset_s


class _RecentMedian:
    """Exact median of the last ``maxlen`` values added, optionally only those observed after a horizon."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._arrivals: deque[tuple[float, float]] = deque()  # (observed_at, value), oldest first
        self._sorted: list[float] = []

    def add(self, observed_at: float, value: float) -> None:
        if self.maxlen < 1 or value != value:  # NaN has no place in a sorted list
            return
        if len(self._arrivals) >= self.maxlen:
            self._drop_oldest()
        self._arrivals.append((observed_at, value))
        insort(self._sorted, value)

    def expire(self, horizon: float) -> None:
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._drop_oldest()

    def median(self) -> float | None:
        s = self._sorted
        n = len(s)
        if n == 0:
            return None
        mid = n // 2
        return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2

    def __len__(self) -> int:
        return len(self._arrivals)

    def _drop_oldest(self) -> None:
        _, value = self._arrivals.popleft()
        del self._sorted[bisect_left(self._sorted, value)]


class _RollingLine:
    """:func:`prefill_line` over the last ``maxlen`` ``(x, y)`` samples of the last ``ttl_s`` seconds, refitted at
    most once a second; None with fewer than ``min_samples``."""

    def __init__(self, maxlen: int, ttl_s: float, min_samples: int = 1) -> None:
        self.ttl_s = ttl_s
        self.min_samples = max(1, min_samples)
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=max(1, maxlen))  # (at, x, y)
        self._line: PrefillLine | None = None
        self._at = float("-inf")  # when the line was last fitted
        self._dirty = False

    @property
    def newest_at(self) -> float | None:
        return self._samples[-1][0] if self._samples else None

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, at: float, x: float, y: float) -> None:
        self._samples.append((at, x, y))
        self._dirty = True

    def line(self, now: float) -> PrefillLine | None:
        samples = self._samples
        horizon = now - self.ttl_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
            self._dirty = True
        if len(samples) < self.min_samples:
            self._line, self._dirty = None, False
        elif self._dirty and (now - self._at >= 1.0 or self._line is None):
            self._line = prefill_line([(x, y) for _, x, y in samples])
            self._at, self._dirty = now, False
        return self._line


class LoadTracker:
    """Measures one model's local load. Not thread-safe: call it from the gateway's event loop."""

    def __init__(
        self,
        capacity: int,
        *,
        window_s: float = 30.0,
        min_completions: int = MIN_COMPLETIONS,
        ttft_samples: int = 256,
        engine_stats_ttl_s: float = 10.0,
        idle_reset_s: float = IDLE_RESET_S,
        prefill_samples: int = PREFILL_SAMPLES,
        prefill_ttl_s: float = PREFILL_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 (concurrent requests the local engines run)")
        if window_s <= 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        if ttft_samples < 1:
            raise ValueError(f"ttft_samples={ttft_samples} must be >= 1")
        self.capacity = capacity
        self.window_s = window_s
        self.min_completions = max(1, min_completions)
        self.engine_stats_ttl_s = engine_stats_ttl_s
        self._clock = clock
        self._in_flight = 0
        self._completions: deque[tuple[float, int]] = deque()  # (finished_at, output_tokens)
        self._completion_tokens = 0  # sum of output_tokens over self._completions
        self._ttfts = _RecentMedian(ttft_samples)
        self.idle_reset_s = idle_reset_s
        self._prefill = _RollingLine(prefill_samples, prefill_ttl_s)  # (work, ttft) of unqueued requests
        self._awaiting: dict[int, int] = {}  # id(ticket) -> prompt tokens, for requests without a first token yet
        self._gated: dict[int, list] = {}  # id(ticket) -> [prompt tokens, passed the gate at | None], arrival order
        self._service = _RollingLine(prefill_samples, prefill_ttl_s, GATE_MIN_SAMPLES)  # (tokens, gate to 1st token)
        self._pending_prefill = 0  # sum of self._awaiting's values
        self._busy: deque[tuple[float, float]] = deque()  # closed (start, end) spells with a request in flight
        self._busy_closed_s = 0.0  # sum of end - start over self._busy
        self._busy_since: float | None = None  # start of the open spell, while a request is in flight
        self._engine: tuple[float, int, int] | None = None  # (set_at, running, waiting)
        self._peers: tuple[float, int, float] | None = None  # (set_at, in_flight, drain_rps) of other gateways

    # -- events --------------------------------------------------------------------------------

    def on_start(self, prompt_tokens: int = 0, now: float | None = None, *, awaits_first_token: bool = True) -> Ticket:
        """A local request was sent; keep the returned ticket for the two calls below. ``awaits_first_token``
        False (a non-streamed request: no first token will be reported): its prompt is not counted as prefill
        work ahead of later requests, as nothing would say when it was prefilled."""
        t = self._now(now)
        if self._in_flight == 0:
            self._busy_since = t
        self._in_flight += 1
        # its place in the queue every gateway feeds: a request behind the other gateways' is not an unqueued
        # (base TTFT) sample even when this gateway alone holds fewer than capacity
        peers = self._peers
        ahead = peers[1] if peers is not None and t - peers[0] <= self.engine_stats_ttl_s else 0
        tokens = max(0, prompt_tokens)
        ticket = Ticket(started_at=t, position=self._in_flight + ahead, prompt_tokens=tokens,
                        pending_ahead=self._pending_prefill)
        if awaits_first_token:
            self._awaiting[id(ticket)] = tokens
            self._pending_prefill += tokens
        return ticket

    def on_gate_wait(self, ticket: Ticket) -> None:
        """The request waits for ``overflow.prefill_gate`` (it is in the gate's queue from now)."""
        self._gated[id(ticket)] = [ticket.prompt_tokens, None]

    def on_gate_enter(self, ticket: Ticket, now: float | None = None) -> None:
        """The request passed the gate: it goes to the engine now."""
        g = self._gated.get(id(ticket))
        if g is not None:
            g[1] = self._now(now)

    def on_first_token(self, ticket: Ticket, now: float | None = None, ttft_s: float | None = None) -> float:
        """The first streamed token arrived (skip for non-streamed requests). Returns the TTFT recorded."""
        t = self._now(now)
        ttft = max(0.0, t - ticket.started_at) if ttft_s is None else ttft_s
        self._ttfts.add(t, ttft)
        g = self._gated.get(id(ticket))
        if g is not None and g[1] is not None and ticket.position <= self.capacity:
            self._service.add(t, ticket.prompt_tokens, max(0.0, t - g[1]))
        self._prefilled(ticket)
        if ticket.position <= self.capacity:
            self._prefill.add(t, ticket.prompt_tokens + ticket.pending_ahead, ttft)
        return ttft

    def on_finish(self, ticket: Ticket, output_tokens: int = 0, ok: bool = True, now: float | None = None) -> None:
        """The request ended. Failed requests free their slot but do not count as drained work."""
        t = self._now(now)
        if self._in_flight == 0:
            raise RuntimeError("on_finish without a matching on_start")
        self._in_flight -= 1
        self._prefilled(ticket)
        if self._in_flight == 0 and self._busy_since is not None:
            self._busy.append((self._busy_since, t))
            self._busy_closed_s += t - self._busy_since
            self._busy_since = None
        if ok:
            tokens = max(0, output_tokens)
            self._completions.append((t, tokens))
            self._completion_tokens += tokens

    def set_engine_stats(self, running: int, waiting: int, now: float | None = None) -> None:
        """vLLM's num_requests_running / num_requests_waiting summed over replicas, when scraped."""
        self._engine = (self._now(now), max(0, running), max(0, waiting))

    def set_peer_load(self, in_flight: int, drain_rps: float, now: float | None = None) -> None:
        """The other gateways' requests to this model in flight and their drain rate (summed), as they last
        reported (:mod:`lmfleet.gateway.routing.peers`): N gateways then estimate the queue every one of them feeds."""
        self._peers = (self._now(now), max(0, in_flight), max(0.0, drain_rps))

    # -- reading ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def snapshot(self, now: float | None = None, *, with_peers: bool = True) -> QueueSignals:
        """This model's signals now; ``with_peers=False``: this gateway's own requests only (what it reports to
        the other gateways)."""
        t = self._now(now)
        self._expire(t)
        n = len(self._completions)
        busy = self._busy_seconds(t)
        drain = tps = None
        if n >= self.min_completions and busy > 0:
            drain = n / busy
            tps = self._completion_tokens / busy
        running = waiting = None
        if self._engine is not None and t - self._engine[0] <= self.engine_stats_ttl_s:
            _, running, waiting = self._engine
        in_flight = self._in_flight
        if with_peers and self._peers is not None and t - self._peers[0] <= self.engine_stats_ttl_s:
            _, peer_in_flight, peer_drain = self._peers
            in_flight += peer_in_flight
            if peer_drain > 0:  # the engines drain everyone's requests: the drain rate is the sum
                drain = (drain or 0.0) + peer_drain
        line = self._prefill.line(t)
        gate = self._service.line(t)
        newest = self._prefill.newest_at
        return QueueSignals(
            now=t,
            in_flight=in_flight,
            drain_rps=drain,
            output_tps=tps,
            ttft_s=self._ttfts.median(),
            base_ttft_s=line.base_ttft_s if line else None,
            completions_in_window=n,
            engine_running=running,
            engine_waiting=waiting,
            pending_prefill_tokens=self._pending_prefill,
            prefill_s_per_token=line.slope if line else None,
            base_prefill_tokens=line.base_work if line else None,
            prefill_stale=line_is_stale(newest, t, in_flight, self.idle_reset_s),
            busy_s=busy,
            gate_queue=tuple((tokens, None if at is None else max(0.0, t - at)) for tokens, at in self._gated.values()),
            gate_base_s=gate.base_ttft_s if gate else None,
            gate_base_tokens=gate.base_work if gate else None,
            gate_s_per_token=gate.slope if gate else None,
        )

    # -- internals -------------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def _prefilled(self, ticket: Ticket) -> None:
        """The ticket's prompt no longer waits for prefill (its first token came, or it ended)."""
        tokens = self._awaiting.pop(id(ticket), None)
        if tokens is not None:
            self._pending_prefill -= tokens
        self._gated.pop(id(ticket), None)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        completions = self._completions
        while completions and completions[0][0] < horizon:
            self._completion_tokens -= completions.popleft()[1]
        self._ttfts.expire(horizon)
        busy = self._busy
        while busy and busy[0][1] < horizon:
            start, end = busy.popleft()
            self._busy_closed_s -= end - start
        if not busy:
            self._busy_closed_s = 0.0  # drop the rounding left by many additions and subtractions

    def _busy_seconds(self, now: float) -> float:
        """Busy time inside (now - window_s, now]: only the oldest spell can straddle the horizon."""
        horizon = now - self.window_s
        total = self._busy_closed_s
        if self._busy and self._busy[0][0] < horizon:
            total -= horizon - self._busy[0][0]
        if self._busy_since is not None:
            total += max(0.0, now - max(self._busy_since, horizon))
        return max(0.0, total)

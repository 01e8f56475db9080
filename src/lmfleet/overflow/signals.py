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
  With fewer than ``min_completions`` completions in the window the rate is unknown (``None``).
* **Recent TTFT**: median of the TTFT samples of the trailing window.
* **Base TTFT** (prefill time without queueing): median of the last ``base_samples`` TTFTs of
  requests that found a free slot when they started (their position, in-flight count including
  themselves, was <= ``capacity``). It is not time-limited: under sustained overload no new
  unqueued samples arrive, and the last ones known are the best guess.
* **Engine stats** (optional): vLLM's ``num_requests_running`` / ``num_requests_waiting`` as last
  set by :meth:`LoadTracker.set_engine_stats`; reported only while younger than ``engine_stats_ttl_s``.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LoadTracker", "QueueSignals", "Ticket"]


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
    """Median TTFT of the window (includes queueing); None without samples."""
    base_ttft_s: float | None
    """Median TTFT of recent requests that did not queue (prefill time); None without samples."""
    completions_in_window: int
    engine_running: int | None = None
    engine_waiting: int | None = None


@dataclass(frozen=True)
class Ticket:
    """Handle for one local request, returned by :meth:`LoadTracker.on_start`."""

    started_at: float
    position: int
    """In-flight count at start, this request included (1 = the engine was idle)."""
    prompt_tokens: int


class LoadTracker:
    """Measures one model's local load. Not thread-safe: call it from the gateway's event loop."""

    def __init__(
        self,
        capacity: int,
        *,
        window_s: float = 30.0,
        min_completions: int = 3,
        base_samples: int = 32,
        engine_stats_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 (concurrent requests the local engines run)")
        if window_s <= 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        self.capacity = capacity
        self.window_s = window_s
        self.min_completions = max(1, min_completions)
        self.engine_stats_ttl_s = engine_stats_ttl_s
        self._clock = clock
        self._in_flight = 0
        self._completions: deque[tuple[float, int]] = deque()  # (finished_at, output_tokens)
        self._ttfts: deque[tuple[float, float]] = deque()  # (observed_at, ttft_s)
        self._base_ttfts: deque[float] = deque(maxlen=base_samples)
        self._busy: deque[list[float]] = deque()  # [start, end]; end == inf while busy
        self._engine: tuple[float, int, int] | None = None  # (set_at, running, waiting)

    # -- events --------------------------------------------------------------------------------

    def on_start(self, prompt_tokens: int = 0, now: float | None = None) -> Ticket:
        """A local request was sent; keep the returned ticket for the two calls below."""
        t = self._now(now)
        if self._in_flight == 0:
            self._busy.append([t, float("inf")])
        self._in_flight += 1
        return Ticket(started_at=t, position=self._in_flight, prompt_tokens=prompt_tokens)

    def on_first_token(self, ticket: Ticket, now: float | None = None, ttft_s: float | None = None) -> float:
        """The first streamed token arrived (skip for non-streamed requests). Returns the TTFT recorded."""
        t = self._now(now)
        ttft = max(0.0, t - ticket.started_at) if ttft_s is None else ttft_s
        self._ttfts.append((t, ttft))
        if ticket.position <= self.capacity:
            self._base_ttfts.append(ttft)
        return ttft

    def on_finish(self, ticket: Ticket, output_tokens: int = 0, ok: bool = True, now: float | None = None) -> None:
        """The request ended. Failed requests free their slot but do not count as drained work."""
        t = self._now(now)
        if self._in_flight == 0:
            raise RuntimeError("on_finish without a matching on_start")
        self._in_flight -= 1
        if self._in_flight == 0 and self._busy:
            self._busy[-1][1] = t
        if ok:
            self._completions.append((t, max(0, output_tokens)))

    def set_engine_stats(self, running: int, waiting: int, now: float | None = None) -> None:
        """vLLM's num_requests_running / num_requests_waiting summed over replicas, when scraped."""
        self._engine = (self._now(now), max(0, running), max(0, waiting))

    # -- reading ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def snapshot(self, now: float | None = None) -> QueueSignals:
        t = self._now(now)
        self._expire(t)
        n = len(self._completions)
        busy = self._busy_seconds(t)
        drain = tps = None
        if n >= self.min_completions and busy > 0:
            drain = n / busy
            tps = sum(tok for _, tok in self._completions) / busy
        running = waiting = None
        if self._engine is not None and t - self._engine[0] <= self.engine_stats_ttl_s:
            _, running, waiting = self._engine
        return QueueSignals(
            now=t,
            in_flight=self._in_flight,
            drain_rps=drain,
            output_tps=tps,
            ttft_s=statistics.median(x for _, x in self._ttfts) if self._ttfts else None,
            base_ttft_s=statistics.median(self._base_ttfts) if self._base_ttfts else None,
            completions_in_window=n,
            engine_running=running,
            engine_waiting=waiting,
        )

    # -- internals -------------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._completions and self._completions[0][0] < horizon:
            self._completions.popleft()
        while self._ttfts and self._ttfts[0][0] < horizon:
            self._ttfts.popleft()
        while self._busy and self._busy[0][1] < horizon:
            self._busy.popleft()

    def _busy_seconds(self, now: float) -> float:
        horizon = now - self.window_s
        return sum(max(0.0, min(end, now) - max(start, horizon)) for start, end in self._busy)

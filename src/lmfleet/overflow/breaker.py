"""Per-provider circuit breaker, rate-limit blocking, and retry backoff.

States::

    CLOSED --(consecutive_failures in a row, or error rate >= error_rate over the last
              `window` outcomes once at least min(min_requests, window) are in)--> OPEN
    OPEN   --(cooldown_s elapsed)--> HALF_OPEN
    HALF_OPEN: exactly one probe request is let through (try_acquire() returns True once);
               its success -> CLOSED (window cleared), its failure -> OPEN for another cooldown.
               Only the probe's own success closes it (its :class:`Admission`): a long stream begun before the
               breaker opened proves nothing about now. A cancelled probe is neutral: it frees the slot.
               A probe that never reports back is given up after cooldown_s and a new one allowed.

A 429 is not a health failure: :meth:`CircuitBreaker.on_rate_limited` blocks the provider until
``now + retry_after_s`` (the server's ``Retry-After``), whatever the state, and touches no counter.

Usage at the gateway: ``if (t := breaker.acquire()): send ...; breaker.on_success(ticket=t) / on_failure() /
release(t)`` (the client went away: neutral).
``allows()`` answers the same question without taking the half-open probe slot (for routing).
Every method takes an optional ``now``; the default clock is ``time.monotonic``.
"""

from __future__ import annotations

import email.utils
import enum
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lmfleet.config.models import BreakerConfig

__all__ = ["BreakerState", "CircuitBreaker", "Admission", "backoff_s", "parse_retry_after"]


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Admission:
    """One admitted request: ``probe`` is the half-open probe's number, None for a request admitted while closed."""

    probe: int | None = None


class CircuitBreaker:
    """One provider's breaker. Not thread-safe: use it from the gateway's event loop."""

    def __init__(
        self,
        consecutive_failures: int = 5,
        error_rate: float = 0.5,
        window: int = 20,
        cooldown_s: float = 30.0,
        min_requests: int = 10,
        *,
        rate_limit_default_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if consecutive_failures < 1 or window < 1 or min_requests < 1:
            raise ValueError(f"{consecutive_failures=}, {window=} and {min_requests=} must all be >= 1")
        if not 0 < error_rate <= 1:
            raise ValueError(f"{error_rate=} must be in (0, 1]")
        self.consecutive_failures = consecutive_failures
        self.error_rate = error_rate
        self.window = window
        self.cooldown_s = cooldown_s
        self.min_requests = min(min_requests, window)
        self.rate_limit_default_s = rate_limit_default_s
        self._clock = clock
        self._outcomes: deque[bool] = deque(maxlen=window)  # True = failure
        self._streak = 0
        self._opened_at: float | None = None  # set while OPEN / HALF_OPEN
        self._probe_at: float | None = None  # when the half-open probe was handed out
        self._probes = 0  # probes handed out so far: the current one's number
        self._blocked_until = float("-inf")

    @classmethod
    def from_config(cls, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> "CircuitBreaker":
        return cls(cfg.consecutive_failures, cfg.error_rate, cfg.window, cfg.cooldown_s, cfg.min_requests, clock=clock)

    # -- questions -------------------------------------------------------------------------------

    def state(self, now: float | None = None) -> BreakerState:
        t = self._now(now)
        if self._opened_at is None:
            return BreakerState.CLOSED
        return BreakerState.HALF_OPEN if t >= self._opened_at + self.cooldown_s else BreakerState.OPEN

    def allows(self, now: float | None = None) -> bool:
        """Would a request be let through now? (No side effect; see try_acquire.)"""
        t = self._now(now)
        if t < self._blocked_until:
            return False
        st = self.state(t)
        if st is BreakerState.CLOSED:
            return True
        if st is BreakerState.OPEN:
            return False
        return self._probe_at is None or t >= self._probe_at + self.cooldown_s

    def acquire(self, now: float | None = None) -> Admission | None:
        """Let one request through if allowed (its ticket), else None; in HALF_OPEN this takes the single probe
        slot, and only this ticket's success will close the breaker."""
        t = self._now(now)
        if not self.allows(t):
            return None
        if self.state(t) is BreakerState.HALF_OPEN:
            self._probe_at = t
            self._probes += 1
            return Admission(self._probes)
        return Admission()

    def try_acquire(self, now: float | None = None) -> bool:
        """:meth:`acquire` without the ticket."""
        return self.acquire(now) is not None

    def release(self, ticket: Admission | None) -> None:
        """The request of ``ticket`` ended without a verdict (the client went away): neutral. A probe's slot is
        freed for the next request."""
        if ticket is not None and ticket.probe == self._probes and self._probe_at is not None:
            self._probe_at = None

    def retry_after_s(self, now: float | None = None) -> float:
        """Seconds until :meth:`allows` may turn true (0 if it is true now)."""
        t = self._now(now)
        if self.allows(t):
            return 0.0
        until = self._blocked_until
        st = self.state(t)
        if st is BreakerState.OPEN:
            until = max(until, self._opened_at + self.cooldown_s)  # type: ignore[operator]
        elif st is BreakerState.HALF_OPEN and self._probe_at is not None:
            until = max(until, self._probe_at + self.cooldown_s)
        return max(0.0, until - t)

    # -- outcomes --------------------------------------------------------------------------------

    def on_success(self, now: float | None = None, ticket: Admission | None = None) -> None:
        """A success. While half-open only the probe's (``ticket`` from :meth:`acquire`) closes the breaker."""
        t = self._now(now)
        st = self.state(t)
        if st is BreakerState.HALF_OPEN and ticket is not None and ticket.probe == self._probes \
                and self._probe_at is not None:
            self._close()
            return
        if st is not BreakerState.CLOSED:
            return  # a straggler from before opening proves nothing
        self._streak = 0
        self._outcomes.append(False)

    def on_failure(self, now: float | None = None) -> None:
        """A retryable failure (5xx, connect error, timeout, broken stream)."""
        t = self._now(now)
        st = self.state(t)
        if st is BreakerState.HALF_OPEN:
            self._open(t)  # the probe failed: another cooldown
        if st is not BreakerState.CLOSED:
            return
        self._streak += 1
        self._outcomes.append(True)
        failures = sum(self._outcomes)
        rate_trips = len(self._outcomes) >= self.min_requests and failures / len(self._outcomes) >= self.error_rate
        if self._streak >= self.consecutive_failures or rate_trips:
            self._open(t)

    def on_rate_limited(self, retry_after_s: float | None = None, now: float | None = None) -> None:
        """A 429: block until ``now + retry_after_s`` (default ``rate_limit_default_s``)."""
        t = self._now(now)
        delay = self.rate_limit_default_s
        if retry_after_s is not None and not math.isnan(retry_after_s):
            delay = min(max(0.0, retry_after_s), MAX_RETRY_AFTER_S)
        self._blocked_until = max(self._blocked_until, t + delay)
        if self._probe_at is not None:
            self._probe_at = None  # a rate-limited probe says nothing about health; allow another later

    # -- internals -------------------------------------------------------------------------------

    def _open(self, t: float) -> None:
        self._opened_at = t
        self._probe_at = None

    def _close(self) -> None:
        self._opened_at = None
        self._probe_at = None
        self._streak = 0
        self._outcomes.clear()

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now


def backoff_s(attempt: int, base: float = 0.5, cap: float = 10.0, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in ``[0, min(cap, base * 2**attempt))``.

    ``attempt`` counts from 0 (the delay before the first retry). Full jitter spreads retries
    from many clients evenly instead of synchronising them (AWS Architecture Blog, "Exponential
    Backoff and Jitter").
    """
    if attempt < 0:
        raise ValueError(f"{attempt=} must be >= 0")
    ceiling = min(cap, base * (2.0 ** min(attempt, 62)))
    return (rng or random).random() * ceiling


MAX_RETRY_AFTER_S = 300.0
"""Longest Retry-After honoured: a provider's (or a hostile proxy's) "inf" must not park it for ever."""


def parse_retry_after(value: str | None, now_epoch: float | None = None) -> float | None:
    """Seconds from an HTTP ``Retry-After`` header (delta-seconds or HTTP-date), clamped to
    ``[0, MAX_RETRY_AFTER_S]``; None if absent, unparseable, negative or NaN (ignored)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            dt = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):
            return None
        now = time.time() if now_epoch is None else now_epoch
        seconds = max(0.0, dt.timestamp() - now)
    if math.isnan(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_S)

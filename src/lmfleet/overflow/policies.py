"""What to do next with one request under the model's ``overflow.policy``. A pure function.

:func:`lmfleet.overflow.policy.decide` answers "is a provider open, and is the local queue over the bar?";
:func:`next_step` answers, for the policy in force, what the gateway does about one request *now*: at
admission, when its local attempt fails, when a timer runs out, when a first token comes. The gateway calls
it again on each of those events (and at ``Step.wake_at``), and does what the step says.

Inputs: the policy and its timers, the request's permissions (a batch class may use paid providers only
when its tenant allows it), whether a provider is open now (healthy, with headroom, within budget: what
``decide()`` found), the predicted local wait and the bar it is held to, and the request's attempts so far.

The table (first match wins; "may" = permitted and a provider open)::

    admission (nothing sent yet, no local error)
      predictive, hedge: estimate > threshold, may            -> SEND_PROVIDER  estimate_above_threshold
      predictive, hedge: estimate > threshold, not may        -> SEND_LOCAL     provider_not_allowed / no_provider_open
      predictive, hedge: estimate <= threshold                -> SEND_LOCAL     estimate_within_threshold
      ttft_timeout, on_error                                  -> SEND_LOCAL     local_first
    hedge running (a provider attempt beside the local one)
      local first token, not after the hedge's                -> CANCEL_HEDGE   local_won
      hedge first token, local attempt alive                  -> CANCEL_LOCAL   hedge_won
      hedge first token, local attempt failed                 -> STREAM         hedge_won
      hedge failed, local attempt failed too                  -> RETURN_ERROR   hedge_failed
      hedge failed, local attempt alive                       -> WAIT (event)   hedge_failed
      local failed, hedge still waiting                       -> WAIT (event)   local_failed_hedge_runs
      neither yet                                             -> WAIT (event)   hedge_race
    one local attempt
      its first token came                                    -> STREAM         first_token
      it failed with a client error (4xx, not 429)            -> RETURN_ERROR   client_error
      it failed (429, 503, 5xx, unreachable), may             -> SEND_PROVIDER  local_error
      it failed, not may                                      -> RETURN_ERROR   provider_not_allowed / no_provider_open
      ttft_timeout: before dispatched + ttft_timeout_ms       -> WAIT (timer)   waiting_for_timer
      ttft_timeout: timer ran out, may                        -> FAIL_OVER      ttft_timeout (cancel local, then provider)
      hedge: before dispatched + hedge_after_ms               -> WAIT (timer)   waiting_for_timer
      hedge: timer ran out, may                               -> START_HEDGE    hedge_after_elapsed
      ttft_timeout, hedge: timer ran out, provider closed     -> WAIT (recheck) no_provider_open
      ttft_timeout, hedge: timer ran out, not permitted       -> WAIT (event)   provider_not_allowed
      otherwise                                               -> WAIT (event)   waiting_for_first_token

A request sent to a provider at admission leaves this table: the provider path's retries and fallbacks
take it from there. Failing over after a local error is the same under every policy (the local attempt is gone; a provider is the
only way to answer). A batch request whose tenant does not allow providers never leaves the local engines: not
at admission, not as a hedge, not after a timeout or an error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lmfleet.config.models import OverflowPolicyConfig

__all__ = [
    "PROVIDER_RECHECK_S",
    "Action",
    "AttemptState",
    "LocalError",
    "Permissions",
    "Policy",
    "PolicyTimers",
    "Step",
    "StepReason",
    "next_step",
]

PROVIDER_RECHECK_S = 0.5
"""After a timer ran out while no provider was open: ask again this much later (a breaker or budget may reopen)."""


class Policy(str, enum.Enum):
    """``overflow.policy`` (docs/overflow.md)."""

    PREDICTIVE = "predictive"
    TTFT_TIMEOUT = "ttft_timeout"
    ON_ERROR = "on_error"
    HEDGE = "hedge"


class LocalError(str, enum.Enum):
    """How a local attempt failed, classified once at the gateway's boundary."""

    RATE_LIMITED = "rate_limited"  # 429
    UNAVAILABLE = "unavailable"  # 503
    SERVER_ERROR = "server_error"  # any other 5xx
    UNREACHABLE = "unreachable"  # connect refused or reset, deployment down
    CLIENT_ERROR = "client_error"  # 4xx other than 429: a provider would refuse the request too

    @property
    def spillable(self) -> bool:
        return self is not LocalError.CLIENT_ERROR


class Action(str, enum.Enum):
    SEND_LOCAL = "send_local"
    SEND_PROVIDER = "send_provider"
    START_HEDGE = "start_hedge"  # send to a provider too, keep the local attempt
    FAIL_OVER = "fail_over"  # cancel the local attempt in the engine, then send to a provider
    CANCEL_HEDGE = "cancel_hedge"  # the local attempt won the race: cancel the provider's
    CANCEL_LOCAL = "cancel_local"  # the hedge won the race: cancel the local attempt in the engine
    STREAM = "stream"  # one attempt has its first token: relay it, nothing to decide
    WAIT = "wait"  # nothing to do until the next event or ``wake_at``
    RETURN_ERROR = "return_error"  # answer the local attempt's error


class StepReason(str, enum.Enum):
    ESTIMATE_ABOVE_THRESHOLD = "estimate_above_threshold"
    ESTIMATE_WITHIN_THRESHOLD = "estimate_within_threshold"
    LOCAL_FIRST = "local_first"
    PROVIDER_NOT_ALLOWED = "provider_not_allowed"
    NO_PROVIDER_OPEN = "no_provider_open"
    LOCAL_WON = "local_won"
    HEDGE_WON = "hedge_won"
    LOCAL_FAILED_HEDGE_RUNS = "local_failed_hedge_runs"
    HEDGE_RACE = "hedge_race"
    HEDGE_FAILED = "hedge_failed"
    FIRST_TOKEN = "first_token"
    CLIENT_ERROR = "client_error"
    LOCAL_ERROR = "local_error"
    WAITING_FOR_TIMER = "waiting_for_timer"
    TTFT_TIMEOUT = "ttft_timeout"
    HEDGE_AFTER_ELAPSED = "hedge_after_elapsed"
    WAITING_FOR_FIRST_TOKEN = "waiting_for_first_token"


@dataclass(frozen=True)
class PolicyTimers:
    """The policy in force and its timers (``overflow.policy``, ``ttft_timeout_ms``, ``hedge_after_ms``)."""

    policy: Policy = Policy.PREDICTIVE
    ttft_timeout_ms: float | None = None
    hedge_after_ms: float | None = None

    def __post_init__(self) -> None:
        need = {Policy.TTFT_TIMEOUT: ("ttft_timeout_ms", self.ttft_timeout_ms),
                Policy.HEDGE: ("hedge_after_ms", self.hedge_after_ms)}.get(self.policy)
        if need is not None and (need[1] is None or need[1] <= 0):
            raise ValueError(f"policy {self.policy.value} needs {need[0]} > 0, got {need[1]!r}")

    @classmethod
    def from_config(cls, overflow: OverflowPolicyConfig) -> "PolicyTimers":
        """From a model's ``overflow`` section."""
        return cls(Policy(overflow.policy), overflow.ttft_timeout_ms, overflow.hedge_after_ms)

    @property
    def timer_ms(self) -> float | None:
        """The policy's first-token timer, if it has one."""
        return {Policy.TTFT_TIMEOUT: self.ttft_timeout_ms, Policy.HEDGE: self.hedge_after_ms}.get(self.policy)


@dataclass(frozen=True)
class Permissions:
    """What the request's class and tenant allow. ``batch``: its class has a local wait deadline (max_wait_s)."""

    batch: bool = False
    batch_may_use_providers: bool = False

    @property
    def may_use_providers(self) -> bool:
        return not self.batch or self.batch_may_use_providers


@dataclass(frozen=True)
class AttemptState:
    """The request's attempts so far; times are the gateway's monotonic clock, in seconds."""

    local_dispatched_at: float | None = None
    local_first_token_at: float | None = None
    local_error: LocalError | None = None
    """The local attempt failed (or the deployment was down before it could be sent)."""
    hedge_started_at: float | None = None
    hedge_first_token_at: float | None = None
    hedge_failed: bool = False
    """The provider attempt beside the local one failed before its first token (no second hedge is started)."""


@dataclass(frozen=True)
class Step:
    action: Action
    reason: StepReason
    wake_at: float | None = None
    """For WAIT: call :func:`next_step` again at this time, unless an event comes first. None: on the next event."""


def next_step(
    timers: PolicyTimers,
    *,
    now: float,
    estimate_ms: float,
    threshold_ms: float,
    permissions: Permissions,
    provider_open: bool,
    attempt: AttemptState,
) -> Step:
    """What the gateway does with one request now (the module docstring's table).

    ``threshold_ms``: the bar the estimate is held to for this request (the model's ``threshold_ms``, lowered
    by hysteresis while overflowing, as ``decide()`` applies it). ``provider_open``: a provider could take the
    request now (healthy, with headroom, budget left).
    """
    blocked = None
    if not permissions.may_use_providers:
        blocked = StepReason.PROVIDER_NOT_ALLOWED
    elif not provider_open:
        blocked = StepReason.NO_PROVIDER_OPEN
    a = attempt

    if a.local_dispatched_at is None and a.local_error is None and a.hedge_started_at is None:
        if timers.policy in (Policy.PREDICTIVE, Policy.HEDGE):
            if estimate_ms <= threshold_ms:
                return Step(Action.SEND_LOCAL, StepReason.ESTIMATE_WITHIN_THRESHOLD)
            if blocked is None:
                return Step(Action.SEND_PROVIDER, StepReason.ESTIMATE_ABOVE_THRESHOLD)
            return Step(Action.SEND_LOCAL, blocked)
        return Step(Action.SEND_LOCAL, StepReason.LOCAL_FIRST)

    if a.hedge_started_at is not None:
        local_t, hedge_t = a.local_first_token_at, a.hedge_first_token_at
        if local_t is not None and (hedge_t is None or local_t <= hedge_t):
            return Step(Action.CANCEL_HEDGE, StepReason.LOCAL_WON)
        if hedge_t is not None:
            if a.local_error is not None:
                return Step(Action.STREAM, StepReason.HEDGE_WON)
            return Step(Action.CANCEL_LOCAL, StepReason.HEDGE_WON)
        if a.hedge_failed:
            if a.local_error is not None:
                return Step(Action.RETURN_ERROR, StepReason.HEDGE_FAILED)
            return Step(Action.WAIT, StepReason.HEDGE_FAILED)
        if a.local_error is not None:
            return Step(Action.WAIT, StepReason.LOCAL_FAILED_HEDGE_RUNS)
        return Step(Action.WAIT, StepReason.HEDGE_RACE)

    if a.local_first_token_at is not None:
        return Step(Action.STREAM, StepReason.FIRST_TOKEN)
    if a.local_error is not None:
        if not a.local_error.spillable:
            return Step(Action.RETURN_ERROR, StepReason.CLIENT_ERROR)
        if blocked is not None:
            return Step(Action.RETURN_ERROR, blocked)
        return Step(Action.SEND_PROVIDER, StepReason.LOCAL_ERROR)

    timer_ms = timers.timer_ms
    if timer_ms is None or a.local_dispatched_at is None:
        return Step(Action.WAIT, StepReason.WAITING_FOR_FIRST_TOKEN)
    deadline = a.local_dispatched_at + timer_ms / 1000.0
    if now < deadline:
        return Step(Action.WAIT, StepReason.WAITING_FOR_TIMER, wake_at=deadline)
    if blocked is StepReason.PROVIDER_NOT_ALLOWED:
        return Step(Action.WAIT, blocked)
    if blocked is StepReason.NO_PROVIDER_OPEN:
        return Step(Action.WAIT, blocked, wake_at=now + PROVIDER_RECHECK_S)
    if timers.policy is Policy.TTFT_TIMEOUT:
        return Step(Action.FAIL_OVER, StepReason.TTFT_TIMEOUT)
    return Step(Action.START_HEDGE, StepReason.HEDGE_AFTER_ELAPSED)

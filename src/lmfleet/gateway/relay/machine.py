"""The attempt loop of one request as a state machine: phases, events, one pure transition function.

:class:`~lmfleet.gateway.relay.run.RequestRun` tries the plan's backends in order (first success, failover); a
streamed request's local attempt under ``overflow.policy`` ttft_timeout or hedge races the policy's timer
(:class:`~lmfleet.gateway.relay.race.Race`, whose moves :func:`lmfleet.overflow.policies.next_step` decides).
Each attempt, raced or not, ends in one :class:`Event`; :func:`transition` says where the loop goes next::

    phase            event        -> phase            what the loop does
    TRYING           ANSWERED     -> SERVED           relay the answer (the local one, or a hedge that won)
    TRYING           SKIPPED      -> TRYING           the backend took no attempt now (breaker, caps, budget,
                                                      no local slot): the next attempt
    TRYING           FAILED       -> TRYING           the next attempt (the same backend per its retries, then
                                                      the next backend)
    TRYING           LOCAL_OVER   -> PROVIDERS_ONLY   the local attempts are over (ttft_timeout at its timer, a
                                                      local error the policy spills, the class's queue deadline)
    TRYING           REJECTED     -> GAVE_UP          no other attempt would do better (a 4xx; a hedge and its
                                                      local attempt both failed)
    TRYING           OUT_OF_TIME  -> GAVE_UP          the request's deadline passed
    TRYING           EXHAUSTED    -> GAVE_UP          no attempt left
    PROVIDERS_ONLY   (the same, local attempts skipped; LOCAL_OVER stays in PROVIDERS_ONLY)
    SERVED, GAVE_UP  (final: no event)

What a race without a winner ends in is :func:`race_event`. Pure; the table is tested row by row
(tests/unit/test_gateway_relay_machine.py).
"""

from __future__ import annotations

import enum

from lmfleet.overflow.policies import Action, Step, StepReason

__all__ = ["Event", "Phase", "TRANSITIONS", "may_send", "race_event", "transition"]


class Phase(str, enum.Enum):
    """Where the attempt loop of one request stands."""

    TRYING = "trying"
    """The plan's attempts in order, local ones included."""
    PROVIDERS_ONLY = "providers_only"
    """The local attempts are over: later backends only."""
    SERVED = "served"
    """An attempt answered (final)."""
    GAVE_UP = "gave_up"
    """No attempt answered (final): the request is answered with the last error."""

    @property
    def final(self) -> bool:
        return self in (Phase.SERVED, Phase.GAVE_UP)


class Event(str, enum.Enum):
    """How one attempt (or a race of the local attempt against the policy's timer) ended."""

    ANSWERED = "answered"
    SKIPPED = "skipped"
    FAILED = "failed"
    LOCAL_OVER = "local_over"
    REJECTED = "rejected"
    OUT_OF_TIME = "out_of_time"
    EXHAUSTED = "exhausted"


def _rows(phase: Phase, on_local_over: Phase) -> dict[tuple[Phase, Event], Phase]:
    return {(phase, Event.ANSWERED): Phase.SERVED, (phase, Event.SKIPPED): phase, (phase, Event.FAILED): phase,
            (phase, Event.LOCAL_OVER): on_local_over, (phase, Event.REJECTED): Phase.GAVE_UP,
            (phase, Event.OUT_OF_TIME): Phase.GAVE_UP, (phase, Event.EXHAUSTED): Phase.GAVE_UP}


TRANSITIONS: dict[tuple[Phase, Event], Phase] = {**_rows(Phase.TRYING, Phase.PROVIDERS_ONLY),
                                                 **_rows(Phase.PROVIDERS_ONLY, Phase.PROVIDERS_ONLY)}
"""The module docstring's table."""


def transition(phase: Phase, event: Event) -> Phase:
    """The loop's next phase; ValueError for an event in a final phase (a bug: nothing runs there)."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise ValueError(f"no transition from {phase.value} on {event.value}") from None


def may_send(phase: Phase, local: bool) -> bool:
    """May the loop, in ``phase``, send the next attempt (``local``: to the local deployment)?"""
    return phase is Phase.TRYING or (phase is Phase.PROVIDERS_ONLY and not local)


def race_event(step: Step, local_retryable: bool) -> Event:
    """What a race that ended without a winner means for the loop: ``step`` is the policy's last step (the local
    attempt is over), ``local_retryable``: its error may clear on another attempt (True: it failed at the timer,
    or with no error). A failover at the timer or a local error the policy spills: the providers
    (:attr:`Event.LOCAL_OVER`); the hedge failed after the local attempt, or the local error is the request's own:
    give up (:attr:`Event.REJECTED`); otherwise on as after any failure (:attr:`Event.FAILED`)."""
    if step.action in (Action.FAIL_OVER, Action.SEND_PROVIDER):
        return Event.LOCAL_OVER
    if step.reason is StepReason.HEDGE_FAILED or not local_retryable:
        return Event.REJECTED
    return Event.FAILED

"""The relay's attempt loop as a state machine: every transition, may_send, and how a race without a winner ends."""

from __future__ import annotations

import pytest

from lmfleet.gateway.relay.machine import TRANSITIONS, Event, Phase, may_send, race_event, transition
from lmfleet.overflow.policies import Action, Step, StepReason

P, E = Phase, Event


@pytest.mark.parametrize("phase, event, want", [
    (P.TRYING, E.ANSWERED, P.SERVED),
    (P.TRYING, E.SKIPPED, P.TRYING),
    (P.TRYING, E.FAILED, P.TRYING),
    (P.TRYING, E.LOCAL_OVER, P.PROVIDERS_ONLY),
    (P.TRYING, E.REJECTED, P.GAVE_UP),
    (P.TRYING, E.OUT_OF_TIME, P.GAVE_UP),
    (P.TRYING, E.EXHAUSTED, P.GAVE_UP),
    (P.PROVIDERS_ONLY, E.ANSWERED, P.SERVED),
    (P.PROVIDERS_ONLY, E.SKIPPED, P.PROVIDERS_ONLY),
    (P.PROVIDERS_ONLY, E.FAILED, P.PROVIDERS_ONLY),
    (P.PROVIDERS_ONLY, E.LOCAL_OVER, P.PROVIDERS_ONLY),
    (P.PROVIDERS_ONLY, E.REJECTED, P.GAVE_UP),
    (P.PROVIDERS_ONLY, E.OUT_OF_TIME, P.GAVE_UP),
    (P.PROVIDERS_ONLY, E.EXHAUSTED, P.GAVE_UP),
])
def test_transition(phase, event, want):
    assert transition(phase, event) is want


def test_the_table_is_complete():
    """Every event of every phase that runs has a row; final phases have none."""
    live = [p for p in Phase if not p.final]
    assert set(TRANSITIONS) == {(p, e) for p in live for e in Event}


@pytest.mark.parametrize("phase", [P.SERVED, P.GAVE_UP])
@pytest.mark.parametrize("event", list(Event))
def test_no_transition_out_of_a_final_phase(phase, event):
    with pytest.raises(ValueError, match="no transition"):
        transition(phase, event)


@pytest.mark.parametrize("phase, local, want", [
    (P.TRYING, True, True),
    (P.TRYING, False, True),
    (P.PROVIDERS_ONLY, True, False),
    (P.PROVIDERS_ONLY, False, True),
    (P.SERVED, False, False),
    (P.GAVE_UP, False, False),
])
def test_may_send(phase, local, want):
    assert may_send(phase, local) is want


@pytest.mark.parametrize("step, retryable, want", [
    # ttft_timeout: the timer ran out, the local attempt was dropped: the providers
    (Step(Action.FAIL_OVER, StepReason.TTFT_TIMEOUT), True, E.LOCAL_OVER),
    # the local attempt failed and the policy spills it (any policy, a provider may take it)
    (Step(Action.SEND_PROVIDER, StepReason.LOCAL_ERROR), True, E.LOCAL_OVER),
    # hedge: the hedge failed, then the local attempt: give up with the last error
    (Step(Action.RETURN_ERROR, StepReason.HEDGE_FAILED), True, E.REJECTED),
    # the local attempt failed with the request's own error (4xx)
    (Step(Action.RETURN_ERROR, StepReason.CLIENT_ERROR), False, E.REJECTED),
    # the local attempt failed, no provider may take it: on as after any failure (its retries)
    (Step(Action.RETURN_ERROR, StepReason.PROVIDER_NOT_ALLOWED), True, E.FAILED),
    (Step(Action.RETURN_ERROR, StepReason.NO_PROVIDER_OPEN), True, E.FAILED),
    (Step(Action.RETURN_ERROR, StepReason.NO_PROVIDER_OPEN), False, E.REJECTED),
])
def test_race_event(step, retryable, want):
    assert race_event(step, retryable) is want


@pytest.mark.parametrize("events, want", [
    # first success: a local answer
    ([E.ANSWERED], P.SERVED),
    # failover: local failed twice (its retries), a provider answered
    ([E.FAILED, E.FAILED, E.ANSWERED], P.SERVED),
    # a breaker skipped the first provider, the second answered
    ([E.SKIPPED, E.ANSWERED], P.SERVED),
    # ttft_timeout: the race failed over at the timer, then a provider answered
    ([E.LOCAL_OVER, E.FAILED, E.ANSWERED], P.SERVED),
    # a 4xx ends it
    ([E.FAILED, E.REJECTED], P.GAVE_UP),
    # every attempt failed
    ([E.FAILED, E.FAILED, E.EXHAUSTED], P.GAVE_UP),
    ([E.LOCAL_OVER, E.OUT_OF_TIME], P.GAVE_UP),
])
def test_runs(events, want):
    phase = P.TRYING
    for e in events:
        phase = transition(phase, e)
    assert phase is want

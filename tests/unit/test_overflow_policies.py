"""``next_step``: each policy's table, at admission, on errors, on timers and in a hedge race."""

from __future__ import annotations

import pytest

from lmfleet.config.models import OverflowPolicyConfig
from lmfleet.overflow.policies import (
    PROVIDER_RECHECK_S,
    Action,
    AttemptState,
    LocalError,
    Permissions,
    Policy,
    PolicyTimers,
    Step,
    StepReason,
    next_step,
)

PRED = PolicyTimers(Policy.PREDICTIVE)
ONERR = PolicyTimers(Policy.ON_ERROR)
TTFT = PolicyTimers(Policy.TTFT_TIMEOUT, ttft_timeout_ms=2000)
HEDGE = PolicyTimers(Policy.HEDGE, hedge_after_ms=1500)
ALL = [PRED, ONERR, TTFT, HEDGE]

INTERACTIVE = Permissions()
BATCH = Permissions(batch=True)
BATCH_PAYS = Permissions(batch=True, batch_may_use_providers=True)

NEW = AttemptState()
SENT = AttemptState(local_dispatched_at=100.0)
R = StepReason


def _step(timers, attempt=NEW, *, now=100.0, estimate_ms=500.0, perms=INTERACTIVE, open_=True):
    return next_step(timers, now=now, estimate_ms=estimate_ms, threshold_ms=2500.0, permissions=perms,
                     provider_open=open_, attempt=attempt)


@pytest.mark.parametrize("timers, estimate_ms, perms, open_, expected", [
    (PRED, 500, INTERACTIVE, True, Step(Action.SEND_LOCAL, R.ESTIMATE_WITHIN_THRESHOLD)),
    (PRED, 2500, INTERACTIVE, True, Step(Action.SEND_LOCAL, R.ESTIMATE_WITHIN_THRESHOLD)),
    (PRED, 2501, INTERACTIVE, True, Step(Action.SEND_PROVIDER, R.ESTIMATE_ABOVE_THRESHOLD)),
    (PRED, 9000, INTERACTIVE, False, Step(Action.SEND_LOCAL, R.NO_PROVIDER_OPEN)),
    (PRED, 9000, BATCH, True, Step(Action.SEND_LOCAL, R.PROVIDER_NOT_ALLOWED)),
    (PRED, 9000, BATCH_PAYS, True, Step(Action.SEND_PROVIDER, R.ESTIMATE_ABOVE_THRESHOLD)),
    (HEDGE, 9000, INTERACTIVE, True, Step(Action.SEND_PROVIDER, R.ESTIMATE_ABOVE_THRESHOLD)),
    (HEDGE, 100, INTERACTIVE, True, Step(Action.SEND_LOCAL, R.ESTIMATE_WITHIN_THRESHOLD)),
    (TTFT, 9000, INTERACTIVE, True, Step(Action.SEND_LOCAL, R.LOCAL_FIRST)),
    (ONERR, 9000, INTERACTIVE, True, Step(Action.SEND_LOCAL, R.LOCAL_FIRST)),
])
def test_admission(timers, estimate_ms, perms, open_, expected):
    assert _step(timers, estimate_ms=estimate_ms, perms=perms, open_=open_) == expected


@pytest.mark.parametrize("timers", ALL)
@pytest.mark.parametrize("error, perms, open_, expected", [
    (LocalError.RATE_LIMITED, INTERACTIVE, True, Step(Action.SEND_PROVIDER, R.LOCAL_ERROR)),
    (LocalError.UNAVAILABLE, INTERACTIVE, True, Step(Action.SEND_PROVIDER, R.LOCAL_ERROR)),
    (LocalError.SERVER_ERROR, INTERACTIVE, True, Step(Action.SEND_PROVIDER, R.LOCAL_ERROR)),
    (LocalError.UNREACHABLE, BATCH_PAYS, True, Step(Action.SEND_PROVIDER, R.LOCAL_ERROR)),
    (LocalError.CLIENT_ERROR, INTERACTIVE, True, Step(Action.RETURN_ERROR, R.CLIENT_ERROR)),
    (LocalError.SERVER_ERROR, INTERACTIVE, False, Step(Action.RETURN_ERROR, R.NO_PROVIDER_OPEN)),
    (LocalError.SERVER_ERROR, BATCH, True, Step(Action.RETURN_ERROR, R.PROVIDER_NOT_ALLOWED)),
])
def test_local_errors_fail_over_the_same_under_every_policy(timers, error, perms, open_, expected):
    assert _step(timers, AttemptState(local_dispatched_at=100.0, local_error=error), perms=perms,
                 open_=open_) == expected
    # the deployment was down before anything was sent: the same answer
    assert _step(timers, AttemptState(local_error=error), perms=perms, open_=open_) == expected


@pytest.mark.parametrize("timers", ALL)
def test_a_local_first_token_ends_the_decisions(timers):
    got = _step(timers, AttemptState(local_dispatched_at=100.0, local_first_token_at=109.0), now=109.0)
    assert got == Step(Action.STREAM, R.FIRST_TOKEN)


@pytest.mark.parametrize("timers, now, perms, open_, expected", [
    # predictive and on_error never act on a slow local request
    (PRED, 150.0, INTERACTIVE, True, Step(Action.WAIT, R.WAITING_FOR_FIRST_TOKEN)),
    (ONERR, 150.0, INTERACTIVE, True, Step(Action.WAIT, R.WAITING_FOR_FIRST_TOKEN)),
    # ttft_timeout: 2 s after dispatch at 100.0
    (TTFT, 100.5, INTERACTIVE, True, Step(Action.WAIT, R.WAITING_FOR_TIMER, wake_at=102.0)),
    (TTFT, 102.0, INTERACTIVE, True, Step(Action.FAIL_OVER, R.TTFT_TIMEOUT)),
    (TTFT, 102.0, INTERACTIVE, False, Step(Action.WAIT, R.NO_PROVIDER_OPEN, wake_at=102.0 + PROVIDER_RECHECK_S)),
    (TTFT, 102.0, BATCH, True, Step(Action.WAIT, R.PROVIDER_NOT_ALLOWED)),
    (TTFT, 102.0, BATCH_PAYS, True, Step(Action.FAIL_OVER, R.TTFT_TIMEOUT)),
    # hedge: 1.5 s after dispatch
    (HEDGE, 101.0, INTERACTIVE, True, Step(Action.WAIT, R.WAITING_FOR_TIMER, wake_at=101.5)),
    (HEDGE, 101.5, INTERACTIVE, True, Step(Action.START_HEDGE, R.HEDGE_AFTER_ELAPSED)),
    (HEDGE, 130.0, INTERACTIVE, True, Step(Action.START_HEDGE, R.HEDGE_AFTER_ELAPSED)),
    (HEDGE, 101.5, INTERACTIVE, False, Step(Action.WAIT, R.NO_PROVIDER_OPEN, wake_at=101.5 + PROVIDER_RECHECK_S)),
    (HEDGE, 101.5, BATCH, True, Step(Action.WAIT, R.PROVIDER_NOT_ALLOWED)),
    (HEDGE, 101.5, BATCH_PAYS, True, Step(Action.START_HEDGE, R.HEDGE_AFTER_ELAPSED)),
])
def test_waiting_for_the_local_first_token(timers, now, perms, open_, expected):
    assert _step(timers, SENT, now=now, perms=perms, open_=open_) == expected


def test_batch_never_hedges_without_its_tenants_permission_whatever_the_wait():
    for now in (100.0, 101.5, 200.0, 10_000.0):
        assert _step(HEDGE, SENT, now=now, perms=BATCH).action is Action.WAIT


@pytest.mark.parametrize("attempt, expected", [
    (AttemptState(100.0, hedge_started_at=101.5), Step(Action.WAIT, R.HEDGE_RACE)),
    (AttemptState(100.0, local_first_token_at=101.7, hedge_started_at=101.5), Step(Action.CANCEL_HEDGE, R.LOCAL_WON)),
    (AttemptState(100.0, hedge_started_at=101.5, hedge_first_token_at=101.9), Step(Action.CANCEL_LOCAL, R.HEDGE_WON)),
    (AttemptState(100.0, local_first_token_at=102.0, hedge_started_at=101.5, hedge_first_token_at=101.9),
     Step(Action.CANCEL_LOCAL, R.HEDGE_WON)),
    (AttemptState(100.0, local_first_token_at=101.9, hedge_started_at=101.5, hedge_first_token_at=101.9),
     Step(Action.CANCEL_HEDGE, R.LOCAL_WON)),  # a tie goes to the local attempt (already paid for)
    (AttemptState(100.0, local_error=LocalError.SERVER_ERROR, hedge_started_at=101.5),
     Step(Action.WAIT, R.LOCAL_FAILED_HEDGE_RUNS)),
    (AttemptState(100.0, local_error=LocalError.SERVER_ERROR, hedge_started_at=101.5, hedge_first_token_at=102.0),
     Step(Action.STREAM, R.HEDGE_WON)),
    (AttemptState(100.0, hedge_started_at=101.5, hedge_failed=True), Step(Action.WAIT, R.HEDGE_FAILED)),
    (AttemptState(100.0, local_first_token_at=102.0, hedge_started_at=101.5, hedge_failed=True),
     Step(Action.CANCEL_HEDGE, R.LOCAL_WON)),  # the failed hedge is gone already: cancelling it is a no-op
    (AttemptState(100.0, local_error=LocalError.UNREACHABLE, hedge_started_at=101.5, hedge_failed=True),
     Step(Action.RETURN_ERROR, R.HEDGE_FAILED)),
])
def test_hedge_race(attempt, expected):
    assert _step(HEDGE, attempt, now=102.0) == expected


def test_timers_from_config_and_their_checks():
    cfg = OverflowPolicyConfig(policy="hedge", hedge_after_ms=1200)
    assert PolicyTimers.from_config(cfg) == PolicyTimers(Policy.HEDGE, hedge_after_ms=1200)
    assert PolicyTimers.from_config(OverflowPolicyConfig()).timer_ms is None
    with pytest.raises(ValueError, match="ttft_timeout needs ttft_timeout_ms"):
        PolicyTimers(Policy.TTFT_TIMEOUT)

"""check_budget: rolling hour/day caps and the retry-after until spend rolls off."""

import pytest

from lmfleet.overflow.budget import check_budget, retry_after_s

NOW = 100_000.0


@pytest.mark.parametrize(
    "events, hourly, daily, pending, allowed, reason, retry",
    [
        ([], None, None, 0.0, True, None, 0.0),
        ([(NOW - 10, 5.0)], None, None, 0.0, True, None, 0.0),
        ([(NOW - 10, 0.5)], 1.0, None, 0.0, True, None, 0.0),
        # at the cap is exhausted; the only event leaves the hour 3590 s from now
        ([(NOW - 10, 1.0)], 1.0, None, 0.0, False, "hourly_budget_exhausted", 3590.0),
        # events outside the hour do not count
        ([(NOW - 4000, 5.0), (NOW - 10, 0.5)], 1.0, None, 0.0, True, None, 0.0),
        # three events of 0.4 (total 1.2 >= 1.0): dropping the oldest leaves 0.8 < 1.0
        ([(NOW - 3000, 0.4), (NOW - 2000, 0.4), (NOW - 1000, 0.4)], 1.0, None, 0.0, False, "hourly_budget_exhausted", 600.0),
        # 0.4 + 0.4 + 1.0: must drop the first two (leaves 1.0, still >= cap) ... all three
        ([(NOW - 3000, 0.4), (NOW - 2000, 0.4), (NOW - 1000, 1.0)], 1.0, None, 0.0, False, "hourly_budget_exhausted", 2600.0),
        # unordered input is fine
        ([(NOW - 1000, 0.4), (NOW - 3000, 0.4), (NOW - 2000, 0.4)], 1.0, None, 0.0, False, "hourly_budget_exhausted", 600.0),
        # pending in-flight spend tips it over; the event rolls off and pending alone is under the cap
        ([(NOW - 100, 0.6)], 1.0, None, 0.5, False, "hourly_budget_exhausted", 3500.0),
        # pending alone over the cap: the whole window
        ([], 1.0, None, 2.0, False, "hourly_budget_exhausted", 3600.0),
        # zero cap: never allowed
        ([], 0.0, None, 0.0, False, "hourly_budget_exhausted", 3600.0),
        # daily cap hit by old spend, hourly fine
        ([(NOW - 80_000, 10.0), (NOW - 10, 0.1)], 1.0, 10.0, 0.0, False, "daily_budget_exhausted", 6400.0),
        # both exhausted: the longer wait wins
        ([(NOW - 80_000, 10.0), (NOW - 10, 1.0)], 1.0, 10.0, 0.0, False, "daily_budget_exhausted", 6400.0),
        ([(NOW - 86_000, 10.0), (NOW - 10, 1.0)], 1.0, 10.0, 0.0, False, "hourly_budget_exhausted", 3590.0),
    ],
)
def test_check_budget(events, hourly, daily, pending, allowed, reason, retry):
    s = check_budget(events, hourly_usd=hourly, daily_usd=daily, now=NOW, pending_usd=pending)
    assert (s.allowed, s.reason) == (allowed, reason)
    assert s.retry_after_s == pytest.approx(retry)


def test_spent_figures():
    s = check_budget([(NOW - 7200, 2.0), (NOW - 60, 1.0)], hourly_usd=None, daily_usd=None, now=NOW)
    assert (s.spent_hour_usd, s.spent_day_usd) == (1.0, 3.0)


# --- the roll-off arithmetic on its own (the spend store's caps use it too) ---------------------------------

HOUR = 3600.0
CAP = 1000  # nano-dollars


@pytest.mark.parametrize(
    "events, held, amount, expected",
    [
        ([], 0, 100, 0.0),  # fits now
        ([(NOW - 3000, 600), (NOW - 1000, 400)], 0, 100, 600.0),  # first event leaves at NOW+600: 400+100 fits
        ([(NOW - 3000, 600), (NOW - 1000, 400)], 0, 700, 2600.0),  # both must leave
        ([(NOW - 1000, 400), (NOW - 3000, 600)], 0, 100, 600.0),  # oldest first, whatever the order given
        ([(NOW - 3000, 600)], 950, 100, HOUR),  # held alone blocks it: the whole window
        ([], 0, 1001, HOUR),  # over the cap by itself: never within the window
        ([(NOW - 4000, 900), (NOW - 10, 500)], 0, 500, 0.0),  # outside the window: ignored
        ([(NOW - 3600, 900)], 0, 500, 0.0),  # exactly a window old: already out
        ([(NOW - 10, 1000)], 0, 1, 3590.0),  # "spent < cap" is one nano-dollar that must fit
        ([(NOW - 10, 1)], 0, 1000, 3590.0),  # the amount fits exactly at the cap once the event leaves
    ],
)
def test_retry_after(events, held, amount, expected):
    assert retry_after_s(events, held_nusd=held, amount_nusd=amount, cap_nusd=CAP, window_s=HOUR,
                         now=NOW) == expected

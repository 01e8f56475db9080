"""Admission tables: class x estimate x limits x budget, the priority header, the 429's headers and body."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from lmfleet.config.tenants import PriorityClass, PriorityClassList, TenantLimits, default_priority_classes
from lmfleet.tenants import (
    Outcome,
    PriorityHeaderError,
    RateWindow,
    Reason,
    Tenant,
    TenantUsage,
    admit,
    model_refusal,
    rate_limit_headers,
    requested_class,
)

CLASSES = default_priority_classes()
INTERACTIVE, BATCH = CLASSES
NOW = 1_000_040.0  # 20 s into the fixed minute window that starts at 1_000_020 (16667 * 60)
THRESHOLD = 2500.0


def _tenant(*, priority=INTERACTIVE, top=None, pay=False, models=(), **limits) -> Tenant:
    return Tenant("acme", TenantLimits(**limits), priority, top or priority, frozenset(models), pay)


# ---- the priority header -------------------------------------------------------------------------------------

THREE = TypeAdapter(PriorityClassList).validate_python([{"name": "realtime", "order": 0},
                                                        {"name": "interactive", "order": 5},
                                                        {"name": "batch", "order": 9, "max_wait_s": 600}])
REALTIME, MID, LOW = THREE


@pytest.mark.parametrize("header, priority, top, want", [
    (None, MID, MID, "interactive"),  # no header: the tenant's default
    ("", LOW, MID, "batch"),
    ("  ", LOW, MID, "batch"),
    ("batch", MID, MID, "batch"),  # asking for less is always allowed
    ("BATCH ", MID, MID, "batch"),
    ("interactive", LOW, MID, "interactive"),  # up to max_priority
    ("realtime", LOW, MID, "interactive"),  # capped at max_priority
    ("realtime", MID, REALTIME, "realtime"),
    ("realtime", LOW, LOW, "batch"),  # a batch-only tenant stays batch
])
def test_requested_class(header, priority, top, want):
    assert requested_class(header, _tenant(priority=priority, top=top), THREE).name == want


@pytest.mark.parametrize("header", ["urgent", "inter active", "x" * 500])
def test_unknown_class_is_a_400(header):
    with pytest.raises(PriorityHeaderError) as info:
        requested_class(header, _tenant(), THREE)
    e = info.value
    assert e.status == 400
    err = e.body()["error"]
    assert err["param"] == "x-lmfleet-priority" and err["code"] == "invalid_priority"
    assert err["type"] == "invalid_request_error" and "realtime" in err["message"] and len(err["message"]) < 200


def test_model_refusal():
    t = _tenant(models=["smollm2"])
    assert model_refusal(t, "smollm2") is None and model_refusal(_tenant(), "any") is None
    err = model_refusal(t, "tiny")["error"]
    assert (err["type"], err["code"], err["param"]) == ("permission_error", "model_not_allowed", "model")


# ---- admission -------------------------------------------------------------------------------------------------

def _usage(rpm=None, tpm=None, requests=0, tokens=0) -> TenantUsage:
    r = RateWindow(rpm).add(NOW - 5, requests) if rpm else None
    t = RateWindow(tpm).add(NOW - 5, tokens) if tpm else None
    return TenantUsage(r, t)


# cls, estimate_ms, provider_ok, budget_left, pay -> outcome, reason, deadline
ROUTES = [
    (INTERACTIVE, 100.0, True, None, False, Outcome.LOCAL_NOW, Reason.LOCAL_OK, None),
    (INTERACTIVE, 2500.0, True, None, False, Outcome.LOCAL_NOW, Reason.LOCAL_OK, None),  # at the bar: local
    (INTERACTIVE, 2501.0, True, None, False, Outcome.PROVIDER, Reason.OVER_THRESHOLD, None),
    (INTERACTIVE, 9000.0, True, 0.5, False, Outcome.PROVIDER, Reason.OVER_THRESHOLD, None),
    (INTERACTIVE, 9000.0, False, None, False, Outcome.LOCAL_WAIT, Reason.NO_PROVIDER, None),
    (INTERACTIVE, 9000.0, True, 0.0, False, Outcome.LOCAL_WAIT, Reason.NO_PROVIDER, None),  # tenant budget spent
    (INTERACTIVE, 9e6, True, -1.0, True, Outcome.LOCAL_WAIT, Reason.NO_PROVIDER, None),
    (BATCH, 100.0, True, None, False, Outcome.LOCAL_NOW, Reason.LOCAL_OK, None),
    (BATCH, 9000.0, True, None, False, Outcome.LOCAL_WAIT, Reason.WITHIN_DEADLINE, 600.0),  # never paid by default
    (BATCH, 9000.0, True, None, True, Outcome.LOCAL_WAIT, Reason.WITHIN_DEADLINE, 600.0),  # local first even if allowed
    (BATCH, 600_000.0, True, None, False, Outcome.LOCAL_WAIT, Reason.WITHIN_DEADLINE, 600.0),
    (BATCH, 600_001.0, True, None, True, Outcome.PROVIDER, Reason.OVER_DEADLINE, None),
    (BATCH, 600_001.0, True, 3.0, True, Outcome.PROVIDER, Reason.OVER_DEADLINE, None),
    (BATCH, 600_001.0, True, None, False, Outcome.REJECT, Reason.DEADLINE, None),  # may not pay
    (BATCH, 600_001.0, False, None, True, Outcome.REJECT, Reason.DEADLINE, None),  # no provider
    (BATCH, 600_001.0, True, 0.0, True, Outcome.REJECT, Reason.DEADLINE, None),  # tenant budget spent
]


@pytest.mark.parametrize("cls, estimate, provider_ok, budget_left, pay, outcome, reason, deadline", ROUTES)
def test_routes(cls, estimate, provider_ok, budget_left, pay, outcome, reason, deadline):
    a = admit(_tenant(pay=pay), cls, usage=TenantUsage(), in_flight=0, estimate_ms=estimate,
              threshold_ms=THRESHOLD, provider_ok=provider_ok, budget_left_usd=budget_left, now=NOW)
    assert (a.outcome, a.reason, a.deadline_s, a.priority) == (outcome, reason, deadline, cls.name)
    assert (a.status == 429) is (outcome is Outcome.REJECT)
    assert (a.body() is None) is (outcome is not Outcome.REJECT)


# limits, usage, in_flight, prompt_tokens -> reason (None: admitted)
LIMITS = [
    ({}, _usage(), 10_000, 10_000, None),
    ({"max_concurrency": 4}, _usage(), 3, 10, None),
    ({"max_concurrency": 4}, _usage(), 4, 10, Reason.CONCURRENCY_LIMIT),
    ({"max_concurrency": 4, "requests_per_minute": 1}, _usage(rpm=1, requests=1), 9, 10, Reason.CONCURRENCY_LIMIT),
    ({"requests_per_minute": 3}, _usage(rpm=3, requests=2), 0, 10, None),
    ({"requests_per_minute": 3}, _usage(rpm=3, requests=3), 0, 10, Reason.REQUESTS_PER_MINUTE),
    ({"requests_per_minute": 3, "tokens_per_minute": 10}, _usage(rpm=3, tpm=10, requests=3, tokens=10), 0, 10,
     Reason.REQUESTS_PER_MINUTE),  # requests are checked before tokens
    ({"tokens_per_minute": 1000}, _usage(tpm=1000, tokens=900), 0, 100, None),
    ({"tokens_per_minute": 1000}, _usage(tpm=1000, tokens=900), 0, 101, Reason.TOKENS_PER_MINUTE),
    ({"tokens_per_minute": 1000}, _usage(tpm=1000), 0, 5000, None),  # an empty window admits any one request
    ({"tokens_per_minute": 1000}, _usage(tpm=1000, tokens=1), 0, 5000, Reason.TOKENS_PER_MINUTE),
]


@pytest.mark.parametrize("limits, usage, in_flight, prompt, reason", LIMITS)
@pytest.mark.parametrize("cls", CLASSES)
def test_limits_come_first(limits, usage, in_flight, prompt, reason, cls):
    a = admit(_tenant(**limits), cls, usage=usage, in_flight=in_flight, estimate_ms=10.0, threshold_ms=THRESHOLD,
              provider_ok=True, budget_left_usd=None, now=NOW, prompt_tokens=prompt)
    if reason is None:
        assert a.outcome is Outcome.LOCAL_NOW and "retry-after" not in a.headers
    else:
        assert (a.outcome, a.reason, a.status) == (Outcome.REJECT, reason, 429)
        assert int(a.headers["retry-after"]) >= 1


def test_429_for_requests_per_minute_looks_like_openai():
    usage = _usage(rpm=3, requests=3)
    a = admit(_tenant(requests_per_minute=3), INTERACTIVE, usage=usage, in_flight=0, estimate_ms=0.0,
              threshold_ms=THRESHOLD, provider_ok=True, budget_left_usd=None, now=NOW)
    # 3 requests at NOW-5 (15 s into the window): room for one more when a third of the next window has passed
    assert a.retry_after_s == pytest.approx(60 - 20 + 20)
    assert a.headers == {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0",
                         "x-ratelimit-reset-requests": "1m40s", "retry-after": "60"}
    err = a.body()["error"]
    assert (err["type"], err["code"], err["param"]) == ("requests", "rate_limit_exceeded", None)
    assert err["message"].startswith("Rate limit reached for tenant 'acme' on requests per min (RPM): Limit 3, Used 3")
    assert err["message"].endswith("Please try again in 1m0s.")


def test_429_for_tokens_and_concurrency_and_deadline_bodies():
    tok = admit(_tenant(tokens_per_minute=100), BATCH, usage=_usage(tpm=100, tokens=100), in_flight=0,
                estimate_ms=0.0, threshold_ms=THRESHOLD, provider_ok=True, budget_left_usd=None, now=NOW,
                prompt_tokens=1)
    assert tok.body()["error"]["type"] == "tokens" and tok.headers["x-ratelimit-limit-tokens"] == "100"
    conc = admit(_tenant(max_concurrency=1), BATCH, usage=TenantUsage(), in_flight=1, estimate_ms=0.0,
                 threshold_ms=THRESHOLD, provider_ok=True, budget_left_usd=None, now=NOW)
    assert conc.body()["error"]["code"] == "concurrency_limit_exceeded" and conc.headers == {"retry-after": "1"}
    late = admit(_tenant(), BATCH, usage=TenantUsage(), in_flight=0, estimate_ms=660_000.0, threshold_ms=THRESHOLD,
                 provider_ok=True, budget_left_usd=None, now=NOW)
    assert late.body()["error"]["code"] == "queue_deadline_exceeded" and late.headers["retry-after"] == "60"
    assert "predicted wait 660 s, its deadline is 600 s" in late.body()["error"]["message"]


@pytest.mark.parametrize("usage, want", [
    (TenantUsage(), {}),
    (_usage(rpm=10, requests=4), {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "6",
                                  "x-ratelimit-reset-requests": "1m40s"}),
    (_usage(tpm=1000), {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "1000",
                        "x-ratelimit-reset-tokens": "0ms"}),
])
def test_rate_limit_headers(usage, want):
    assert rate_limit_headers(usage, NOW) == want


def test_admitted_answers_carry_the_headers_too():
    a = admit(_tenant(requests_per_minute=10), INTERACTIVE, usage=_usage(rpm=10, requests=4), in_flight=0,
              estimate_ms=0.0, threshold_ms=THRESHOLD, provider_ok=True, budget_left_usd=None, now=NOW)
    assert a.outcome is Outcome.LOCAL_NOW and a.headers["x-ratelimit-remaining-requests"] == "6"


def test_usage_records():
    u = TenantUsage.for_limits(TenantLimits(requests_per_minute=5, tokens_per_minute=100))
    u = u.record_request(NOW).record_tokens(NOW, 40).record_tokens(NOW, 0)
    assert u.requests.used(NOW) == 1 and u.tokens.used(NOW) == 40
    none = TenantUsage.for_limits(TenantLimits())
    assert none.record_request(NOW).record_tokens(NOW, 5) == TenantUsage()


def test_flood_then_admit_exactly_the_limit():
    """A tenant sending 2N requests at once with requests_per_minute N gets exactly N through."""
    n = 7
    t = _tenant(requests_per_minute=n)
    usage, admitted = TenantUsage.for_limits(t.limits), 0
    for i in range(2 * n):
        a = admit(t, INTERACTIVE, usage=usage, in_flight=0, estimate_ms=0.0, threshold_ms=THRESHOLD,
                  provider_ok=False, budget_left_usd=None, now=NOW + i * 0.01)
        if a.outcome is not Outcome.REJECT:
            admitted += 1
            usage = usage.record_request(NOW + i * 0.01)
    assert admitted == n


def test_operator_class_with_deadline_behaves_like_batch():
    nightly = PriorityClass(name="nightly", order=50, max_wait_s=30)
    a = admit(_tenant(), nightly, usage=TenantUsage(), in_flight=0, estimate_ms=20_000.0, threshold_ms=THRESHOLD,
              provider_ok=True, budget_left_usd=None, now=NOW)
    assert (a.outcome, a.deadline_s) == (Outcome.LOCAL_WAIT, 30.0)

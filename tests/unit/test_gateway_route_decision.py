"""route_plan, the route decision as one pure function: tables of policies x tenant classes x budget states x health.

The tenant's admission, where the plan asks for it, is answered by the real :func:`lmfleet.tenants.admit` (pure
too) with the numbers the plan asked with, as :meth:`lmfleet.tenants.TenantBook.enter` does.
"""

from __future__ import annotations

import itertools

import pytest

from lmfleet.config.tenants import TenantLimits, default_priority_classes
from lmfleet.gateway.routing.decision import LOCAL, RouteInputs, RoutePlan, route_plan
from lmfleet.overflow import BudgetStatus, HysteresisState, OverflowMode, ProviderCandidate, Reason
from lmfleet.overflow.policies import Policy
from lmfleet.tenants import PRIORITY_HEADER, Tenant, TenantUsage, admit

INTERACTIVE, BATCH = default_priority_classes()  # batch: max_wait_s 600
THRESHOLD = 2000.0
NOW = 1_000_040.0

A, B = (ProviderCandidate(n, {"m": f"{n}-m"}, True) for n in ("a", "b"))
HEALTH = {
    "up": (True, (A, B)),
    "local_down": (False, (A, B)),
    "a_down": (True, (ProviderCandidate("a", {"m": "a-m"}, False), B)),
    "providers_down": (True, (ProviderCandidate("a", {"m": "a-m"}, False), ProviderCandidate("b", {"m": "b-m"}, False))),
    "providers_full": (True, (ProviderCandidate("a", {"m": "a-m"}, True, 1, 1), ProviderCandidate("b", {"m": "b-m"}, True, 2, 2))),
    "all_down": (False, (ProviderCandidate("a", {"m": "a-m"}, False), ProviderCandidate("b", {"m": "b-m"}, False))),
}
OK = BudgetStatus(True, None, 0.0, 1.0, 2.0)
SPENT = BudgetStatus(False, "hourly_budget_exhausted", 30.0, 10.0, 20.0)
BUDGETS = {  # budget status, on_exhausted, store down
    "ok": (OK, "queue", False),
    "none": (None, "queue", False),
    "spent_queue": (SPENT, "queue", False),
    "spent_reject": (SPENT, "reject", False),
    "store_down_queue": (OK, "queue", True),
    "store_down_reject": (OK, "reject", True),
}
TENANTS = {
    "none": None,
    "interactive": (Tenant("t", TenantLimits(), INTERACTIVE, INTERACTIVE), INTERACTIVE),
    "interactive_limited": (Tenant("t", TenantLimits(max_concurrency=2), INTERACTIVE, INTERACTIVE), INTERACTIVE),
    "batch": (Tenant("t", TenantLimits(), BATCH, INTERACTIVE), BATCH),
    "batch_pays": (Tenant("t", TenantLimits(), BATCH, INTERACTIVE, batch_may_use_providers=True), BATCH),
}


def _inputs(policy="predictive", tenant="none", budget="ok", health="up", estimate=500.0, **kw) -> RouteInputs:
    ready, candidates = HEALTH[health]
    status, on_exhausted, store_down = BUDGETS[budget]
    t = TENANTS[tenant]
    who = {} if t is None else {"tenant": t[0], "cls": t[1], "has_queue": True,
                                "tenant_limited": t[0].limits.max_concurrency is not None,
                                "class_headers": {PRIORITY_HEADER: t[1].name}}
    return RouteInputs("m", estimate, THRESHOLD, hysteresis=0.2, policy=Policy(policy), budget=status,
                       on_exhausted=on_exhausted, candidates=candidates, store_down=store_down, local_ready=ready,
                       **{**who, **kw})


def _plan(inp: RouteInputs, in_flight: int = 0) -> RoutePlan:
    """The plan, with the tenant's admission answered as the book would (nothing counted before)."""
    p = route_plan(inp)
    if p.ask is None:
        return p
    assert inp.tenant is not None and inp.cls is not None
    a = admit(inp.tenant, inp.cls, usage=TenantUsage.for_limits(inp.tenant.limits), in_flight=in_flight,
              estimate_ms=p.ask.estimate_ms, threshold_ms=p.ask.threshold_ms, provider_ok=p.ask.provider_ok,
              budget_left_usd=None, now=NOW)
    return route_plan(inp, a)


R = Reason
L = LOCAL


@pytest.mark.parametrize("policy, tenant, budget, health, estimate, extra, want", [
    # no tenant: today's route() and _policy_admission()
    ("predictive", "none", "ok", "up", 500, {}, ((L, "a", "b"), R.LOCAL_OK)),
    ("predictive", "none", "none", "up", 500, {}, ((L, "a", "b"), R.LOCAL_OK)),
    ("predictive", "none", "ok", "up", 3000, {}, (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("hedge", "none", "ok", "up", 3000, {}, (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("ttft_timeout", "none", "ok", "up", 3000, {}, ((L, "a", "b"), R.LOCAL_FIRST)),
    ("on_error", "none", "ok", "up", 3000, {}, ((L, "a", "b"), R.LOCAL_FIRST)),
    ("ttft_timeout", "none", "ok", "up", 500, {}, ((L, "a", "b"), R.LOCAL_OK)),
    ("predictive", "none", "spent_queue", "up", 3000, {}, ((L,), R.BUDGET_EXHAUSTED)),
    ("predictive", "none", "spent_reject", "up", 3000, {}, ("budget_exhausted", "30")),
    ("predictive", "none", "store_down_queue", "up", 3000, {}, ((L,), R.BUDGET_STORE_DOWN)),
    ("predictive", "none", "store_down_reject", "up", 3000, {}, ("budget_exhausted", "10")),
    ("predictive", "none", "spent_reject", "up", 500, {}, ((L,), R.LOCAL_OK)),  # no pressure: budget not asked
    ("on_error", "none", "spent_reject", "up", 3000, {}, ("budget_exhausted", "30")),
    ("predictive", "none", "ok", "local_down", 500, {}, (("a", "b", L), R.LOCAL_UNAVAILABLE)),
    ("ttft_timeout", "none", "ok", "local_down", 500, {}, (("a", "b", L), R.LOCAL_UNAVAILABLE)),
    ("predictive", "none", "spent_queue", "local_down", 500, {}, ((L,), R.BUDGET_EXHAUSTED)),
    ("predictive", "none", "ok", "all_down", 500, {}, ((L,), R.NO_HEALTHY_PROVIDER)),
    ("predictive", "none", "ok", "a_down", 3000, {}, (("b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("predictive", "none", "ok", "providers_down", 3000, {}, ((L,), R.NO_HEALTHY_PROVIDER)),
    ("predictive", "none", "ok", "providers_full", 3000, {}, ((L, "a", "b"), R.PROVIDERS_AT_CAPACITY)),
    ("predictive", "none", "ok", "up", 1800, {"state": HysteresisState(True)},
     (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),  # within the band while overflowing
    ("predictive", "none", "ok", "up", 1500, {"state": HysteresisState(True)}, ((L, "a", "b"), R.LOCAL_OK)),
    ("predictive", "none", "ok", "up", 1800, {"peers_overflowing": True},
     (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("predictive", "none", "ok", "up", 1500, {"margin_ms": 600}, (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("predictive", "none", "ok", "up", 900, {"margin_ms": 1200}, ((L, "a", "b"), R.LOCAL_OK)),  # below the band
    ("predictive", "none", "ok", "up", 3000, {"mode": OverflowMode.FORCE_OFF}, ((L,), R.FORCED_LOCAL)),
    ("predictive", "none", "ok", "local_down", 3000, {"mode": OverflowMode.FORCE_OFF}, ((L,), R.FORCED_LOCAL)),
    ("predictive", "none", "ok", "up", 3000, {"enabled": False}, ((L, "a", "b"), R.OVERFLOW_DISABLED)),
    ("predictive", "none", "ok", "up", 500, {"mode": OverflowMode.FORCE_ON}, (("a", "b", L), R.FORCED_OVERFLOW)),
    ("predictive", "none", "ok", "up", 500, {"mode": OverflowMode.FORCE_ON, "enabled": False},
     (("a", "b", L), R.FORCED_OVERFLOW)),
    # an interactive tenant: today's _admit() without limits, then with them
    ("predictive", "interactive", "ok", "up", 3000, {}, (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("ttft_timeout", "interactive", "ok", "up", 3000, {}, ((L, "a", "b"), R.LOCAL_FIRST)),
    ("predictive", "interactive", "spent_reject", "up", 3000, {}, ("budget_exhausted", "30")),
    ("predictive", "interactive_limited", "ok", "up", 500, {}, ((L, "a", "b"), R.LOCAL_OK)),
    ("predictive", "interactive_limited", "ok", "up", 3000, {}, (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("predictive", "interactive_limited", "ok", "up", 3000, {"in_flight": 2}, ("concurrency_limit_exceeded", "1")),
    ("on_error", "interactive_limited", "ok", "up", 3000, {}, ((L, "a", "b"), R.LOCAL_FIRST)),
    ("predictive", "interactive_limited", "spent_reject", "up", 3000, {}, ("budget_exhausted", "30")),
    ("hedge", "interactive_limited", "store_down_queue", "up", 3000, {}, ((L,), R.BUDGET_STORE_DOWN)),
    # a batch class (max_wait_s 600): held locally within its deadline, a provider only when its tenant pays
    ("predictive", "batch", "ok", "up", 500, {}, ((L,), R.LOCAL_OK)),
    ("predictive", "batch", "ok", "up", 3000, {}, ((L,), R.WITHIN_DEADLINE)),
    ("ttft_timeout", "batch", "ok", "up", 3000, {}, ((L,), R.WITHIN_DEADLINE)),  # the deadline rules, not the policy
    ("hedge", "batch", "ok", "up", 700_000, {}, ("queue_deadline_exceeded", "100")),
    ("predictive", "batch", "ok", "local_down", 500, {}, ((L,), R.WITHIN_DEADLINE)),
    ("predictive", "batch", "spent_reject", "up", 3000, {}, ((L,), R.WITHIN_DEADLINE)),
    ("predictive", "batch", "ok", "up", 3000, {"in_flight": 5}, ((L,), R.WITHIN_DEADLINE)),  # no limits
    ("predictive", "batch_pays", "ok", "up", 500, {}, ((L, "a", "b"), R.LOCAL_OK)),
    ("predictive", "batch_pays", "ok", "up", 3000, {}, ((L, "a", "b"), R.WITHIN_DEADLINE)),
    ("predictive", "batch_pays", "ok", "up", 700_000, {}, (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("on_error", "batch_pays", "ok", "up", 700_000, {}, (("a", "b", L), R.QUEUE_ESTIMATE_ABOVE_THRESHOLD)),
    ("predictive", "batch_pays", "ok", "local_down", 500, {}, (("a", "b", L), R.LOCAL_UNAVAILABLE)),
    ("predictive", "batch_pays", "spent_queue", "up", 3000, {}, ((L,), R.BUDGET_EXHAUSTED)),
    ("predictive", "batch_pays", "store_down_reject", "up", 3000, {}, ((L,), R.WITHIN_DEADLINE)),
    ("predictive", "batch_pays", "ok", "providers_down", 700_000, {}, ("queue_deadline_exceeded", "100")),
])
def test_route_plan_table(policy, tenant, budget, health, estimate, extra, want):
    in_flight = extra.pop("in_flight", 0)
    p = _plan(_inputs(policy, tenant, budget, health, estimate, **extra), in_flight)
    if isinstance(want[0], str):  # a 429: (code, retry-after)
        assert p.refusal is not None, p
        assert (p.refusal.code, p.refusal.headers["retry-after"]) == want
        assert p.counted is not None and p.counted[0] == "reject"
        return
    assert p.refusal is None, p.refusal
    assert (p.order, p.reason) == want
    assert p.counted == (p.order[0], p.reason)  # the overflow metric's labels
    if tenant != "none":
        assert p.headers[PRIORITY_HEADER] == TENANTS[tenant][1].name
        # counted once: by the admission when the plan asked for one, else by a ticket taken now
        assert p.take_ticket is (route_plan(_inputs(policy, tenant, budget, health, estimate, **extra)).ask is None)
    else:
        assert not p.take_ticket and not p.headers


@pytest.mark.parametrize("estimate, margin, overflowing, peers, want_estimate, want_bar", [
    (1000.0, 0.0, False, False, 1000.0, 2000.0),
    (1000.0, 600.0, False, False, 1600.0, 2000.0),   # in the margin's band: weighed
    (900.0, 600.0, False, False, 900.0, 2000.0),     # below it: the estimate alone
    (1800.0, 0.0, True, False, 1800.0, 1600.0),      # overflowing: the lower bar
    (1800.0, 300.0, False, True, 2100.0, 1600.0),    # a peer overflowing: the lower bar too
])
def test_one_threshold_semantics(estimate, margin, overflowing, peers, want_estimate, want_bar):
    """The tenant's admission is asked with the numbers the route weighs: the estimate plus the applied margin,
    against the bar with hysteresis applied."""
    inp = _inputs(tenant="interactive_limited", estimate=estimate, margin_ms=margin,
                  state=HysteresisState(overflowing), peers_overflowing=peers)
    ask = route_plan(inp).ask
    assert ask is not None
    assert (ask.estimate_ms, ask.threshold_ms) == (want_estimate, want_bar)
    assert ask.provider_ok is (want_estimate > want_bar)


@pytest.mark.parametrize("tenant, has_queue, moves", [
    ("none", False, True), ("interactive", True, True), ("batch", True, False), ("batch", False, True),
])
def test_hysteresis_state_moves_unless_batch_behind_a_queue(tenant, has_queue, moves):
    p = route_plan(_inputs(tenant=tenant, estimate=3000, has_queue=has_queue))
    assert p.state == (HysteresisState(True) if moves else None)


@pytest.mark.parametrize("policy, tenant, budget, health, estimate", list(itertools.product(
    [p.value for p in Policy], list(TENANTS), list(BUDGETS), list(HEALTH), [500.0, 3000.0, 700_000.0])))
def test_route_plan_invariants(policy, tenant, budget, health, estimate):
    """Every combination: what must hold whatever the rule that decided it."""
    inp = _inputs(policy, tenant, budget, health, estimate)
    p = _plan(inp)
    assert p.ask is None and p.counted is not None
    t = TENANTS[tenant]
    batch_local_only = t is not None and t[1].max_wait_s is not None and not t[0].batch_may_use_providers
    if p.refusal is not None:
        assert p.order == () and int(p.refusal.headers["retry-after"]) >= 1
        return
    assert p.order.count(L) == 1, p.order
    providers = [n for n in p.order if n != L]
    healthy = {c.name for c in inp.candidates if c.healthy}
    assert set(providers) <= healthy and len(set(providers)) == len(providers)
    if batch_local_only:
        assert providers == []  # never a provider, not even as a fallback
    status, _, store_down = BUDGETS[budget]
    if store_down or (status is not None and not status.allowed):
        assert providers == []  # paid providers closed
    if policy in ("ttft_timeout", "on_error") and inp.local_ready and (t is None or t[1].max_wait_s is None):
        assert p.order[0] == L  # local first
    if estimate <= THRESHOLD and inp.local_ready and t is None:
        assert (p.order[0], p.reason) == (L, R.LOCAL_OK)

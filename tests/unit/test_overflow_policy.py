"""decide(): every route and reason, hysteresis, provider choice."""

import pytest

from lmfleet.overflow.budget import BudgetStatus
from lmfleet.overflow.policy import HysteresisState, OverflowMode, ProviderCandidate, Reason, decide

OK = BudgetStatus(True, None, 0.0, 0.0, 0.0)
SPENT = BudgetStatus(False, "hourly_budget_exhausted", 120.0, 5.0, 5.0)
A = ProviderCandidate("a", {"m": "a-model"}, healthy=True)
A_DOWN = ProviderCandidate("a", {"m": "a-model"}, healthy=False)
A_FULL = ProviderCandidate("a", {"m": "a-model"}, healthy=True, in_flight=4, max_concurrency=4)
B = ProviderCandidate("b", {"m": "b-model"}, healthy=True, in_flight=1, max_concurrency=4)
OTHER = ProviderCandidate("c", {"other": "x"}, healthy=True)


@pytest.mark.parametrize(
    "estimate, overflowing, mode, enabled, budget, on_exhausted, candidates, target, reason, model_out, retry, next_over,"
    " store_down",
    [
        # below threshold -> local
        (1000, False, "auto", True, OK, "queue", [A], "local", Reason.LOCAL_OK, None, None, False, False),
        # exactly at threshold is not above it
        (2500, False, "auto", True, OK, "queue", [A], "local", Reason.LOCAL_OK, None, None, False, False),
        # above -> first provider
        (3000, False, "auto", True, OK, "queue", [A, B], "a", Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD, "a-model", None, True, False),
        # hysteresis: overflowing, 2100 > 2500*0.8=2000 -> keep overflowing
        (2100, True, "auto", True, OK, "queue", [A], "a", Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD, "a-model", None, True, False),
        # hysteresis: overflowing, 1900 < 2000 -> back to local
        (1900, True, "auto", True, OK, "queue", [A], "local", Reason.LOCAL_OK, None, None, False, False),
        # not overflowing, 2100 < 2500 -> local
        (2100, False, "auto", True, OK, "queue", [A], "local", Reason.LOCAL_OK, None, None, False, False),
        # operator switches
        (9000, True, "force_off", True, OK, "queue", [A], "local", Reason.FORCED_LOCAL, None, None, False, False),
        (0, False, "force_on", True, OK, "queue", [A], "a", Reason.FORCED_OVERFLOW, "a-model", None, False, False),
        (9000, False, "auto", False, OK, "queue", [A], "local", Reason.OVERFLOW_DISABLED, None, None, False, False),
        # budget exhausted: queue locally or reject with retry-after; pressure is remembered
        (9000, False, "auto", True, SPENT, "queue", [A], "local", Reason.BUDGET_EXHAUSTED, None, None, True, False),
        (9000, False, "auto", True, SPENT, "reject", [A], "reject", Reason.BUDGET_EXHAUSTED, None, 120.0, True, False),
        (0, False, "force_on", True, SPENT, "reject", [A], "reject", Reason.BUDGET_EXHAUSTED, None, 120.0, False, False),
        # exhausted budget is irrelevant when staying local
        (100, False, "auto", True, SPENT, "reject", [A], "local", Reason.LOCAL_OK, None, None, False, False),
        # budget store down (no reservation can be held): like an exhausted budget, with a fixed retry-after
        (9000, False, "auto", True, OK, "queue", [A], "local", Reason.BUDGET_STORE_DOWN, None, None, True, True),
        (9000, False, "auto", True, OK, "reject", [A], "reject", Reason.BUDGET_STORE_DOWN, None, 10.0, True, True),
        (0, False, "force_on", True, None, "reject", [A], "reject", Reason.BUDGET_STORE_DOWN, None, 10.0, False, True),
        (100, False, "auto", True, OK, "reject", [A], "local", Reason.LOCAL_OK, None, None, False, True),
        (9000, False, "force_off", True, OK, "reject", [A], "local", Reason.FORCED_LOCAL, None, None, False, True),
        # an exhausted budget's own retry-after wins over the store's
        (9000, False, "auto", True, SPENT, "reject", [A], "reject", Reason.BUDGET_EXHAUSTED, None, 120.0, True, True),
        # providers: unhealthy skipped, full skipped, model must be mapped
        (9000, False, "auto", True, OK, "queue", [A_DOWN, B], "b", Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD, "b-model", None, True, False),
        (9000, False, "auto", True, OK, "queue", [A_FULL, B], "b", Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD, "b-model", None, True, False),
        (9000, False, "auto", True, OK, "queue", [A_DOWN], "local", Reason.NO_HEALTHY_PROVIDER, None, None, True, False),
        (9000, False, "auto", True, OK, "queue", [OTHER], "local", Reason.NO_HEALTHY_PROVIDER, None, None, True, False),
        (9000, False, "auto", True, OK, "queue", [], "local", Reason.NO_HEALTHY_PROVIDER, None, None, True, False),
        (9000, False, "auto", True, OK, "queue", [A_FULL], "local", Reason.PROVIDERS_AT_CAPACITY, None, None, True, False),
        # no budget configured at all
        (9000, False, "auto", True, None, "queue", [A], "a", Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD, "a-model", None, True, False),
    ],
)
def test_decide(estimate, overflowing, mode, enabled, budget, on_exhausted, candidates, target, reason, model_out,
                retry, next_over, store_down):
    d = decide(model="m", estimate_ms=estimate, threshold_ms=2500, hysteresis=0.2,
               state=HysteresisState(overflowing), mode=OverflowMode(mode), enabled=enabled, budget=budget,
               on_exhausted=on_exhausted, candidates=candidates, store_down=store_down)
    # model_out: the chosen provider's name for the model (the gateway reads it from that provider's model_map)
    mapped = next(c.model_map["m"] for c in candidates if c.name == d.target) if d.is_provider else None
    assert (d.target, d.reason, mapped, d.retry_after_s, d.state.overflowing) == (
        target, reason, model_out, retry, next_over)


def test_state_sequence_does_not_flap():
    state, targets = HysteresisState(), []
    for est in [1000, 2600, 2400, 2200, 2050, 1990, 2400, 2600]:
        d = decide(model="m", estimate_ms=est, threshold_ms=2500, hysteresis=0.2, state=state, candidates=[A])
        state = d.state
        targets.append(d.target)
    assert targets == ["local", "a", "a", "a", "a", "local", "local", "a"]


@pytest.mark.parametrize(
    "estimate, own, peers, target, next_over",
    [
        # inside the band (2000 < est <= 2500): a peer overflowing lowers this gateway's bar too
        (2200, False, True, "a", True),
        (2200, False, False, "local", False),
        (2200, True, False, "a", True),
        # below the band: nobody's state keeps the route open
        (1900, False, True, "local", False),
        (1900, True, True, "local", False),
        # above the threshold: pressure either way
        (2600, False, False, "a", True),
        (2600, False, True, "a", True),
    ],
)
def test_peers_share_the_hysteresis_band(estimate, own, peers, target, next_over):
    d = decide(model="m", estimate_ms=estimate, threshold_ms=2500, hysteresis=0.2, state=HysteresisState(own),
               candidates=[A], peers_overflowing=peers)
    assert (d.target, d.state.overflowing) == (target, next_over)


def test_two_gateways_in_the_band_route_alike():
    """Gateway a entered the band from above (overflowing), b from below: with the shared flag both overflow."""
    a, b = HysteresisState(True), HysteresisState(False)
    da = decide(model="m", estimate_ms=2300, threshold_ms=2500, hysteresis=0.2, state=a, candidates=[A],
                peers_overflowing=b.overflowing)
    db = decide(model="m", estimate_ms=2300, threshold_ms=2500, hysteresis=0.2, state=b, candidates=[A],
                peers_overflowing=a.overflowing)
    assert da.target == db.target == "a"


@pytest.mark.parametrize("target, local, reject, provider",
                         [("local", True, False, False), ("reject", False, True, False), ("a", False, False, True)])
def test_decision_helpers(target, local, reject, provider):
    from lmfleet.overflow.policy import RouteDecision

    d = RouteDecision(target, Reason.LOCAL_OK, HysteresisState())
    assert (d.is_local, d.is_reject, d.is_provider) == (local, reject, provider)


def test_reason_values_are_the_documented_strings():
    assert Reason.QUEUE_ESTIMATE_ABOVE_THRESHOLD == "queue_estimate_above_threshold"
    assert Reason.BUDGET_EXHAUSTED.value == "budget_exhausted"
    assert Reason.BUDGET_STORE_DOWN.value == "budget_store_down"


def _fleet_parts(overflow_providers):
    from lmfleet.config.models import ModelConfig, ProviderConfig

    model = ModelConfig(name="m", source="builtin:tiny-random", overflow={"providers": overflow_providers})
    provs = [ProviderConfig(name=n, base_url="http://x/v1", model_map=mm)
             for n, mm in [("p1", {"m": "a"}), ("p2", {"other": "b"}), ("p3", {"m": "c"})]]
    return model, provs


@pytest.mark.parametrize(
    "overflow_providers, expected",
    [(None, ["p1", "p3"]), (["p3", "p1"], ["p3", "p1"]), (["p2"], []), (["p3", "gone"], ["p3"])],
)
def test_providers_for(overflow_providers, expected):
    from lmfleet.overflow.policy import providers_for

    model, provs = _fleet_parts(overflow_providers)
    assert [p.name for p in providers_for(model, provs)] == expected


@pytest.mark.parametrize("name", ["local", "reject"])
def test_reserved_provider_names(name):
    from pydantic import ValidationError

    from lmfleet.config.models import ProviderConfig

    with pytest.raises(ValidationError, match="reserved"):
        ProviderConfig(name=name, base_url="http://x/v1", model_map={"m": "a"})

"""Rent or buy, per model, on ledger rows whose answers are known by hand."""

from __future__ import annotations

import pytest

from lmfleet.config.models import ModelConfig
from lmfleet.overflow.advise import HOUR_S, AdviceRow, LedgerFacts, advise, replica_hour_nusd
from lmfleet.overflow.money import usd_to_nusd

USD = usd_to_nusd(1.0)
H0 = 1_700_000_000 // HOUR_S * HOUR_S  # the start of a clock hour


def _p(hour: int, usd: float, out: int = 1000, model: str = "m") -> LedgerFacts:
    return LedgerFacts(H0 + hour * HOUR_S + 10, model, "provider", usd_to_nusd(usd), 100, out)


def _l(hour: int, out: int = 1000, model: str = "m") -> LedgerFacts:
    return LedgerFacts(H0 + hour * HOUR_S + 10, model, "local", 0, 100, out)


@pytest.mark.parametrize("rows, hourly_usd, expected", [
    # one hour of $3 overflow against a $2/h replica: over, and buying wins
    ([_p(0, 1.0), _p(0, 2.0)], 2.0,
     dict(hours=1, hours_over=1, overflow_nusd=3 * USD, replica_nusd=2 * USD, overflow_over_nusd=3 * USD,
          replica_over_nusd=2 * USD, verdict="buy")),
    # a burst in hour 0 ($5), quiet hours 1-3 ($0.5, local only, local only): a replica all window costs $8
    ([_p(0, 5.0), _p(1, 0.5), _l(2), _l(3)], 2.0,
     dict(hours=4, hours_over=1, overflow_nusd=5_500_000_000, replica_nusd=8 * USD, overflow_over_nusd=5 * USD,
          replica_over_nusd=2 * USD, verdict="rent")),
    # spend exactly the replica's hourly cost is not over it
    ([_p(0, 2.0)], 2.0, dict(hours=1, hours_over=0, overflow_nusd=2 * USD, replica_nusd=2 * USD, verdict="rent")),
    # no overflow at all
    ([_l(0), _l(1)], 2.0, dict(hours=2, hours_over=0, overflow_nusd=0, replica_nusd=4 * USD, verdict="rent")),
])
def test_advice_table(rows, hourly_usd, expected):
    (got,) = advise(rows, {"m": usd_to_nusd(hourly_usd)})
    for key, value in expected.items():
        assert getattr(got, key) == value, key


def test_dollars_per_million_output_tokens_either_way():
    (got,) = advise([_p(0, 3.0, out=1_000_000), _p(1, 1.0, out=1_000_000), _l(1, out=500)], {"m": usd_to_nusd(1.5)})
    assert got.overflow_output_tokens == 2_000_000 and got.local_output_tokens == 500
    assert got.overflow_usd_per_1m == pytest.approx(2.0)  # $4 over 2M tokens
    assert got.replica_usd_per_1m == pytest.approx(1.5)  # $1.5/h x 2 h over the same 2M tokens
    assert got.verdict == "buy"
    (none,) = advise([_l(0)], {"m": USD})
    assert none.overflow_usd_per_1m is None and none.replica_usd_per_1m is None


def test_models_are_apart_and_unpriced_models_are_left_out():
    rows = [_p(0, 3.0, model="a"), _p(0, 0.1, model="b"), _p(0, 9.0, model="unpriced")]
    a, b = advise(rows, {"b": USD, "a": USD})
    assert (a.model, a.hours_over, a.overflow_nusd) == ("a", 1, 3 * USD)
    assert (b.model, b.hours_over, b.overflow_nusd) == ("b", 0, usd_to_nusd(0.1))


def test_an_explicit_window_counts_its_hours_and_drops_rows_outside():
    rows = [_p(0, 3.0), _p(5, 3.0)]
    (got,) = advise(rows, {"m": USD}, window=(H0, H0 + 2 * HOUR_S))
    assert (got.hours, got.overflow_nusd, got.replica_nusd) == (2, 3 * USD, 2 * USD)
    with pytest.raises(ValueError, match="must end after it starts"):
        advise(rows, {"m": USD}, window=(H0, H0))


def test_no_rows():
    assert advise([], {"m": USD}) == [AdviceRow("m", 0, 0, USD, 0, 0, 0, 0, 0, 0)]


@pytest.mark.parametrize("engine, uses_gpus, expected_usd", [
    ({}, True, 2.5),
    ({"tensor_parallel_size": 4}, True, 10.0),
    ({}, False, 0.4),
])
def test_replica_hour_from_the_model_config(engine, uses_gpus, expected_usd):
    m = ModelConfig.model_validate({"name": "m", "source": "builtin:tiny-random", "engine": engine,
                                    "deployment": {"replicas": 3},
                                    "cost": {"gpu_hour_usd": 2.5, "node_hour_usd": 0.4}})
    assert replica_hour_nusd(m, uses_gpus=uses_gpus) == usd_to_nusd(expected_usd)


def test_facts_from_ledger_rows():
    from lmfleet.overflow.advise import facts_from_rows

    rows = [
        {"ts": 10.0, "model": "m", "served_by": "provider/acme", "cost_usd": 0.25, "input_tokens": 100,
         "output_tokens": 50},
        {"ts": 11.0, "model": "m", "served_by": "local/m", "cost_usd": 0.0, "input_tokens": 7, "output_tokens": None},
        {"ts": 12.0, "model": None, "served_by": None, "cost_usd": 0.0, "input_tokens": 0, "output_tokens": 0},
    ]
    assert facts_from_rows(rows) == [
        LedgerFacts(10.0, "m", "provider", usd_to_nusd(0.25), 100, 50),
        LedgerFacts(11.0, "m", "local", 0, 7, 0),
    ]


def test_advice_as_dict_in_dollars():
    (got,) = advise([_p(0, 3.0, out=2_000_000)], {"m": usd_to_nusd(2.0)})
    d = got.as_dict()
    assert d["overflow_usd"] == pytest.approx(3.0) and d["replica_usd"] == pytest.approx(2.0)
    assert d["overflow_usd_per_1m"] == pytest.approx(1.5) and d["replica_usd_per_1m"] == pytest.approx(1.0)
    assert d["verdict"] == "buy" and d["hours_over"] == 1

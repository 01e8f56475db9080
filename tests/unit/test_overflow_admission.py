"""The admission record: what the estimate was computed from, as JSON in the ledger and back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lmfleet.overflow.admission import Admission, admission_json, admission_rows, parse_admission
from lmfleet.overflow.signals import QueueSignals
from lmfleet.store import Ledger

THR = 2500.0


def sig(**kw) -> QueueSignals:
    base = dict(now=0.0, in_flight=0, drain_rps=2.0, output_tps=100.0, ttft_s=None, base_ttft_s=0.4,
                completions_in_window=10)
    return QueueSignals(**{**base, **kw})


# --- the admission record --------------------------------------------------------------------------------------

def test_admission_round_trips_through_json_and_ignores_unknown_keys():
    a = Admission(sig(in_flight=9, engine_waiting=2, pending_prefill_tokens=300, gate_queue=((200, 0.25), (100, None))),
                  8, 512, 1, 1840.0, 750.0, 750.0, THR)
    text = admission_json(a)
    assert admission_json(dataclasses.asdict(a)) == text  # the recorder's asdict form writes the same JSON
    assert parse_admission(text) == a
    newer = json.loads(text)
    newer["kv_usage"] = 0.5
    newer["signals"]["kv_usage"] = 0.5
    assert parse_admission(newer) == a
    assert admission_json(None) is None


@pytest.mark.parametrize("bad", ["[]", '{"capacity": 8}', "7"])
def test_parse_admission_refuses_what_is_not_one(bad):
    with pytest.raises(ValueError, match="not an admission record"):
        parse_admission(bad)


def test_ledger_keeps_the_admission_as_json(tmp_path):
    a = Admission(sig(in_flight=3), 8, 20, None, 400.0, 0.0, 0.0, THR)
    with Ledger(tmp_path / "l.sqlite") as led:
        led.record(model="m", served_by="local/m", route_reason="local_ok", input_tokens=20, output_tokens=2,
                   status="200", cost_usd=0.0, predicted_wait_ms=400.0, realised_wait_ms=450.0, admission=a)
        led.record(model="m", served_by="provider/p", route_reason="overflow", input_tokens=20, output_tokens=2,
                   status="200", cost_usd=0.0)
        rows = led.rows()
    assert parse_admission(rows[0]["admission"]) == a and rows[1]["admission"] is None
    (got,) = admission_rows(rows)  # only the row with an estimate and a record
    assert got["realised_wait_ms"] == 450.0 and parse_admission(got["admission"]) == a

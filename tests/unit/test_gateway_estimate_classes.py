"""A request's predicted local wait counts only the requests ahead of it in the priority queue (issue 14).

``class_wait_ms`` is pure (tables of cases); then the real gateway (``build_gateway``, fake backends): under a batch
backlog an interactive request is predicted to wait behind the running requests only, stays local instead of
overflowing to a paid provider, and batch estimates no longer move the band interactive requests overflow at.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading

import pytest

from lmfleet.gateway.routing.router import class_wait_ms
from lmfleet.overflow.estimator import estimate_wait_ms
from lmfleet.overflow.signals import QueueSignals
from lmfleet.testing.gateway_fakes import make_gateway, started_client
from tests.support.clock import freeze_tracker_clock
from tests.unit.test_gateway_tenants import (
    CHAT,
    Counting,
    MODEL_M,
    _held_local,
    _until,
    key,
    ok_local,
    tenant_gateway,
)

pytestmark = pytest.mark.usefixtures("close_started_gateways")

INTERACTIVE, STANDARD, BATCH = 0, 5, 10


def sig(in_flight=0, drain=None, base=None, running=None, waiting=None) -> QueueSignals:
    return QueueSignals(now=0.0, in_flight=in_flight, drain_rps=drain, output_tps=None, ttft_s=None,
                        base_ttft_s=base, completions_in_window=0, engine_running=running, engine_waiting=waiting)


# ---- the pure function ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("signals,capacity,waiting,order,expected_ms", [
    # capacity 4, measured drain 2/s and prefill 0.3 s: "ahead" = in flight - 4 + 1 -> ahead / 2 s + 0.3 s
    (sig(4, 2.0, 0.3), 4, {}, INTERACTIVE, 800.0),                          # 4 running, none waits: 1 ahead
    (sig(12, 2.0, 0.3), 4, {BATCH: 8}, INTERACTIVE, 800.0),                 # 8 batch wait: it overtakes them all
    (sig(12, 2.0, 0.3), 4, {BATCH: 8}, BATCH, 4800.0),                      # a batch request waits behind them
    (sig(12, 2.0, 0.3), 4, {BATCH: 8}, None, 4800.0),                       # no class: every request counts
    (sig(12, 2.0, 0.3), 4, {INTERACTIVE: 2, BATCH: 6}, INTERACTIVE, 1800.0),  # its own class counts (FIFO in it)
    (sig(12, 2.0, 0.3), 4, {INTERACTIVE: 2, BATCH: 6}, BATCH, 4800.0),
    (sig(12, 2.0, 0.3), 4, {INTERACTIVE: 2, STANDARD: 3, BATCH: 3}, STANDARD, 3300.0),  # more urgent ones count
    (sig(12, 2.0, 0.3), 4, {INTERACTIVE: 2, STANDARD: 3, BATCH: 3}, INTERACTIVE, 1800.0),
    (sig(12, 2.0, 0.3), 4, {STANDARD: 8}, INTERACTIVE, 800.0),
    (sig(2, 2.0, 0.3), 4, {BATCH: 8}, INTERACTIVE, 300.0),                  # counts out of step: never below 0
    (sig(6, 2.0, 0.3), 4, {BATCH: 2}, INTERACTIVE, 800.0),                  # 4 running: the next slot to free
    (sig(3, 2.0, 0.3), 4, {}, INTERACTIVE, 300.0),                          # a free slot: prefill only
    # the engine's own queue: requests it holds were dispatched already, so they stay ahead whatever their class
    (sig(12, 2.0, 0.3, running=4, waiting=3), 4, {BATCH: 8}, INTERACTIVE, 2300.0),
    (sig(12, 2.0, 0.3, running=2, waiting=1), 4, {BATCH: 8}, INTERACTIVE, 1800.0),  # saturated at 2 (KV cache)
    # cold start: drain = capacity / cold_service_s (10 s) = 0.4/s, prefill cold_ttft_s (1 s)
    (sig(12), 4, {BATCH: 8}, INTERACTIVE, 3500.0),
    (sig(12), 4, {BATCH: 8}, BATCH, 23500.0),
])
def test_class_wait_ms_counts_only_the_requests_ahead(signals, capacity, waiting, order, expected_ms):
    assert class_wait_ms(signals, capacity, waiting, order) == pytest.approx(expected_ms)


SIGNALS = [sig(n, drain, base, running, waiting)
           for n, drain, base, (running, waiting) in itertools.product(
               [0, 1, 4, 5, 9, 40], [None, 0.5, 3.0], [None, 0.2], [(None, None), (4, 0), (2, 3)])]


@pytest.mark.parametrize("waiting,order", [
    ({}, None), ({}, INTERACTIVE), ({}, BATCH),         # nobody waits in the queue
    ({BATCH: 3, INTERACTIVE: 1}, None),                 # no class: the whole queue
    ({INTERACTIVE: 2}, BATCH), ({BATCH: 3}, BATCH),     # the least urgent class: everyone waits ahead of it
])
def test_without_a_class_that_yields_it_is_the_estimate_of_old(waiting, order):
    """No class, no queue, or nobody waiting in a less urgent class: exactly :func:`estimate_wait_ms` (today's)."""
    for signals, capacity in itertools.product(SIGNALS, (1, 4, 8)):
        assert class_wait_ms(signals, capacity, waiting, order, cold_service_s=3.0, cold_ttft_s=0.4) == \
            estimate_wait_ms(signals, capacity, cold_service_s=3.0, cold_ttft_s=0.4), (signals, capacity)


def test_a_more_urgent_class_never_waits_longer():
    waiting = {INTERACTIVE: 1, STANDARD: 2, BATCH: 7}
    for signals in SIGNALS:
        signals = dataclasses.replace(signals, in_flight=signals.in_flight + sum(waiting.values()))
        waits = [class_wait_ms(signals, 4, waiting, o) for o in (INTERACTIVE, STANDARD, BATCH)]
        assert waits == sorted(waits) and waits[2] == class_wait_ms(signals, 4, waiting, None), signals


# ---- the router, on the real gateway ----------------------------------------------------------------------------
QUICK = {**MODEL_M, "overflow": {"threshold_ms": 1000, "cold_service_s": 1.0, "cold_ttft_s": 0.2}}
"""Capacity 4, cold drain 4/s, cold prefill 0.2 s: 4 running -> 450 ms; 4 running + k waiting -> (k + 1) x 250 + 200."""
CLASSES3 = [{"name": "interactive", "order": INTERACTIVE}, {"name": "standard", "order": STANDARD},
            {"name": "batch", "order": BATCH, "max_wait_s": 30}]


@pytest.mark.parametrize("waiting,order,expected_ms", [
    ([], INTERACTIVE, 450.0),
    ([BATCH] * 6, INTERACTIVE, 450.0),
    ([BATCH] * 6, STANDARD, 450.0),
    ([BATCH] * 6, BATCH, 1950.0),
    ([BATCH] * 6, None, 1950.0),                                   # /admin/state and the dashboard: the whole queue
    ([INTERACTIVE, BATCH, BATCH], INTERACTIVE, 700.0),
    ([INTERACTIVE, STANDARD, STANDARD, BATCH], STANDARD, 1200.0),
    ([INTERACTIVE, STANDARD, STANDARD, BATCH], INTERACTIVE, 700.0),
])
async def test_router_estimate_reads_the_models_queue(tmp_path, monkeypatch, waiting, order, expected_ms):
    app = tenant_gateway(tmp_path, {"a": {}}, models=[QUICK], classes=CLASSES3)
    m = app.state.gateway.models["m"]
    q, tracker = m.queue, m.local.tracker
    freeze_tracker_clock(tracker, monkeypatch)
    for _ in range(4):  # four running: a tracker slot and a queue slot each, as a local attempt takes them
        tracker.on_start(10)
        assert q.try_enter()
    parked = []
    for o in waiting:
        tracker.on_start(10)
        parked.append(asyncio.create_task(q.wait("a", o, None)))
    await _until(lambda: len(q.waiting) == len(waiting))
    assert app.state.gateway.router.estimate(m, order=order) == pytest.approx(expected_ms)
    for t in parked:
        t.cancel()
    await asyncio.gather(*parked, return_exceptions=True)


async def test_under_a_batch_backlog_interactive_stays_local_and_goes_first(tmp_path, monkeypatch):
    """4 slots held, 8 batch requests waiting: an interactive request is predicted 450 ms (not 2450 ms, over the
    1 s threshold), so it waits locally instead of paying provider p, and is dispatched before the batch."""
    release = threading.Event()
    provider = Counting()
    app = tenant_gateway(tmp_path, {"a": {"priority": "batch"}, "b": {}}, local=_held_local(release, "ok"),
                         providers={"p": provider}, models=[QUICK], classes=CLASSES3)
    gw = app.state.gateway
    m = gw.models["m"]
    freeze_tracker_clock(m.local.tracker, monkeypatch)
    q = m.queue
    c = await started_client(app)
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    hold = [asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=key("b"))) for _ in range(4)]
    await _until(lambda: q.running == 4)
    batch = []
    for k in range(8):
        batch.append(asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers=key("a"))))
        await _until(lambda: len(q.waiting) == k + 1)
    assert gw.router.estimate(m) == pytest.approx(2450.0)  # the whole queue: what the router used to predict
    inter = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers=key("b")))
    await _until(lambda: len(q.waiting) == 9)
    release.set()
    r = await inter
    assert r.status_code == 200, r.text
    assert (r.headers["x-lmfleet-served-by"], r.headers["x-lmfleet-route-reason"]) == ("local/m", "local_ok")
    assert r.headers["x-lmfleet-queue-estimate-ms"] == "450" and provider.calls == 0
    answers = await asyncio.gather(*hold, *batch)
    assert [a.status_code for a in answers] == [200] * 12
    estimates = [int(a.headers["x-lmfleet-queue-estimate-ms"]) for a in answers[4:]]
    assert estimates == [450 + 250 * k for k in range(8)]  # a batch request waits behind the whole queue
    assert {a.headers["x-lmfleet-served-by"] for a in answers[4:]} == {"local/m"}
    assert q.last_served["b"] < q.last_served["a"]  # b's interactive request was dispatched before a's last batch


async def test_batch_estimates_do_not_move_the_interactive_overflow_band(tmp_path, monkeypatch):
    """Prefill 0.7 s: with 4 running an interactive request is predicted 950 ms, under the 1 s threshold but over the
    band's lower bar (800 ms, hysteresis 0.2). Waiting batch requests predict 1.2 s and more; if their estimates set
    the model's "overflowing" state, the interactive request would overflow at 950 ms. It must not."""
    release = threading.Event()
    provider = Counting()
    # the miss margin off: its prior (0.3 x threshold while busy) would spill the 950 ms request on its own
    slow_prefill = {**QUICK, "overflow": {**QUICK["overflow"], "cold_ttft_s": 0.7, "miss_quantile": None}}
    app = tenant_gateway(tmp_path, {"a": {"priority": "batch"}, "b": {}}, local=_held_local(release, "ok"),
                         providers={"p": provider}, models=[slow_prefill], classes=CLASSES3)
    m = app.state.gateway.models["m"]
    freeze_tracker_clock(m.local.tracker, monkeypatch)
    q = m.queue
    c = await started_client(app)
    held = {**CHAT, "messages": [{"role": "user", "content": "hold"}]}
    hold = [asyncio.create_task(c.post("/v1/chat/completions", json=held, headers=key("b"))) for _ in range(4)]
    await _until(lambda: q.running == 4)
    batch = []
    for k in range(3):
        batch.append(asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers=key("a"))))
        await _until(lambda: len(q.waiting) == k + 1)
    assert not m.hysteresis.overflowing
    inter = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers=key("b")))
    await _until(lambda: len(q.waiting) == 4)
    release.set()
    r = await inter
    assert (r.headers["x-lmfleet-served-by"], r.headers["x-lmfleet-queue-estimate-ms"]) == ("local/m", "950")
    answers = await asyncio.gather(*hold, *batch)
    assert [a.headers["x-lmfleet-queue-estimate-ms"] for a in answers[4:]] == ["950", "1200", "1450"]
    assert provider.calls == 0 and not m.hysteresis.overflowing


async def test_without_tenants_the_estimate_and_the_band_are_as_before(tmp_path, monkeypatch):
    """No ``tenants:``: no queue, the estimate is :func:`estimate_wait_ms` over everything in flight and every
    request moves the band (8 in flight, capacity 4: 13.5 s with the default cold figures -> a provider,
    overflowing)."""
    provider = Counting()
    app = make_gateway(tmp_path, ok_local, {"p": provider})
    gw = app.state.gateway
    m = gw.models["m"]
    freeze_tracker_clock(m.local.tracker, monkeypatch)
    assert m.queue is None
    for _ in range(8):
        m.local.tracker.on_start(10)
    expected = estimate_wait_ms(m.local.tracker.snapshot(), m.app.capacity)
    assert gw.router.estimate(m) == gw.router.estimate(m, order=INTERACTIVE) == pytest.approx(expected)
    c = await started_client(app)
    r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-lmfleet-served-by"] == "provider/p"
    assert r.headers["x-lmfleet-queue-estimate-ms"] == f"{expected:.0f}" and m.hysteresis.overflowing

"""Gateways that know about each other (lmfleet.gateway.routing.peers): the pure sum of the other gateways' loads, the
LoadTracker that adds it to its own, the registry's bookkeeping, a PeerBoard against a fake registry call, and
the rows `lmfleet cluster status` prints."""

from __future__ import annotations

import asyncio

import pytest

from lmfleet.gateway.routing import peers
from lmfleet.gateway.routing.peers import GatewayRegistry, PeerBoard, PeerLoad, gateway_rows, peer_loads
from lmfleet.overflow.estimator import estimate_wait_ms
from lmfleet.overflow.signals import LoadTracker


def _gw(gid, last_seen=100.0, **models):
    return {"id": gid, "last_seen": last_seen,
            "models": {m: {"in_flight": n, "drain_rps": d} for m, (n, d) in models.items()}}


@pytest.mark.parametrize(
    "entries, now, expected",
    [
        ([], 100.0, {}),
        # only myself: nothing to add
        ([_gw("me", a=(5, 1.0))], 100.0, {}),
        # another gateway's load is counted
        ([_gw("me", a=(5, 1.0)), _gw("b", a=(3, 0.5))], 100.0, {"a": PeerLoad(3, 0.5)}),
        # several gateways and models are summed per model
        ([_gw("b", a=(3, 0.5), c=(1, 0.0)), _gw("d", a=(2, 1.5))], 100.0,
         {"a": PeerLoad(5, 2.0), "c": PeerLoad(1, 0.0)}),
        # a gateway that stopped reporting (older than FRESH_S = 5 s) no longer counts
        ([_gw("b", last_seen=94.0, a=(3, 0.5)), _gw("d", last_seen=96.0, a=(2, 1.5))], 100.0,
         {"a": PeerLoad(2, 1.5)}),
        # exactly FRESH_S old still counts
        ([_gw("b", last_seen=95.0, a=(3, 0.5))], 100.0, {"a": PeerLoad(3, 0.5)}),
        # missing or null fields read as zero
        ([{"id": "b", "last_seen": 100.0, "models": {"a": {}}}, {"id": "c", "last_seen": 100.0, "models": None},
          {"id": "d", "last_seen": 100.0, "models": {"a": {"in_flight": 1, "drain_rps": None}}}], 100.0,
         {"a": PeerLoad(1, 0.0)}),
        # no last_seen: never fresh
        ([{"id": "b", "models": {"a": {"in_flight": 4, "drain_rps": 1.0}}}], 100.0, {}),
    ],
)
def test_peer_loads(entries, now, expected):
    assert peer_loads(entries, "me", now) == expected


def _busy_tracker(own_in_flight: int, completions: int, clock=None) -> LoadTracker:
    """A tracker that has finished ``completions`` requests over 10 busy seconds and holds ``own_in_flight``."""
    tr = LoadTracker(4, window_s=30.0, **({"clock": clock} if clock else {}))
    tickets = [tr.on_start(now=0.0) for _ in range(max(1, completions))]
    for t in tickets:
        tr.on_finish(t, 10, ok=completions > 0, now=10.0)
    for _ in range(own_in_flight):
        tr.on_start(now=10.0)
    return tr


@pytest.mark.parametrize(
    "own, completions, peer, peer_at, now, with_peers, in_flight, drain",
    [
        # no peer report: own figures only
        (2, 5, None, None, 10.0, True, 2, 0.5),
        # peers' in-flight and drain are added to one's own
        (2, 5, (3, 1.5), 10.0, 10.0, True, 5, 2.0),
        # what a gateway reports to the others: its own only
        (2, 5, (3, 1.5), 10.0, 10.0, False, 2, 0.5),
        # own drain unknown (fewer than min_completions): the peers' drain rate stands
        (1, 0, (3, 1.5), 10.0, 10.0, True, 4, 1.5),
        # a peer drain of 0 leaves one's own (unknown) as is
        (1, 0, (3, 0.0), 10.0, 10.0, True, 4, None),
        # a peer report older than engine_stats_ttl_s (10 s) is dropped (registry unreachable)
        (2, 5, (3, 1.5), 10.0, 20.5, True, 2, 0.5 * 10 / 20.5),
        # negative figures are clamped
        (0, 5, (-3, -1.0), 10.0, 10.0, True, 0, 0.5),
    ],
)
def test_load_tracker_adds_peer_load(own, completions, peer, peer_at, now, with_peers, in_flight, drain):
    tr = _busy_tracker(own, completions)
    if peer is not None:
        tr.set_peer_load(*peer, now=peer_at)
    s = tr.snapshot(now, with_peers=with_peers)
    assert s.in_flight == in_flight
    assert s.drain_rps == pytest.approx(drain) if drain is not None else s.drain_rps is None
    assert tr.in_flight == own  # the tracker's own count never includes the peers


def test_two_gateways_see_the_queue_one_gateway_would():
    """The point of it all: split one gateway's load (8 in flight, 10 drained in 10 s) over two gateways that
    know each other's load, and each predicts the wait the one gateway would."""
    one = _busy_tracker(8, 10)
    a, b = _busy_tracker(4, 5), _busy_tracker(4, 5)
    for me, other in ((a, b), (b, a)):
        s = other.snapshot(10.0, with_peers=False)
        me.set_peer_load(s.in_flight, s.drain_rps, now=10.0)
    alone = estimate_wait_ms(one.snapshot(10.0), 4)
    assert estimate_wait_ms(a.snapshot(10.0), 4) == pytest.approx(alone)
    assert estimate_wait_ms(b.snapshot(10.0), 4) == pytest.approx(alone)
    # without the peers each would see half the queue and a quarter of the wait in the queue
    assert estimate_wait_ms(a.snapshot(10.0, with_peers=False), 4) < alone


@pytest.mark.parametrize(
    "reports, at, expected_ids",
    [
        ([("a", 0.0)], 1.0, ["a"]),
        ([("a", 0.0), ("b", 0.5)], 1.0, ["a", "b"]),
        # a report replaces the gateway's previous one
        ([("a", 0.0), ("a", 0.5)], 1.0, ["a"]),
        # an entry silent for longer than FORGET_S is dropped at the next report
        ([("a", 0.0), ("b", peers.FORGET_S + 1)], peers.FORGET_S + 1, ["b"]),
    ],
)
def test_registry_bookkeeping(monkeypatch, reports, at, expected_ids):
    reg = GatewayRegistry()
    for gid, t in reports:
        monkeypatch.setattr(peers.time, "time", lambda t=t: t)
        answer = reg.report({"id": gid, "port": 1})
        assert answer["now"] == t
        assert any(g["id"] == gid and g["last_seen"] == t for g in answer["gateways"])
    monkeypatch.setattr(peers.time, "time", lambda: at)
    listed = reg.list()
    assert listed["now"] == at
    assert sorted(g["id"] for g in listed["gateways"]) == expected_ids
    for gid in expected_ids:
        reg.remove(gid)
    reg.remove("never-there")
    assert reg.list()["gateways"] == []


class FakeRegistry:
    """The registry actor's body called in-process, optionally failing the first ``fail`` calls."""

    def __init__(self, fail: int = 0) -> None:
        self.reg = GatewayRegistry()
        self.fail = fail
        self.calls: list[str] = []

    def __call__(self, method, arg):
        self.calls.append(method)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("registry down")
        return getattr(self.reg, method)(arg)


def test_peer_board_reports_its_own_load_and_applies_the_others():
    call = FakeRegistry()
    a_tr, b_tr = {"m": LoadTracker(4)}, {"m": LoadTracker(4)}
    a = PeerBoard(a_tr, host="127.0.0.1", port=1, call=call)
    b = PeerBoard(b_tr, host="127.0.0.1", port=1, role="worker", call=call)
    assert a.id != b.id
    a_tr["m"].on_start()
    a_tr["m"].on_start()
    b_tr["m"].on_start()
    a.apply(call("report", a.entry()))
    b.apply(call("report", b.entry()))
    a.apply(call("report", a.entry()))
    assert a_tr["m"].snapshot().in_flight == 3 and a_tr["m"].in_flight == 2
    assert b_tr["m"].snapshot().in_flight == 3 and b_tr["m"].in_flight == 1
    # a reports its own two, not the three it sees
    assert a.entry()["models"] == {"m": {"in_flight": 2, "drain_rps": 0.0}}
    assert {"id", "role", "node", "host", "port", "pid", "started_at", "models"} <= a.entry().keys()


async def test_peer_board_keeps_reporting_through_registry_failures():
    call = FakeRegistry(fail=2)
    board = PeerBoard({"m": LoadTracker(4)}, host="127.0.0.1", port=1, period_s=0.01, call=call)
    task = asyncio.create_task(board.run())
    for _ in range(200):
        if board.last_ok is not None:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert board.last_ok is not None
    assert call.calls[:3] == ["report"] * 3
    await board.leave()
    assert call.calls[-1] == "remove" and call.reg.list()["gateways"] == []


async def test_peer_board_leave_never_raises():
    def broken(method, arg):
        raise ConnectionError("gone")

    await PeerBoard({}, host="h", port=1, call=broken).leave()


def _entry(gid, host, port, pid, last_seen, role="gateway", node="10.0.0.1", **in_flight):
    return {"id": gid, "host": host, "port": port, "pid": pid, "last_seen": last_seen, "role": role, "node": node,
            "models": {m: {"in_flight": n, "drain_rps": 0.0} for m, n in in_flight.items()}}


@pytest.mark.parametrize(
    "gateways, expected",
    [
        ([], []),
        # one serve gateway with two workers on one port is one row of three processes
        ([_entry("1", "127.0.0.1", 8000, 11, 99.5, "serve", a=1, b=2), _entry("2", "127.0.0.1", 8000, 12, 99.0,
                                                                               "worker", a=3),
          _entry("3", "127.0.0.1", 8000, 13, 98.0, "worker")],
         [("127.0.0.1:8000", "serve", (11, 12, 13), 6, 0.5, True)]),
        # a gateway on all interfaces is shown at its node's address; rows sorted by address
        ([_entry("1", "0.0.0.0", 8100, 21, 90.0, node="10.0.0.2", a=1), _entry("2", "10.0.0.1", 8000, 22, 100.0)],
         [("10.0.0.1:8000", "gateway", (22,), 0, 0.0, True), ("10.0.0.2:8100", "gateway", (21,), 1, 10.0, False)]),
        # IPv6
        ([_entry("1", "::1", 8000, 5, 100.0)], [("[::1]:8000", "gateway", (5,), 0, 0.0, True)]),
    ],
)
def test_gateway_rows(gateways, expected):
    rows = gateway_rows({"now": 100.0, "gateways": gateways})
    assert [(r.address, r.role, r.pids, r.in_flight, r.last_seen_s, r.fresh) for r in rows] == expected
    assert [r.workers for r in rows] == [len(e[2]) for e in expected]


@pytest.mark.parametrize(
    "gateways, expected_lines",
    [
        ([], ["Gateways: none registered"]),
        ([_entry("1", "127.0.0.1", 8000, 11, 99.5, "serve", a=1), _entry("2", "127.0.0.1", 8000, 12, 99.0, "worker"),
          _entry("3", "0.0.0.0", 8100, 21, 80.0, node="10.0.0.2")],
         ["Gateways:",
          "  address                  role     processes in-flight  last seen  pids",
          "  10.0.0.2:8100            gateway  1                 0  20 s ago (gone?) 21",
          "  127.0.0.1:8000           serve    2                 1  0 s ago    11,12"]),
    ],
)
def test_cluster_status_gateways_section(gateways, expected_lines):
    from lmfleet.cli.cluster import render_gateways

    text = render_gateways(gateway_rows({"now": 100.0, "gateways": gateways}))
    assert [ln for ln in text.splitlines() if ln] == expected_lines


def test_peer_loads_sum_window_tokens():
    entries = [{"id": "b", "last_seen": 100.0, "models": {"a": {"in_flight": 1, "drain_rps": 0.5, "window_tokens": 300}}},
               {"id": "c", "last_seen": 100.0, "models": {"a": {"in_flight": 0, "drain_rps": 0.0, "window_tokens": 200}}},
               {"id": "me", "last_seen": 100.0, "models": {"a": {"window_tokens": 999}}}]
    assert peer_loads(entries, "me", 100.0) == {"a": PeerLoad(1, 0.5, 500)}


@pytest.mark.parametrize("gateways", [1, 2, 4])
def test_n_gateways_charge_what_one_would(gateways):
    """The same traffic split over N gateways that share their window counts is charged what one gateway charges
    (without sharing, each would charge ~N x per token)."""
    from lmfleet.overflow.cost import LocalCostMeter

    clock = [1000.0]

    def meters(n):
        return [LocalCostMeter(36.0, window_s=3600.0, min_tokens_per_hour=0.0, clock=lambda: clock[0])
                for _ in range(n)]

    one, many = meters(1)[0], meters(gateways)
    clock[0] += 3600.0
    for i in range(100):  # 100 requests of 360 tokens in the hour, round-robin over the gateways
        one.record(360)
        many[i % gateways].record(360)
    for i, m in enumerate(many):  # what the registry hands each: the others' counts
        m.set_peer_tokens(sum(o.window_tokens() for j, o in enumerate(many) if j != i))
    total_one = 100 * one.request_cost_usd(360)
    total_many = sum(many[i % gateways].request_cost_usd(360) for i in range(100))
    assert total_one == pytest.approx(36.0) and total_many == pytest.approx(total_one)
    clock[0] += LocalCostMeter.peer_ttl_s + 1  # the registry went quiet: each counts its own share again
    assert many[0].usd_per_output_token() == pytest.approx(one.usd_per_output_token() * gateways)


async def test_peer_board_reports_and_applies_window_tokens():
    from lmfleet.overflow.cost import LocalCostMeter

    tr = LoadTracker(4, window_s=30.0)
    meter = LocalCostMeter(1.0, min_tokens_per_hour=0.0)
    meter.record(42)
    sent = []

    def call(method, arg):
        sent.append(arg)
        return {"now": 100.0, "gateways": [{**arg, "last_seen": 100.0},
                                           {"id": "other", "last_seen": 100.0, "models": {"a": {"window_tokens": 58}}}]}

    board = PeerBoard({"a": tr}, host="127.0.0.1", port=1, call=call, meters={"a": meter})
    board.apply(call("report", board.entry()))
    assert sent[0]["models"]["a"]["window_tokens"] == 42
    assert meter._peer is not None and meter._peer[1] == 58


@pytest.mark.parametrize("peer_in_flight, peer_at, base_sample", [
    (None, None, True),   # alone: 1 of capacity 4 in flight, an unqueued request
    (2, 10.0, True),      # 3 in flight in all: still a free slot
    (4, 10.0, False),     # behind the other gateway's 4: it queued, its TTFT is not prefill time
    (4, -5.0, True),      # a peer report older than engine_stats_ttl_s no longer counts
])
def test_a_request_queued_behind_other_gateways_is_not_a_base_ttft_sample(peer_in_flight, peer_at, base_sample):
    tr = LoadTracker(4, window_s=30.0)
    if peer_in_flight is not None:
        tr.set_peer_load(peer_in_flight, 1.0, now=peer_at)
    ticket = tr.on_start(now=10.0)
    tr.on_first_token(ticket, now=10.5)
    assert (tr.snapshot(now=10.5).base_ttft_s == pytest.approx(0.5)) is base_sample


class _Route:
    """The part of the router's ServedModel that PeerBoard touches."""

    def __init__(self, overflowing: bool = False):
        from lmfleet.overflow.policy import HysteresisState

        self.hysteresis = HysteresisState(overflowing)
        self.flags: list[tuple[bool, float]] = []

    def set_peers_overflowing(self, flag: bool, now: float) -> None:
        self.flags.append((flag, now))


def test_peer_board_shares_the_overflowing_flag():
    call = FakeRegistry()
    clock = [50.0]
    ra, rb = _Route(overflowing=True), _Route(overflowing=False)
    a = PeerBoard({"m": LoadTracker(4)}, host="127.0.0.1", port=1, call=call, routes={"m": ra}, clock=lambda: clock[0])
    b = PeerBoard({"m": LoadTracker(4)}, host="127.0.0.1", port=1, call=call, routes={"m": rb}, clock=lambda: clock[0])
    assert a.entry()["models"]["m"]["overflowing"] is True
    a.apply(call("report", a.entry()))
    b.apply(call("report", b.entry()))
    a.apply(call("report", a.entry()))
    assert rb.flags[-1] == (True, 50.0)   # b learns that a overflows
    assert ra.flags[-1] == (False, 50.0)  # a learns that b does not
    ra.hysteresis = type(ra.hysteresis)(False)
    a.apply(call("report", a.entry()))
    b.apply(call("report", b.entry()))
    assert rb.flags[-1] == (False, 50.0)


def test_served_model_forgets_a_stale_peer_flag():
    from lmfleet.gateway.routing.served import ServedModel

    m = ServedModel.__new__(ServedModel)
    m._peers_overflowing = (0.0, False)
    m.set_peers_overflowing(True, 100.0)
    assert m.peers_overflowing(now=101.0)
    assert not m.peers_overflowing(now=100.0 + ServedModel.PEERS_OVERFLOWING_TTL_S + 0.1)
    m.set_peers_overflowing(False, 103.0)
    assert not m.peers_overflowing(now=103.0)


class _QueuedRoute(_Route):
    def __init__(self, capacity: int):
        super().__init__()
        from lmfleet.tenants.queue import DispatchQueue

        self.queue = DispatchQueue(capacity)


def test_gateway_processes_share_one_local_capacity_through_the_registry():
    call = FakeRegistry()
    ra, rb = _QueuedRoute(8), _QueuedRoute(8)
    a = PeerBoard({"m": LoadTracker(8)}, host="127.0.0.1", port=1, call=call, routes={"m": ra})
    b = PeerBoard({"m": LoadTracker(8)}, host="127.0.0.1", port=1, call=call, routes={"m": rb})
    for _ in range(5):
        assert ra.queue.try_enter()
    assert a.entry()["models"]["m"]["queue_running"] == 5
    a.apply(call("report", a.entry()))
    b.apply(call("report", b.entry()))
    assert rb.queue.peer_running == 5 and rb.queue.share == 3
    took = sum(rb.queue.try_enter() for _ in range(8))
    assert took == 3  # together they run the capacity, not twice it
    b.apply(call("report", b.entry()))
    a.apply(call("report", a.entry()))
    assert ra.queue.peer_running == 3 and ra.queue.share == 5


def test_peer_loads_sum_queue_slots():
    entries = [{"id": "x", "last_seen": 10.0, "models": {"m": {"in_flight": 4, "queue_running": 3}}},
               {"id": "y", "last_seen": 10.0, "models": {"m": {"in_flight": 1, "queue_running": 1}}},
               {"id": "me", "last_seen": 10.0, "models": {"m": {"in_flight": 9, "queue_running": 9}}}]
    assert peer_loads(entries, "me", 10.0)["m"].queue_running == 4


@pytest.mark.parametrize("entries, alone", [
    ([], True),
    ([{"id": "me", "last_seen": 100.0}], True),                        # only itself
    ([{"id": "me", "last_seen": 100.0}, {"id": "b", "last_seen": 99.0}], False),
    ([{"id": "me", "last_seen": 100.0}, {"id": "b", "last_seen": 90.0}], True),   # b is stale (> FRESH_S)
    ([{"id": "b", "last_seen": 95.0}], False),                          # exactly FRESH_S old still counts
])
def test_has_fresh_peer(entries, alone):
    from lmfleet.gateway.routing.peers import has_fresh_peer

    assert has_fresh_peer(entries, "me", now=100.0) is (not alone)


@pytest.mark.parametrize("period, alone, expected", [
    (0.25, False, 0.25), (0.25, True, 2.0), (5.0, True, 5.0), (5.0, False, 5.0), (2.0, True, 2.0),
])
def test_next_report_s(period, alone, expected):
    from lmfleet.gateway.routing.peers import next_report_s

    assert next_report_s(period, alone) == expected


def test_peer_board_is_alone_until_the_registry_lists_another_gateway():
    call = FakeRegistry()
    a = PeerBoard({"m": LoadTracker(4)}, host="127.0.0.1", port=1, call=call)
    a.apply(call("report", a.entry()))
    assert a.alone
    b = PeerBoard({"m": LoadTracker(4)}, host="127.0.0.1", port=2, call=call)
    b.apply(call("report", b.entry()))
    assert not b.alone
    a.apply(call("report", a.entry()))
    assert not a.alone

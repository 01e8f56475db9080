"""overflow.policy end to end on the session fleet: the local engine (Ray Serve + vLLM) and the provider (a second
real vLLM server behind the fault proxy). The policy is switched at run time (POST /admin/overflow), so no engine
starts for these tests.

How the tests make the local start slow without a fault: a prompt of a few hundred tokens, new to the local engine
(a fresh nonce first), already in the provider's prefix cache (sent to it directly first), against a timer shorter
than any local prefill through Serve. How they see a cancelled attempt in vLLM: the winner streams a long answer
(``ignore_eos``), and the loser started no later with the same body on the same model, so uncancelled it would be
running for as long; its engine's running-request gauge must read 0 while the winner still streams.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
import yaml

from lmfleet.store import Ledger
from tests.e2e.conftest import PROVIDER_KEY

pytestmark = pytest.mark.e2e

LONG_TOKENS = 1400
"""The winner's answer: ~30 s or more on these machines, longer than the gauge's way to the gateway (Ray's
metrics report, then the gateway's 5 s poll)."""


@pytest.fixture
def policies(fleet):
    fleet.proxy.set_fault(mode="none")
    # a loaded machine can leave Serve's controller restarting after start-up: these tests need the local
    # deployment up (otherwise every policy rightly sends the request out as local_unavailable)
    deadline = time.monotonic() + 600
    while not fleet.admin("GET", "/admin/state").json()["models"]["smollm2"]["ready"]:
        assert time.monotonic() < deadline, "the local deployment of smollm2 did not become ready"
        time.sleep(2)
    yield fleet
    fleet.admin("POST", "/admin/overflow", json={"model": "smollm2", "mode": "auto", "threshold_ms": 2500,
                                                 "policy": "predictive", "ttft_timeout_ms": None,
                                                 "hedge_after_ms": None})


def _set(fleet, **body) -> None:
    r = fleet.admin("POST", "/admin/overflow", json={"model": "smollm2", **body})
    assert r.status_code == 200, r.text


def _prompt() -> list[dict]:
    """~400 tokens, unique to this call (the nonce comes first, so no engine has any of it cached)."""
    text = f"[{uuid.uuid4().hex}] " + "The quick brown fox jumps over the lazy dog near the river bank. " * 30
    return [{"role": "user", "content": text + "Summarise this text."}]


def _warm_provider(fleet, messages) -> None:
    """Put the prompt in the provider's prefix cache: its first token then comes in tens of milliseconds."""
    r = httpx.post(f"{fleet.provider_direct_url}/v1/chat/completions", timeout=120,
                   headers={"authorization": f"Bearer {PROVIDER_KEY}"},
                   json={"model": "smollm2-remote", "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


class Streamer(threading.Thread):
    """One streamed request through the gateway, read to its end in the background."""

    def __init__(self, fleet, body: dict):
        super().__init__(daemon=True)
        self.fleet, self.body = fleet, body
        self.headers: dict[str, str] = {}
        self.status = 0
        self.events = 0
        self.got_headers = threading.Event()
        self.stop = threading.Event()
        """Set: the client leaves (closes the stream) at its next event."""

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.fleet.base_url}/v1/chat/completions", json=self.body, timeout=300,
                              headers={"authorization": f"Bearer {self.fleet.api_key}"}) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                self.got_headers.set()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events += 1
                    if self.stop.is_set():
                        break
        finally:
            self.got_headers.set()


def _local_running(fleet) -> float | None:
    """Requests running in the local engines of smollm2 (vLLM's gauge, as the gateway last read it from Ray's
    metrics pages; None before any read)."""
    lines = [ln for ln in fleet.admin("GET", "/metrics").text.splitlines()
             if ln.startswith('lmfleet_replica_requests_running{model="smollm2"')]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) if lines else None


def _provider_running(fleet) -> float:
    text = httpx.get(f"{fleet.provider_direct_url}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("vllm:num_requests_running"))


def _rows(fleet, since: float) -> list[dict]:
    path = yaml.safe_load(fleet.config_path.read_text())["ledger"]["path"]
    return Ledger(path).rows(since=since)


def _wait_rows(fleet, since: float, n: int, timeout_s: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _rows(fleet, since)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def test_hedge_slow_local_start_races_a_provider_and_the_loser_is_cancelled_in_vllm(policies):
    fleet = policies
    messages = _prompt()
    _warm_provider(fleet, messages)
    _set(fleet, mode="auto", threshold_ms=600_000, policy="hedge", hedge_after_ms=50)  # predictive keeps it local
    since = time.time()
    s = Streamer(fleet, {"model": "smollm2", "messages": messages, "max_tokens": LONG_TOKENS, "stream": True,
                         "ignore_eos": True})
    s.start()
    assert s.got_headers.wait(120) and s.status == 200, s.status
    h = s.headers
    assert h["x-lmfleet-hedged"] == "1"
    winner = h["x-lmfleet-served-by"]
    assert (winner, h["x-lmfleet-route-reason"]) in {("provider/backup", "hedge_won"),
                                                     ("local/smollm2", "hedge_local_won")}, h
    # the loser got as far as the winner, no later: uncancelled it would run while the winner streams
    gauge = _provider_running if winner == "local/smollm2" else _local_running
    t_headers = time.monotonic()
    seen = []
    while s.is_alive():
        v = gauge(fleet)
        seen.append((round(time.monotonic() - t_headers, 1), v))
        if v == 0 and time.monotonic() - t_headers > 20:  # past the gauge's own delay
            break
        time.sleep(1)
    assert s.is_alive(), f"the winner finished before the loser's gauge read 0 past its delay: {seen}"
    assert seen[-1][1] == 0, seen
    s.stop.set()  # enough: the client leaves (a loaded machine would need minutes for the whole answer)
    s.join(120)
    assert s.events > 1

    rows = _wait_rows(fleet, since, 2)
    by = {(r["served_by"], r["route_reason"]): r for r in rows}
    loser = "local/smollm2" if winner == "provider/backup" else "provider/backup"
    won = by[(winner, h["x-lmfleet-route-reason"])]
    assert won["status"] in ("200", "499") and won["output_tokens"] > 0  # 499: the client left, as it did
    lost = by[(loser, "hedge_cancelled")]
    assert lost["status"] == "499" and lost["input_tokens"] > 300  # its prompt was prefilled and is on the bill
    if loser == "provider/backup":
        assert lost["cost_usd"] > 0
    metrics = fleet.admin("GET", "/metrics").text
    assert 'lmfleet_hedges_total{model="smollm2",outcome="started"}' in metrics


def test_ttft_timeout_cancels_the_local_request_and_fails_over(policies):
    fleet = policies
    messages = _prompt()
    _warm_provider(fleet, messages)
    _set(fleet, mode="auto", threshold_ms=600_000, policy="ttft_timeout", ttft_timeout_ms=50)
    since = time.time()
    raw = fleet.client(timeout=120).chat.completions.with_raw_response.create(
        model="smollm2", messages=messages, max_tokens=16, stream=True)
    for _ in raw.parse():
        pass
    assert raw.headers["x-lmfleet-served-by"] == "provider/backup"
    assert raw.headers["x-lmfleet-route-reason"] == "ttft_timeout"
    rows = _wait_rows(fleet, since, 2)
    got = sorted((r["served_by"], r["route_reason"], r["status"]) for r in rows)
    assert got == [("local/smollm2", "ttft_timeout_cancelled", "499"), ("provider/backup", "ttft_timeout", "200")]
    cancelled = next(r for r in rows if r["status"] == "499")
    assert cancelled["input_tokens"] > 300 and cancelled["output_tokens"] == 0
    assert 'lmfleet_ttft_timeout_failovers_total{model="smollm2",outcome="served"}' in fleet.admin(
        "GET", "/metrics").text
    # the local engine let go of it: nothing runs there once the gauge has caught up
    deadline = time.monotonic() + 60
    while _local_running(fleet) != 0 and time.monotonic() < deadline:
        time.sleep(1)
    assert _local_running(fleet) == 0


def _burst(fleet, n: int = 12) -> list[tuple[int, str, str]]:
    """``n`` short requests at once (the local capacity is 8): the later ones see a queue."""
    q = [{"role": "user", "content": "Name three colours."}]
    results: list[tuple[int, str, str]] = []

    def one(stream: bool) -> None:
        raw = fleet.client(timeout=120).chat.completions.with_raw_response.create(
            model="smollm2", messages=q, max_tokens=24, stream=stream)
        if stream:
            for _ in raw.parse():
                pass
        results.append((raw.status_code, raw.headers["x-lmfleet-served-by"], raw.headers["x-lmfleet-route-reason"]))

    threads = [threading.Thread(target=one, args=(bool(i % 2),)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == n
    return results


def test_on_error_never_spills_a_healthy_request(policies):
    fleet = policies
    _set(fleet, mode="auto", threshold_ms=1)  # any queue at all is above it
    assert any(served == "provider/backup" for _, served, _ in _burst(fleet))  # predictive spills at this bar
    _set(fleet, policy="on_error")
    since = time.time()
    results = _burst(fleet)
    assert {(status, served) for status, served, _ in results} == {(200, "local/smollm2")}, results
    assert {why for *_, why in results} <= {"local_ok", "local_first"}
    assert "local_first" in {why for *_, why in results}, results  # kept local where predictive would spill

    # every local row keeps the wait predicted for it; the streamed ones (half of the burst) the realised one too
    rows = _wait_rows(fleet, since, len(results))
    assert len(rows) == len(results) and all(r["predicted_wait_ms"] is not None for r in rows), rows
    realised = [r for r in rows if r["realised_wait_ms"] is not None]
    assert len(realised) == len(results) // 2 and all(r["realised_wait_ms"] == r["ttft_ms"] for r in realised), rows
    est = fleet.admin("GET", f"/admin/usage?estimate=1&since={since}").json()["models"]
    assert [(m["model"], m["requests"]) for m in est] == [("smollm2", len(realised))], est

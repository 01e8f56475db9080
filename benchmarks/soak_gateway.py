"""Soak the gateway: minutes of mixed valid, invalid, disconnecting and slow clients against a real fleet, while
the gateway process's RSS, open file descriptors, threads and in-flight counts are sampled (issue 13).

    .venv/bin/python benchmarks/soak_gateway.py --minutes 10 --json out/soak.json
    .venv/bin/python benchmarks/soak_gateway.py --url http://127.0.0.1:8000 --api-key K --admin-key A [--pid PID]

Without ``--url`` it starts its own fleet through the real CLI (``lmfleet serve -c fleet.yaml``, as
tests/e2e/conftest.py does): one local model (``builtin:tiny-random``, a small vLLM CPU engine) and one overflow
provider, the fast fake OpenAI server of lmfleet/testing/fast_openai_server.py, with a low overflow threshold so
that part of the traffic takes the provider path. The model's overflow mode is also switched between
``force_on`` and ``auto`` every ``--toggle-s`` seconds through the admin API, so that both paths carry traffic
(also with ``--url``; ``--toggle-s 0`` turns this off). Everything it started is ended by pid on exit or Ctrl-C.

The gateway runs inside the ``lmfleet serve`` process (also Ray's driver): that process is sampled. In-flight
counts come from /admin/state (the local load tracker and every provider's counter).

Pass/fail (exit 1 on any; thresholds are flags):
  * RSS grows (runs of ``--min-trend-minutes`` or more): the least-squares slope over the samples after the warm-up AND the growth between the first and
    the last window's medians (per minute) both exceed ``--max-rss-slope`` MiB/min;
  * open fds grow: the quiet count after the run exceeds the quiet count before it by more than ``--fd-slack``,
    or the last window's median exceeds the first's by more than that;
  * in-flight is not back to 0 once the clients stopped (``--quiet-timeout``);
  * any HTTP 5xx or in-stream error event (no upstream fault is injected; in fleet mode the gateway's warnings
    and the engine's stall lines are printed after the table, to tell a real upstream fault from a gateway bug);
  * a client mistake answered with something else than its expected 4xx (or a valid request not answered 200);
  * a slow-header connection held open longer than the header timeout plus 10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from lmfleet.net import free_port
from lmfleet.testing.fast_openai_server import FastServer

MODEL = "tiny"
API_KEY = "sk-soak-client"
ADMIN_KEY = "soak-admin"
PROVIDER_KEY = "sk-soak-provider"
HEADER_TIMEOUT_S = 10.0  # gateway.header_timeout_s (default) of the fleet we start
MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# the fleet (started like tests/e2e/conftest.py does)
# ---------------------------------------------------------------------------------------------
def fleet_config(work: Path, port: int, serve_port: int, provider_url: str) -> dict[str, Any]:
    return {
        "gateway": {"port": port, "serve_port": serve_port, "api_keys_env": "LMFLEET_SOAK_API_KEYS",
                    "admin_key_env": "LMFLEET_SOAK_ADMIN_KEY", "health_poll_s": 1,
                    "header_timeout_s": HEADER_TIMEOUT_S},
        "ledger": {"path": str(work / "ledger.sqlite")},
        "providers": [{
            "name": "fake", "base_url": f"{provider_url}/v1", "api_key_env": "LMFLEET_SOAK_PROVIDER_KEY",
            "model_map": {MODEL: "fake-remote"}, "price": {"input_per_1m": 0.5, "output_per_1m": 1.5},
            "timeouts": {"connect_s": 2, "total_s": 60, "first_token_s": 20}, "max_retries": 1,
        }],
        "models": [{
            "name": MODEL, "source": "builtin:tiny-random",
            "engine": {"max_model_len": 512, "max_num_seqs": 8, "cpu_kvcache_space_gib": 1},
            "deployment": {"max_ongoing_requests": 4, "request_timeout_s": 60},
            # low enough that a short local queue sends requests to the provider
            # a local first token slower than 15 s goes to the provider (well inside the 60 s request deadline)
            "overflow": {"threshold_ms": 800, "cold_ttft_s": 0.3, "cold_service_s": 2.0,
                         "local_first_token_timeout_s": 15},
        }],
    }


def descendants(pid: int) -> dict[int, float]:
    with contextlib.suppress(psutil.Error):
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
    return {}


def end_processes(root: subprocess.Popen, seen: dict[int, float], grace_s: float = 60) -> None:
    """SIGINT to ``lmfleet serve`` (its own orderly shutdown), then kill whatever we saw that is left, by pid."""
    seen.update(descendants(root.pid))
    if root.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            root.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            root.wait(grace_s)
    if root.poll() is None:
        root.kill()
        root.wait(10)
    left = []
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                left.append(p)
    psutil.wait_procs(left, timeout=10)


@dataclass
class Target:
    base_url: str
    api_key: str
    admin_key: str
    pid: int


def start_fleet(work: Path, provider_url: str, timeout_s: float) -> tuple[Target, subprocess.Popen, Path]:
    port, sport = free_port(), free_port()
    cfg_path = work / "fleet.yaml"
    cfg_path.write_text(yaml.safe_dump(fleet_config(work, port, sport, provider_url), sort_keys=False))
    env = {**os.environ, "LMFLEET_SOAK_API_KEYS": API_KEY, "LMFLEET_SOAK_ADMIN_KEY": ADMIN_KEY,
           "LMFLEET_SOAK_PROVIDER_KEY": PROVIDER_KEY, "PYTHONUNBUFFERED": "1"}
    env.setdefault("LMFLEET_CACHE", "/tmp/lmfc")
    log = work / "serve.log"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "lmfleet"), "serve", "-c", str(cfg_path)], env=env,
                            cwd=work, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"lmfleet serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return Target(url, API_KEY, ADMIN_KEY, proc.pid), proc, log
        time.sleep(2)
    raise RuntimeError(f"{url}/ready not 200 after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def pid_listening_on(port: int) -> int | None:
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return c.pid
    return None


# ---------------------------------------------------------------------------------------------
# clients
# ---------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Outcomes by scenario; findings (unexpected answers) with a sample of their text."""

    outcomes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    served_by: Counter = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    finding_counts: Counter = field(default_factory=Counter)
    slow_close_s: list[float] = field(default_factory=list)

    def add(self, scenario: str, outcome: str, expected: bool, detail: str = "") -> None:
        self.outcomes[scenario][outcome] += 1
        if not expected:
            key = f"{scenario}: {outcome}"
            self.finding_counts[key] += 1
            if self.finding_counts[key] <= 3:
                self.findings.append(f"{key} {detail[:300]}")


def _chat(max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    words = " ".join(random.choices(["soak", "gateway", "token", "fleet", "cpu", "leak"], k=random.randint(3, 40)))
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens,
            "stream": stream, **extra}


def _completion(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "the soak test says " * random.randint(1, 10), "max_tokens": max_tokens,
            "stream": stream}


class Clients:
    def __init__(self, t: Target, tally: Tally):
        self.t = t
        self.tally = tally
        u = httpx.URL(t.base_url)
        self.host, self.port = u.host, u.port or 80
        self.auth = {"authorization": f"Bearer {t.api_key}"}
        self.http = httpx.AsyncClient(base_url=t.base_url, timeout=120,
                                      limits=httpx.Limits(max_connections=64, max_keepalive_connections=8))
        from openai import AsyncOpenAI

        self.oai = AsyncOpenAI(base_url=f"{t.base_url}/v1", api_key=t.api_key, max_retries=0, timeout=120)
        self.oai_bad = AsyncOpenAI(base_url=f"{t.base_url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)

    async def close(self) -> None:
        await self.http.aclose()
        await self.oai.close()
        await self.oai_bad.close()

    # ---- valid ----------------------------------------------------------------------------
    async def unary(self, name: str, path: str, body: dict[str, Any]) -> None:
        r = await self.http.post(path, json=body, headers=self.auth)
        self.tally.served_by[r.headers.get("x-lmfleet-served-by", "none")] += 1
        self.tally.add(name, str(r.status_code), r.status_code == 200, r.text)

    async def stream(self, name: str, path: str, body: dict[str, Any]) -> None:
        async with self.http.stream("POST", path, json=body, headers=self.auth) as r:
            self.tally.served_by[r.headers.get("x-lmfleet-served-by", "none")] += 1
            text = (await r.aread()).decode(errors="replace")
        if r.status_code != 200:
            self.tally.add(name, str(r.status_code), False, text)
        elif '"error"' in text:
            self.tally.add(name, "200+error_event", False, text[-300:])
        elif "data: [DONE]" not in text:
            self.tally.add(name, "200+no_done", False, text[-300:])
        else:
            self.tally.add(name, "200", True)

    async def openai_chat(self) -> None:
        import openai

        try:
            if random.random() < 0.5:
                await self.oai.chat.completions.create(**_chat(16, False))
            else:
                s = await self.oai.chat.completions.create(**_chat(16, True))
                async for _ in s:
                    pass
            self.tally.add("openai_chat", "200", True)
        except openai.APIStatusError as e:
            self.tally.add("openai_chat", str(e.status_code), False, str(e))

    async def openai_bad_key(self) -> None:
        import openai

        try:
            await self.oai_bad.chat.completions.create(**_chat(4, False))
            self.tally.add("openai_bad_key", "200", False)
        except openai.APIStatusError as e:
            self.tally.add("openai_bad_key", str(e.status_code), e.status_code == 401, str(e))

    # ---- client mistakes ------------------------------------------------------------------
    async def invalid(self, name: str, want: int, content: bytes | str, headers: dict[str, str] | None = None,
                      path: str = "/v1/chat/completions") -> None:
        h = {"content-type": "application/json", **self.auth, **(headers or {})}
        h = {k: v for k, v in h.items() if v is not None}
        r = await self.http.post(path, content=content, headers=h)
        ok = r.status_code == want and _openai_error(r)
        self.tally.add(name, str(r.status_code) + ("" if _openai_error(r) or r.status_code < 400 else "+not_openai"),
                       ok, r.text)

    def _head(self, path: str, length: int | None, extra: str = "") -> str:
        size = f"content-length: {length}\r\n" if length is not None else "transfer-encoding: chunked\r\n"
        return (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"authorization: Bearer {self.t.api_key}\r\nconnection: close\r\n{size}{extra}\r\n")

    async def too_large(self) -> None:
        """A 9 MiB body (max_body_bytes is 8 MiB) announced by Content-Length: 413 before it is read."""
        name = "too_large_declared"
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(self._head("/v1/chat/completions", 9 * MIB).encode() + b"{" + b" " * 65536)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(65536), 30)
        except (ConnectionError, TimeoutError) as e:
            self.tally.add(name, type(e).__name__, False)
            return
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        status = data[9:12].decode(errors="replace")
        self.tally.add(name, status, status == "413", data.decode(errors="replace"))

    async def too_large_chunked(self) -> None:
        """A chunked body growing past 8 MiB: 413 counted while reading (or the connection closed)."""
        name = "too_large_chunked"
        reader, writer = await asyncio.open_connection(self.host, self.port)
        chunk = b"%x\r\n%s\r\n" % (MIB, b" " * MIB)
        status = "closed"
        try:
            first = b'{"a":'
            writer.write(self._head("/v1/chat/completions", None).encode() + b"%x\r\n%s\r\n" % (len(first), first))
            for _ in range(12):
                writer.write(chunk)
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            data = await asyncio.wait_for(reader.read(65536), 30)
            status = data[9:12].decode(errors="replace") or "closed"
        except ConnectionError:
            with contextlib.suppress(Exception):
                data = await asyncio.wait_for(reader.read(65536), 5)
                status = data[9:12].decode(errors="replace") or "closed"
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        self.tally.add(name, status, status in ("413", "closed"))

    # ---- disconnecting clients -------------------------------------------------------------
    async def leave_before_first_token(self) -> None:
        """Send a whole request, close the connection 20-400 ms later without reading (the local engine's first
        token takes longer than that here; a provider answer may be faster)."""
        body = json.dumps(_chat(64, random.random() < 0.5)).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(self._head("/v1/chat/completions", len(body)).encode() + body)
            await writer.drain()
            await asyncio.sleep(random.uniform(0.02, 0.4))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        self.tally.add("leave_before_first_token", "client_closed", True)

    async def leave_mid_stream(self) -> None:
        path, body = random.choice([("/v1/chat/completions", _chat(96, True)),
                                    ("/v1/completions", _completion(96, True))])
        async with self.http.stream("POST", path, json=body, headers=self.auth) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                self.tally.add("leave_mid_stream", str(r.status_code), False, text)
                return
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events >= random.randint(1, 4):
                        break
        self.tally.add("leave_mid_stream", "client_closed", True)

    async def slow_header(self) -> None:
        """Slowloris: a request head trickled one header a second; the gateway must close it."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        t0 = time.monotonic()
        closed = False
        try:
            writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}\r\n".encode())
            while time.monotonic() - t0 < HEADER_TIMEOUT_S + 10:
                await asyncio.sleep(1.0)
                writer.write(b"x-slow: 1\r\n")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(1024), 0.01) == b"":
                        closed = True
                        break
        except ConnectionError:
            closed = True
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        dt = time.monotonic() - t0
        if closed:
            self.tally.slow_close_s.append(dt)
        self.tally.add("slow_header", "closed_by_gateway" if closed else "held_open", closed, f"after {dt:.1f} s")

    async def slow_body(self) -> None:
        """Complete head, body trickled: 408 after gateway.body_timeout_s (30 s)."""
        head = self._head("/v1/chat/completions", 200)
        reader, writer = await asyncio.open_connection(self.host, self.port)
        t0 = time.monotonic()
        status = "held_open"
        try:
            writer.write(head.encode() + b"{")
            while time.monotonic() - t0 < 45:
                await asyncio.sleep(2.0)
                with contextlib.suppress(TimeoutError):
                    data = await asyncio.wait_for(reader.read(1024), 0.01)
                    status = data[9:12].decode(errors="replace") or "closed"
                    break
                writer.write(b" ")
                await writer.drain()
        except ConnectionError:
            status = "closed"
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        self.tally.add("slow_body", status, status == "408", f"after {time.monotonic() - t0:.1f} s")


def _openai_error(r: httpx.Response) -> bool:
    with contextlib.suppress(ValueError):
        e = r.json().get("error")
        return isinstance(e, dict) and isinstance(e.get("message"), str)
    return False


def scenarios(c: Clients) -> list[tuple[float, str, Any]]:
    """(weight, name, coroutine factory). Valid requests are short (16-32 tokens): the engine is a 2-core CPU."""
    nested = b'{"model":"tiny","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    chat_ok = json.dumps(_chat(4, False))
    return [
        (6, "chat", lambda: c.unary("chat", "/v1/chat/completions", _chat(random.randint(8, 32), False))),
        (6, "chat_stream", lambda: c.stream("chat_stream", "/v1/chat/completions", _chat(random.randint(8, 32), True))),
        (3, "completion", lambda: c.unary("completion", "/v1/completions", _completion(16, False))),
        (3, "completion_stream", lambda: c.stream("completion_stream", "/v1/completions", _completion(16, True))),
        (3, "openai_chat", c.openai_chat),
        (1, "openai_bad_key", c.openai_bad_key),
        (2, "bad_json", lambda: c.invalid("bad_json", 400, b'{"model": "tiny", "messages": [')),
        (2, "text_plain", lambda: c.invalid("text_plain", 415, chat_ok, {"content-type": "text/plain"})),
        (1, "deep_nesting", lambda: c.invalid("deep_nesting", 400, nested)),
        (2, "nan", lambda: c.invalid("nan", 400, chat_ok[:-1] + ', "temperature": NaN}')),
        (2, "lone_surrogate", lambda: c.invalid(
            "lone_surrogate", 400, '{"model":"tiny","messages":[{"role":"user","content":"\\ud800"}]}')),
        (2, "unknown_model", lambda: c.invalid("unknown_model", 404, json.dumps({**_chat(4, False), "model": "nope"}))),
        (2, "missing_key", lambda: c.invalid("missing_key", 401, chat_ok, {"authorization": None})),
        (2, "wrong_key", lambda: c.invalid("wrong_key", 401, chat_ok, {"authorization": "Bearer sk-nope"})),
        (1, "bad_max_tokens", lambda: c.invalid("bad_max_tokens", 400, json.dumps({**_chat(4, False),
                                                                                   "max_tokens": "many"}))),
        (1, "bad_messages", lambda: c.invalid("bad_messages", 400, '{"model":"tiny","messages":5}')),
        (1, "bad_text_part", lambda: c.invalid("bad_text_part", 400, json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}))),
        (1, "bad_prompt", lambda: c.invalid("bad_prompt", 400, '{"model":"tiny","prompt":{"a":1}}',
                                            path="/v1/completions")),
        (1, "too_large_declared", c.too_large),
        (0.3, "too_large_chunked", c.too_large_chunked),
        (3, "leave_before_first_token", c.leave_before_first_token),
        (3, "leave_mid_stream", c.leave_mid_stream),
    ]


async def worker(c: Clients, table: list[tuple[float, str, Any]], stop: asyncio.Event, pause_s: float) -> None:
    weights = [w for w, _, _ in table]
    while not stop.is_set():
        _, name, make = random.choices(table, weights)[0]
        try:
            await make()
        except Exception as e:  # a transport failure is an outcome too
            c.tally.add(name, f"error:{type(e).__name__}", False, str(e))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), random.uniform(0, 2 * pause_s))


async def toggle_overflow(t: Target, stop: asyncio.Event, period_s: float, log: list[str]) -> None:
    """Alternate the model's overflow mode (auto, then force_on) every ``period_s`` through the admin API, so
    both the local and the provider path carry traffic, and switches happen with requests in flight on both.
    Leaves the mode at auto."""
    modes = ["force_on", "auto"]
    i = 0
    async with httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {t.admin_key}"}) as h:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
            mode = "auto" if stop.is_set() else modes[i % 2]
            i += 1
            try:
                r = await h.post(f"{t.base_url}/admin/overflow", json={"model": MODEL, "mode": mode})
                if r.status_code != 200:
                    log.append(f"admin/overflow {mode}: {r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                log.append(f"admin/overflow {mode}: {type(e).__name__}")
            if stop.is_set():
                return


async def slow_worker(c: Clients, stop: asyncio.Event, slow_body: bool) -> None:
    while not stop.is_set():
        try:
            await (c.slow_body() if slow_body else c.slow_header())
        except Exception as e:
            c.tally.add("slow_body" if slow_body else "slow_header", f"error:{type(e).__name__}", False, str(e))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------
async def in_flight(t: Target) -> dict[str, int] | None:
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.get(f"{t.base_url}/admin/state", headers={"authorization": f"Bearer {t.admin_key}"})
        s = r.json()
    except (httpx.HTTPError, ValueError):
        return None
    out = {f"local/{n}": int(m["in_flight"]) for n, m in s.get("models", {}).items()}
    out.update({f"provider/{n}": int(p["in_flight"]) for n, p in s.get("providers", {}).items()})
    return out


async def sample(t: Target, t0: float) -> dict[str, Any]:
    p = psutil.Process(t.pid)
    with p.oneshot():
        rss, fds, threads = p.memory_info().rss, p.num_fds(), p.num_threads()
    conns = len(p.net_connections(kind="tcp"))
    fl = await in_flight(t)
    return {"t_s": round(time.monotonic() - t0, 1), "rss_mib": round(rss / MIB, 2), "fds": fds, "threads": threads,
            "tcp": conns, "in_flight": fl, "in_flight_total": sum(fl.values()) if fl is not None else None}


async def sampler(t: Target, t0: float, out: list[dict[str, Any]], stop: asyncio.Event, every_s: float) -> None:
    while not stop.is_set():
        out.append(await sample(t, t0))
        s = out[-1]
        print(f"  [{s['t_s']:6.0f} s] rss {s['rss_mib']:8.1f} MiB  fds {s['fds']:4d}  threads {s['threads']:3d}  "
              f"tcp {s['tcp']:4d}  in-flight {s['in_flight_total']}", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def metrics_requests(t: Target) -> dict[str, float]:
    """lmfleet_requests_total by status, as the gateway counted them."""
    async with httpx.AsyncClient(timeout=10) as h:
        text = (await h.get(f"{t.base_url}/metrics", headers={"authorization": f"Bearer {t.admin_key}"})).text
    out: Counter = Counter()
    for line in text.splitlines():
        m = re.match(r'lmfleet_requests_total\{.*status="(\d+)".*\} ([0-9.e+]+)', line)
        if m:
            out[m.group(1)] += float(m.group(2))
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------------
def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    xs, ys = [p[0] / 60 for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def analyse(samples: list[dict[str, Any]], before: dict[str, Any], after: dict[str, Any], duration_s: float,
            warmup_s: float, window_s: float, tally: Tally, args: argparse.Namespace) -> dict[str, Any]:
    body = [s for s in samples if s["t_s"] >= warmup_s]
    first = [s for s in body if s["t_s"] < warmup_s + window_s]
    last = [s for s in body if s["t_s"] >= duration_s - window_s]
    med = lambda xs, k: statistics.median(s[k] for s in xs) if xs else None  # noqa: E731
    rss_slope = slope_per_min([(s["t_s"], s["rss_mib"]) for s in body])
    fd_slope = slope_per_min([(s["t_s"], s["fds"]) for s in body])
    span_min = max((statistics.fmean(s["t_s"] for s in last) - statistics.fmean(s["t_s"] for s in first)) / 60, 1e-9) \
        if first and last else None
    rss_window_growth = (med(last, "rss_mib") - med(first, "rss_mib")) if first and last else None
    fd_window_growth = (med(last, "fds") - med(first, "fds")) if first and last else None
    status = Counter()
    for outs in tally.outcomes.values():
        for o, n in outs.items():
            cls = f"{o[0]}xx" if o[:1].isdigit() and len(o) >= 3 and o[1:3].isdigit() else o.split(":")[0]
            status[cls] += n
    five_xx = sorted(k for k in tally.finding_counts if re.search(r": 5\d\d|error_event", k))
    failures, notes = [], []
    trend = duration_s >= args.min_trend_minutes * 60
    if not trend:  # the first minute's allocations (pools, caches) dominate a short run
        notes.append(f"run shorter than {args.min_trend_minutes:g} min: RSS/fd trends printed, not judged")
    if trend and rss_slope is not None and span_min and rss_window_growth is not None \
            and rss_slope > args.max_rss_slope and rss_window_growth / span_min > args.max_rss_slope:
        failures.append(f"RSS grows: slope {rss_slope:.2f} MiB/min, windows +{rss_window_growth:.1f} MiB")
    if after["fds"] - before["fds"] > args.fd_slack:
        failures.append(f"open fds grew at rest: {before['fds']} -> {after['fds']}")
    if trend and fd_window_growth is not None and fd_window_growth > args.fd_slack:
        failures.append(f"open fds grew under load: window medians +{fd_window_growth}")
    if after["in_flight_total"] != 0:
        failures.append(f"in-flight not back to 0: {after['in_flight']}")
    if five_xx:
        failures.append(f"5xx / error events: {five_xx}")
    other = sorted(k for k in tally.finding_counts if k not in five_xx)
    if other:
        failures.append(f"unexpected answers: {other}")
    return {
        "duration_s": round(duration_s, 1), "warmup_s": warmup_s, "window_s": window_s,
        "before": before, "after": after,
        "rss_slope_mib_per_min": rss_slope, "fd_slope_per_min": fd_slope,
        "rss_first_window_median_mib": med(first, "rss_mib"), "rss_last_window_median_mib": med(last, "rss_mib"),
        "fds_first_window_median": med(first, "fds"), "fds_last_window_median": med(last, "fds"),
        "threads_first_window_median": med(first, "threads"), "threads_last_window_median": med(last, "threads"),
        "rss_max_mib": max(s["rss_mib"] for s in samples) if samples else None,
        "in_flight_max": max((s["in_flight_total"] or 0) for s in samples) if samples else None,
        "requests_by_class": dict(sorted(status.items())), "requests_total": sum(status.values()),
        "by_scenario": {k: dict(v) for k, v in sorted(tally.outcomes.items())},
        "served_by": dict(tally.served_by),
        "slow_header_close_s": ([round(min(tally.slow_close_s), 1), round(statistics.median(tally.slow_close_s), 1),
                                 round(max(tally.slow_close_s), 1)] if tally.slow_close_s else None),
        "findings": tally.findings, "failures": failures, "notes": notes,
        "thresholds": {"max_rss_slope_mib_per_min": args.max_rss_slope, "fd_slack": args.fd_slack},
    }


def report(res: dict[str, Any], gateway_counts: dict[str, float]) -> None:
    b, a = res["before"], res["after"]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    print("\n== soak result ==")
    print(f"duration {res['duration_s']:.0f} s (warm-up {res['warmup_s']:.0f} s, windows {res['window_s']:.0f} s), "
          f"{res['requests_total']} client operations")
    print(f"{'':24}{'at rest before':>16}{'first window':>14}{'last window':>13}{'at rest after':>15}")
    print(f"{'RSS MiB':24}{b['rss_mib']:>16.1f}{f(res['rss_first_window_median_mib']):>14}"
          f"{f(res['rss_last_window_median_mib']):>13}{a['rss_mib']:>15.1f}")
    print(f"{'open fds':24}{b['fds']:>16d}{f(res['fds_first_window_median'], 0):>14}"
          f"{f(res['fds_last_window_median'], 0):>13}{a['fds']:>15d}")
    print(f"{'threads':24}{b['threads']:>16d}{f(res['threads_first_window_median'], 0):>14}"
          f"{f(res['threads_last_window_median'], 0):>13}{a['threads']:>15d}")
    print(f"{'in flight':24}{str(b['in_flight_total']):>16}{'':>14}{'max ' + str(res['in_flight_max']):>13}"
          f"{str(a['in_flight_total']):>15}")
    print(f"RSS slope after warm-up {f(res['rss_slope_mib_per_min'], 2)} MiB/min; fd slope "
          f"{f(res['fd_slope_per_min'], 2)}/min; peak RSS {f(res['rss_max_mib'])} MiB")
    print(f"by class: {res['requests_by_class']}")
    print(f"served by: {res['served_by']}")
    print(f"slow-header connections closed after (min/median/max s): {res['slow_header_close_s']}")
    print("by scenario:")
    for k, v in res["by_scenario"].items():
        print(f"  {k:26} {v}")
    print(f"gateway's own lmfleet_requests_total by status: {gateway_counts}")
    if res["findings"]:
        print("findings (first 3 of each):")
        for x in res["findings"]:
            print(f"  {x}")
    print("thresholds:", res["thresholds"])
    for n in res["notes"]:
        print(f"note: {n}")
    print("PASS" if not res["failures"] else "FAIL:\n  " + "\n  ".join(res["failures"]))


# ---------------------------------------------------------------------------------------------
async def soak(t: Target, args: argparse.Namespace) -> dict[str, Any]:
    duration = args.minutes * 60
    warmup = min(60.0, duration * 0.25)
    window = min(120.0, (duration - warmup) / 3)
    tally = Tally()
    c = Clients(t, tally)
    t0 = time.monotonic()
    before = await sample(t, t0)
    print(f"at rest before: {before}", flush=True)
    stop, stop_sampling = asyncio.Event(), asyncio.Event()
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    sampling = asyncio.create_task(sampler(t, t0, samples, stop_sampling, args.sample_s))
    table = scenarios(c)
    tasks = [asyncio.create_task(worker(c, table, stop, args.pause)) for _ in range(args.clients)]
    tasks += [asyncio.create_task(slow_worker(c, stop, slow_body=False)) for _ in range(args.slow)]
    tasks.append(asyncio.create_task(slow_worker(c, stop, slow_body=True)))
    if args.toggle_s > 0:
        tasks.append(asyncio.create_task(toggle_overflow(t, stop, args.toggle_s, tally.findings)))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), duration)
    stop.set()
    await asyncio.gather(*tasks)
    duration_s = time.monotonic() - t0
    stop_sampling.set()
    await sampling
    await c.close()
    # quiet: in flight back to 0, then past the keep-alive timeout so idle connections are gone
    deadline = time.monotonic() + args.quiet_timeout
    while (fl := await in_flight(t)) is None or sum(fl.values()) > 0:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    await asyncio.sleep(8)
    after = await sample(t, t0)
    print(f"at rest after: {after}", flush=True)
    res = analyse(samples, before, after, duration_s, warmup, window, tally, args)
    res["samples"] = samples
    counts = await metrics_requests(t)
    res["gateway_requests_by_status"] = counts
    report(res, counts)
    return res


def upstream_evidence(log: Path, serve_pid: int) -> None:
    """What the gateway and the engine logged about upstream trouble: explains a 5xx (or shows there was none)."""
    warn = [ln for ln in log.read_text(errors="replace").splitlines()
            if ('"levelname": "WARNING"' in ln or '"levelname": "ERROR"' in ln) and '"importing.py"' not in ln]
    print(f"gateway warnings/errors in {log.name}: {len(warn)}")
    for ln in warn[:8]:
        m = re.search(r'"asctime": "([^"]+)".*?"message": "(.*?)", "filename"', ln)
        print(f"  {m.group(1)} {m.group(2)[:200]}" if m else f"  {ln[:200]}")
    stalls = []
    for f in Path("/tmp/ray").glob(f"session_*_{serve_pid}/logs/worker-*.out"):
        stalls += [ln for ln in f.read_text(errors="replace").splitlines()
                   if "No available shared memory broadcast block" in ln or "EngineDeadError" in ln]
    print(f"engine stall/death lines in Ray's worker logs: {len(stalls)}")
    for ln in stalls[:5]:
        print(f"  {ln[:240]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--url", help="soak this running gateway instead of starting a fleet (model 'tiny')")
    ap.add_argument("--api-key", default=API_KEY)
    ap.add_argument("--admin-key", default=ADMIN_KEY)
    ap.add_argument("--pid", type=int, help="with --url: the gateway's process (default: who listens on its port)")
    ap.add_argument("--clients", type=int, default=6, help="concurrent mixed clients")
    ap.add_argument("--slow", type=int, default=2, help="concurrent slow-header (slowloris) clients")
    ap.add_argument("--pause", type=float, default=0.4, help="mean pause between one client's requests (s)")
    ap.add_argument("--toggle-s", type=float, default=20.0,
                    help="switch model 'tiny' between overflow force_on and auto this often (admin API; 0: never)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--quiet-timeout", type=float, default=60.0)
    ap.add_argument("--max-rss-slope", type=float, default=1.0, help="MiB/min (see the module docstring)")
    ap.add_argument("--fd-slack", type=int, default=16)
    ap.add_argument("--min-trend-minutes", type=float, default=3.0,
                    help="shorter runs print the RSS/fd trends without judging them")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true",
                    help="6 seconds, 2 clients, no overflow toggling: checks that the soak runs, measures nothing")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.clients, args.slow, args.toggle_s, args.sample_s, args.quiet_timeout = 0.1, 2, 1, 0, 2, 30
    random.seed(args.seed)
    print(f"soak_gateway: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"{args.minutes:g} min, {args.clients} clients + {args.slow} slow-header + 1 slow-body", flush=True)

    def _term(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    proc: subprocess.Popen | None = None
    seen: dict[int, float] = {}
    fake = None
    try:
        if args.url:
            pid = args.pid or pid_listening_on(httpx.URL(args.url).port or 80)
            if pid is None:
                print("soak_gateway: cannot find the gateway's process; pass --pid", file=sys.stderr)
                return 2
            t = Target(args.url.rstrip("/"), args.api_key, args.admin_key, pid)
        else:
            work = Path(tempfile.mkdtemp(prefix="lmfleet-soak-"))
            fake = FastServer("--ttft-ms", "200", "--itl-ms", "15", "--max-tokens", "96",
                              "--model", "fake-remote").__enter__()
            print(f"fake provider at {fake.base_url}; starting the fleet in {work} ...", flush=True)
            t0 = time.monotonic()
            t, proc, log = start_fleet(work, fake.base_url, args.start_timeout)
            seen.update(descendants(proc.pid))
            print(f"fleet ready after {time.monotonic() - t0:.0f} s at {t.base_url} (lmfleet serve pid {t.pid}, "
                  f"log {log})", flush=True)
            time.sleep(5)
        res = asyncio.run(soak(t, args))
        if proc is not None:
            upstream_evidence(log, proc.pid)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1))
        return 1 if res["failures"] else 0
    except KeyboardInterrupt:
        print("soak_gateway: interrupted", file=sys.stderr)
        return 130
    finally:
        if proc is not None:
            print("stopping the fleet ...", flush=True)
            end_processes(proc, seen)
        if fake is not None:
            fake.__exit__()


if __name__ == "__main__":
    raise SystemExit(main())

"""``lmfleet apply`` end to end (issue 49): its own fleet (``lmfleet serve`` with one tiny engine, a second
``lmfleet gateway`` process, two fake providers), under steady load through both gateways (local and provider
traffic, streamed and not, as one tenant), applies in turn a price change, a new provider, a threshold and policy
change, a tenant limit, replicas 1 -> 2 -> 1 and an engine option change that replaces the replica.

Asserts: no failed request and no truncated stream; ledger rows = answered requests; each change's settings seen by
both gateways within 5 s; replicas changed in place (the model never stopped serving locally meanwhile); during the
engine change requests went to the providers; ``apply --dry-run`` exits 0 and stores nothing (the next apply gets
the next number). Prints, per change: requests, spilled, failed, seconds until the change took effect.

Runs after the shared fleet has stopped (``e2e_order(3)``). Every process started here is ended here, by pid.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
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
import pytest
import yaml

from lmfleet.store import Ledger
from lmfleet.testing.fast_openai_server import FastServer
from tests.e2e.conftest import START_TIMEOUT_S, VENV_BIN, _wait_http, descendants, end_processes, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_order(3)]

ADMIN = "apply-e2e-admin"
TENANT_KEY = "apply-e2e-team-key"
MODEL = "tiny"
CLIENTS_PER_GATEWAY = 2
"""Closed-loop clients per gateway: four requests at once against a local capacity of two (some spill: the
threshold is short), light enough that the engine starts of the replica and engine changes are not slowed by it."""
THINK_S = 0.25
"""Between a client's requests: the provider answers in tens of milliseconds, and the gateways share two cores
with the engine being started."""
EFFECT_TIMEOUT_S = {"replicas 1 -> 2": 150.0, "engine max_num_seqs 2 -> 3": 180.0}
VISIBLE_S = 5.0
AUTH = {"authorization": f"Bearer {TENANT_KEY}"}


def _env() -> dict[str, str]:
    return {**os.environ, "APPLY_E2E_ADMIN": ADMIN, "APPLY_E2E_KEYS": TENANT_KEY, "PYTHONUNBUFFERED": "1"}


@dataclass
class Done:
    gateway: int
    t0: float
    t1: float
    stream: bool
    status: int
    served_by: str
    reason: str
    complete: bool
    """A stream ended with [DONE], a whole answer has a finish_reason."""
    error: str = ""

    @property
    def failed(self) -> bool:
        return self.status != 200 or not self.complete


class Load:
    """Closed-loop clients through each gateway until :meth:`stop`; every request recorded."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.done: list[Done] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(g, i), daemon=True)
                         for g in range(len(urls)) for i in range(CLIENTS_PER_GATEWAY)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _client(self, g: int, i: int) -> None:
        with httpx.Client(base_url=self.urls[g], timeout=120, headers=AUTH) as client:
            n = 0
            while not self._stop.is_set():
                rec = one(client, g, stream=(n + i) % 2 == 0, n=n)
                with self._lock:
                    self.done.append(rec)
                n += 1
                self._stop.wait(THINK_S)

    def between(self, t0: float, t1: float) -> list[Done]:
        with self._lock:
            return [d for d in self.done if t0 <= d.t0 < t1]


def one(client: httpx.Client, g: int, *, stream: bool, n: int) -> Done:
    body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": f"Count to ten, request {n}."}]}
    t0 = time.time()
    try:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                complete = (r.status_code == 200 and bool(lines) and lines[-1] == "data: [DONE]"
                            and not any(ln.startswith('data: {"error"') for ln in lines))  # a break's last event
                return Done(g, t0, time.time(), True, r.status_code, r.headers.get("x-lmfleet-served-by", ""),
                            r.headers.get("x-lmfleet-route-reason", ""), complete,
                            "" if complete else " ".join(lines[-2:])[:300])
        r = client.post("/v1/chat/completions", json=body)
        complete = r.status_code == 200 and bool(r.json()["choices"][0].get("finish_reason"))
        return Done(g, t0, time.time(), False, r.status_code, r.headers.get("x-lmfleet-served-by", ""),
                    r.headers.get("x-lmfleet-route-reason", ""), complete, "" if complete else r.text[:300])
    except httpx.HTTPError as e:
        return Done(g, t0, time.time(), stream, 0, "", "", False, f"{type(e).__name__}: {e}")


@dataclass
class ApplyFleet:
    urls: list[str]
    address: str
    work: Path
    config: dict
    ledger_path: str
    provider2_url: str

    def state(self, g: int) -> dict:
        r = httpx.get(f"{self.urls[g]}/admin/state", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
        r.raise_for_status()
        return r.json()

    def tenants(self, g: int) -> dict:
        r = httpx.get(f"{self.urls[g]}/admin/tenants", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
        r.raise_for_status()
        return r.json()["tenants"]

    def apply(self, name: str, config: dict, *flags: str) -> subprocess.CompletedProcess:
        path = self.work / f"{re.sub(r'[^a-z0-9]+', '-', name)}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return subprocess.run([str(VENV_BIN / "lmfleet"), "apply", "-c", str(path), "--address", self.address,
                               *flags], env=_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def applied_fleet(tmp_path_factory):
    from lmfleet.models import resolve_source

    resolve_source("builtin:tiny-random")
    work = tmp_path_factory.mktemp("apply")
    with FastServer("--ttft-ms", "30", "--itl-ms", "5") as p1, FastServer("--ttft-ms", "30", "--itl-ms", "5") as p2:
        port, sport, port2 = free_port(), free_port(), free_port()
        cfg = {
            "gateway": {"port": port, "serve_port": sport, "admin_key_env": "APPLY_E2E_ADMIN", "health_poll_s": 1,
                        "engine_metrics_poll_s": 1},
            "ledger": {"path": str(work / "ledger.sqlite")},
            "tenants": [{"name": "team", "api_keys_env": "APPLY_E2E_KEYS",
                         "limits": {"requests_per_minute": 100000}}],
            "providers": [{"name": "fake1", "base_url": f"{p1.base_url}/v1", "model_map": {MODEL: "fake-tiny"},
                           "price": {"input_per_1m": 1.0, "output_per_1m": 2.0},
                           "timeouts": {"connect_s": 2, "total_s": 60, "first_token_s": 30}}],
            "models": [{
                "name": MODEL, "source": "builtin:tiny-random",
                # eager: no torch.compile warm-up, so each engine start (a new replica, the engine change) is shorter;
                # float32: eager bfloat16 kernels can die of SIGILL on CPUs with AMX
                "engine": {"max_model_len": 512, "cpu_kvcache_space_gib": 1, "max_num_seqs": 2, "enforce_eager": True,
                           "dtype": "float32",
                           "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}},
                "deployment": {"replicas": 1, "max_ongoing_requests": 4, "request_timeout_s": 60},
                # the cold-start figures of a tiny engine (not a chat model's 1 s / 10 s): with those, the
                # estimates under load before much is measured are far over the threshold
                "overflow": {"threshold_ms": 700, "providers": ["fake1"], "cold_ttft_s": 0.2,
                             "cold_service_s": 1.0}}],
        }
        config_path = work / "fleet.yaml"
        config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        log1, log2 = work / "serve.log", work / "gateway2.log"
        serve = subprocess.Popen([str(VENV_BIN / "lmfleet"), "serve", "-c", str(config_path)], env=_env(), cwd=work,
                                 stdout=log1.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        gateway2 = None
        seen: dict[int, float] = {}
        seen2: dict[int, float] = {}
        try:
            _wait_http(f"http://127.0.0.1:{port}/ready", serve, log1, START_TIMEOUT_S, poll_s=1)
            seen.update(descendants(serve.pid))
            deadline = time.monotonic() + 60
            while not (m := re.search(r"lmfleet gateway .*--address (\S+)", log1.read_text())):  # after /ready
                assert serve.poll() is None and time.monotonic() < deadline, log1.read_text()[-3000:]
                time.sleep(0.5)
            gateway2 = subprocess.Popen([str(VENV_BIN / "lmfleet"), "gateway", "-c", str(config_path), "--address",
                                         m.group(1), "--port", str(port2), "--workers", "1"], env=_env(), cwd=work,
                                        stdout=log2.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
            _wait_http(f"http://127.0.0.1:{port2}/ready", gateway2, log2, 180, poll_s=1)
            seen2.update(descendants(gateway2.pid))
            yield ApplyFleet([f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port2}"], m.group(1), work, cfg,
                             cfg["ledger"]["path"], p2.base_url)
        finally:
            if gateway2 is not None:
                seen2.update(descendants(gateway2.pid))
                end_processes(gateway2, seen2)
            seen.update(descendants(serve.pid))
            end_processes(serve, seen, signal.SIGINT)


def _steps(base: dict, provider2_url: str) -> list[tuple[str, dict]]:
    """(name, the whole new file) for each change, in turn; each file is the one before plus one change."""
    out = []
    cfg = copy.deepcopy(base)

    def step(name, edit):
        edit(cfg)
        out.append((name, copy.deepcopy(cfg)))

    step("price", lambda c: c["providers"][0]["price"].update(input_per_1m=3.0, output_per_1m=6.0))
    step("new provider", lambda c: (c["providers"].append(
        {"name": "fake2", "base_url": f"{provider2_url}/v1", "model_map": {MODEL: "fake-tiny-2"},
         "price": {"input_per_1m": 0.5, "output_per_1m": 1.0},
         "timeouts": {"connect_s": 2, "total_s": 60, "first_token_s": 30}}),
        c["models"][0]["overflow"].update(providers=["fake2", "fake1"])))
    step("threshold + policy", lambda c: c["models"][0]["overflow"].update(
        threshold_ms=500, policy="hedge", hedge_after_ms=20000))
    step("tenant limit", lambda c: c["tenants"][0]["limits"].update(requests_per_minute=50000,
                                                                    tokens_per_minute=10_000_000))
    step("replicas 1 -> 2", lambda c: c["models"][0]["deployment"].update(replicas=2))
    step("replicas 2 -> 1", lambda c: c["models"][0]["deployment"].update(replicas=1))
    step("engine max_num_seqs 2 -> 3", lambda c: c["models"][0]["engine"].update(max_num_seqs=3))
    return out


def _took_effect(fleet: ApplyFleet, name: str, version: int, since: float) -> tuple[float, float, dict]:
    """Poll both gateways until ``name`` shows: (seconds until both run ``version``, seconds until the change took
    effect, what was seen on the way)."""
    seen = {"not_ready_at": None, "ready_again_at": None}
    visible = None
    deadline = since + EFFECT_TIMEOUT_S.get(name, 60.0)
    while time.time() < deadline:
        states = [fleet.state(0), fleet.state(1)]
        now = time.time()
        if visible is None and all(s["fleet_version"] == version for s in states):
            visible = now - since
        model = [s["models"][MODEL] for s in states]
        if name == "new provider":
            done = all("fake2" in s["providers"] for s in states)
        elif name == "threshold + policy":
            done = all(m["threshold_ms"] == 500 for m in model)
        elif name == "tenant limit":
            done = all(fleet.tenants(g)["team"]["limits"]["requests_per_minute"] == 50000 for g in (0, 1))
        elif name == "replicas 1 -> 2":
            done = all(m["running_replicas"] == 2 and m["capacity"] == 4 for m in model)
        elif name == "replicas 2 -> 1":
            done = all(m["running_replicas"] == 1 and m["capacity"] == 2 for m in model)
        elif name.startswith("engine"):
            if seen["not_ready_at"] is None and not model[0]["ready"]:
                seen["not_ready_at"] = now
            if seen.get("all_down_at") is None and not any(m["ready"] for m in model):
                seen["all_down_at"] = now  # no gateway sends locally from here
            if seen.get("all_down_at") is not None and seen.get("first_ready_at") is None and any(
                    m["ready"] for m in model):
                seen["first_ready_at"] = now  # one gateway sends locally again from here
            done = seen["not_ready_at"] is not None and all(m["ready"] and m["capacity"] == 3 for m in model)
            # (capacity: min(max_ongoing_requests 4, max_num_seqs) per replica, counted from the new version)
            if done:
                seen["ready_again_at"] = now
        else:
            done = True
        if visible is not None and done:
            return visible, now - since, seen
        time.sleep(0.2)
    pytest.fail(f"{name}: not in effect after {deadline - since:.0f} s (version seen after {visible} s): "
                f"{json.dumps([fleet.state(0)['models'][MODEL], fleet.state(1)['models'][MODEL]])[:1500]}")


def test_apply_under_load_loses_nothing(applied_fleet, capsys):
    fleet = applied_fleet
    t_start = time.monotonic()
    since = time.time()
    warm = []
    for g in (0, 1):  # warm-up: the engine's first request, both gateways' connections
        with httpx.Client(base_url=fleet.urls[g], timeout=120, headers=AUTH) as c:
            warm.append(one(c, g, stream=False, n=0))
    assert not any(d.failed for d in warm), warm
    version = fleet.state(0)["fleet_version"]
    assert version == fleet.state(1)["fleet_version"] == 1
    load = Load(fleet.urls).start()
    report: list[tuple[str, list[Done], float, float, float]] = []
    windows: dict[str, tuple[float, float, dict]] = {}
    steps = _steps(fleet.config, fleet.provider2_url)
    pool = cf.ThreadPoolExecutor(1)  # each file's dry run goes alongside the wait for the change before it
    dry_run = pool.submit(fleet.apply, *steps[0], "--dry-run")
    try:
        time.sleep(4)  # steady state before the first change
        for k, (name, cfg) in enumerate(steps):
            dry = dry_run.result()
            assert dry.returncode == 0 and "dry run" in dry.stdout and "nothing changed" in dry.stdout, \
                dry.stdout + dry.stderr
            t0 = time.time()
            real = fleet.apply(name, cfg)
            stored = time.time()  # the command returns once the version is stored
            if k + 1 < len(steps):  # against the version just stored
                dry_run = pool.submit(fleet.apply, *steps[k + 1], "--dry-run")
            assert real.returncode == 0, real.stdout + real.stderr
            version += 1
            assert f"now version {version}" in real.stdout, real.stdout  # the dry run stored nothing
            visible, effect, seen = _took_effect(fleet, name, version, stored)
            assert visible <= VISIBLE_S, f"{name}: version {version} seen by both gateways after {visible:.1f} s"
            windows[name] = (t0, stored + effect, seen)
            time.sleep(2)  # requests under the new settings before the next change
            report.append((name, load.between(t0, time.time()), visible, effect, stored - t0))
        time.sleep(2)
    finally:
        load.stop()
        pool.shutdown()

    done = load.done
    with capsys.disabled():
        print(f"\n[apply e2e] {len(done)} requests through 2 gateways in {time.monotonic() - t_start:.0f} s "
              f"(local {sum(d.served_by.startswith('local/') for d in done)}, "
              f"provider {sum(d.served_by.startswith('provider/') for d in done)})")
        print("per change, from the apply command's start until 2 s after the change took effect (visible: seconds "
              "from the stored version until both gateways ran it; effect: until the change showed; apply: the "
              "command's own seconds)")
        print(f"{'change':<28}{'requests':>9}{'spilled':>9}{'failed':>8}{'apply s':>9}{'visible s':>11}"
              f"{'effect s':>10}")
        for name, rows, visible, effect, took in report:
            print(f"{name:<28}{len(rows):>9}{sum(d.served_by.startswith('provider/') for d in rows):>9}"
                  f"{sum(d.failed for d in rows):>8}{took:>9.1f}{visible:>11.1f}{effect:>10.1f}")

    failed = [d for d in done if d.failed]
    assert failed == [], failed[:5]
    assert any(d.served_by.startswith("local/") for d in done) and any(d.served_by.startswith("provider/") for d in done)
    assert any(d.stream for d in done) and any(not d.stream for d in done)
    assert any(d.served_by == "provider/fake2" for d in load.between(windows["new provider"][1], time.time()))

    # replicas changed in place: the running replica kept serving (the model was never down meanwhile)
    for name in ("replicas 1 -> 2", "replicas 2 -> 1"):
        t0, t1, _ = windows[name]
        assert not [d for d in load.between(t0, t1) if d.reason == "local_unavailable"], name
    # the engine change replaced the replica: while it was down, requests went to the providers
    t0, t1, seen = windows["engine max_num_seqs 2 -> 3"]
    down = load.between(seen["all_down_at"], seen["first_ready_at"] - 0.5)  # both gateways saw it down
    local = [(d.gateway, d.served_by, d.reason) for d in down if not d.served_by.startswith("provider/")]
    assert down and not local, local[:10]

    # the ledger: one row per answered request (the warm-up's included), besides the rows of hedges' cancelled
    # attempts (status 499, docs/overflow.md)
    answered = sum(d.status == 200 for d in done + warm)
    deadline = time.monotonic() + 30
    while True:
        all_rows = Ledger(fleet.ledger_path).rows(since=since)
        rows = [r for r in all_rows if str(r["status"]) != "499"]  # the ledger keeps the status as text
        if len(rows) >= answered or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    with capsys.disabled():
        print(f"ledger: {len(rows)} rows for {answered} answered requests (+{len(all_rows) - len(rows)} cancelled "
              "hedge attempts)")
    assert len(rows) == answered
    assert {r["tenant"] for r in rows} == {"team"}, "every request was the tenant's (its key)"
    # each request priced with the prices in force when it was admitted: fake1 after the price change
    t_price = windows["price"][1] + 2  # a request admitted before the change is charged the old price
    for r in rows:
        if r["served_by"] == "provider/fake1" and r["ts"] > t_price:
            assert r["cost_usd"] == pytest.approx((3.0 * r["input_tokens"] + 6.0 * r["output_tokens"]) / 1e6,
                                                  abs=5e-9), r

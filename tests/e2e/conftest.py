"""Session fixtures for end-to-end tests: one real fleet shared by every e2e test.

``fleet``: ``lmfleet serve`` started through the real CLI (real Ray, real Ray Serve LLM, real vLLM CPU
engines) with two models, ``smollm2`` (builtin:smollm2) and ``tiny`` (builtin:tiny-random), and one
overflow provider, ``backup``: a second, bare vLLM OpenAI server (SmolLM2, served as ``smollm2-remote``,
with a real API key) behind a fault-injecting proxy. Both engines start in parallel.

Engines cost about a minute each to start here, so everything is shared. The order of the e2e tests is set by
the ``e2e_order(n)`` marker (:func:`pytest_collection_modifyitems`), not by file names: the multinode tests run
first (their own cluster must be gone before ``fleet`` starts), with the first-run terminal test (a fleet of its
own); the tests that break the shared fleet (engine death, then shutdown) after the others; last the tests with a
fleet of their own that would only slow down beside it (prefix routing).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

# free_port: outside the ephemeral range (the fleet's serve_port is bound by HAProxy only once Ray is up)
from lmfleet.net import free_port  # noqa: F401  (e2e modules import it from here)
from lmfleet.testing.fleet import wait_http as _wait_http

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
START_TIMEOUT_S = float(os.environ.get("LMFLEET_TEST_START_TIMEOUT", "900"))

API_KEY = "sk-lmfleet-test-client"
ADMIN_KEY = "lmfleet-test-admin"
PROVIDER_KEY = "sk-provider-secret-7f3a9c"
TENANT_A_KEY = "sk-lmfleet-test-tenant-a"  # tenants of tests/e2e/test_tenants_e2e.py
TENANT_B_KEY = "sk-lmfleet-test-tenant-b"


def fleet_env() -> dict[str, str]:
    """The environment the shared fleet's file needs (every key its `*_env` settings name): for `lmfleet serve`
    and for any other process that loads the same file (a second `lmfleet gateway`, the CLI)."""
    return {**os.environ, "LMFLEET_TEST_API_KEYS": API_KEY, "LMFLEET_TEST_ADMIN_KEY": ADMIN_KEY,
            "LMFLEET_TEST_PROVIDER_KEY": PROVIDER_KEY, "PYTHONUNBUFFERED": "1",
            "LMFLEET_TEST_TENANT_A_KEYS": TENANT_A_KEY, "LMFLEET_TEST_TENANT_B_KEYS": TENANT_B_KEY}


def descendants(pid: int) -> dict[int, float]:
    with contextlib.suppress(psutil.Error):
        return {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
    return {}


def alive(pids: dict[int, float]) -> list[psutil.Process]:
    out = []
    for pid, created in pids.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def end_processes(root: subprocess.Popen, seen: dict[int, float], sig=signal.SIGTERM, grace_s: float = 30) -> None:
    """End a process we started and every descendant we saw, by pid."""
    seen.update(descendants(root.pid))
    if root.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            root.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            root.wait(grace_s)
    procs = alive(seen)
    if root.poll() is None:
        root.kill()
        root.wait(10)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def haproxies(pids: dict[int, float]) -> list[psutil.Process]:
    """The HAProxy processes (Ray Serve's direct-streaming proxy) among ``pids`` that are still alive."""
    out = []
    for p in alive(pids):
        with contextlib.suppress(psutil.Error):
            if p.name() == "haproxy":
                out.append(p)
    return out


def haproxy_node_dirs(procs: list[psutil.Process]) -> set[str]:
    """``/tmp/haproxy-serve/<node id>/`` folders named on HAProxy command lines (one per Ray node)."""
    dirs = set()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for arg in p.cmdline():
                if "/haproxy-serve/" in arg:
                    dirs.add(arg.rsplit("/", 1)[0] + "/")
    return dirs


def haproxies_of(node_dirs: set[str]) -> list[str]:
    """Every live HAProxy on this machine serving one of ``node_dirs`` (also orphans a reload left behind)."""
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if p.info.get("name") == "haproxy" and any(d in cmd for d in node_dirs):
            out.append(f"{p.pid} {cmd[:120]}")
    return out


def listening(procs: list[psutil.Process]) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket the given processes listen on."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            name = p.name()
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((c.laddr.ip, c.laddr.port, name))
    return out


@dataclass
class Fleet:
    base_url: str
    models: list[str]
    admin_key: str
    api_key: str
    config_path: Path
    log_path: Path
    proc: subprocess.Popen
    provider_url: str  # the fault proxy in front of the provider, without /v1
    provider_direct_url: str
    proxy: object
    seen_pids: dict[int, float] = field(default_factory=dict)

    def client(self, **kw):
        from openai import OpenAI

        kw.setdefault("api_key", self.api_key)
        return OpenAI(base_url=f"{self.base_url}/v1", max_retries=0, **kw)

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{self.base_url}{path}", headers={"authorization": f"Bearer {self.admin_key}"},
                             timeout=30, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


_LOGS: list[Path] = []  # the shared fleet's logs, for the failure summary below


def e2e_position(item: pytest.Item) -> int:
    """The test's ``e2e_order(n)`` (0 when unmarked): lower runs earlier; equal ones keep their collected order."""
    marker = item.get_closest_marker("e2e_order")
    return int(marker.args[0]) if marker is not None else 0


def pytest_collection_modifyitems(session, config, items):
    """Sort the e2e tests by ``e2e_order`` (a stable sort: file and definition order otherwise); other tests keep
    their places."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in Path(str(item.path)).parents]
    ordered = sorted((items[i] for i in slots), key=e2e_position)
    for i, item in zip(slots, ordered):
        items[i] = item


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """On failure, show the gateway's own warnings: CI keeps only the tail of the output."""
    if not terminalreporter.stats.get("failed"):
        return
    for log in _LOGS:
        if not log.exists():
            continue
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if "WARNING" in ln or "ERROR" in ln or "Traceback" in ln]
        terminalreporter.section(f"warnings in {log.name} (last 15 of {len(lines)})")
        for ln in lines[-15:]:
            terminalreporter.write_line(ln[:300])


@pytest.fixture(scope="session")
def fleet(tmp_path_factory) -> Fleet:
    from lmfleet.models import resolve_source
    from lmfleet.testing.fault_proxy import FaultProxy

    work = tmp_path_factory.mktemp("fleet")
    env = fleet_env()

    # the external provider: a bare vLLM OpenAI server that really checks its API key
    smol = resolve_source("builtin:smollm2")
    resolve_source("builtin:tiny-random")
    pport = free_port()
    plog = work / "provider.log"
    provider = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smol, "--served-model-name",
         "smollm2-remote", "--host", "127.0.0.1", "--port", str(pport), "--max-model-len", "2048", "--dtype", "float32",
         "--api-key", PROVIDER_KEY, "--disable-log-stats", "--enforce-eager"],  # no warm-up beside the fleet's
        env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=plog.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    proxy = FaultProxy(f"http://127.0.0.1:{pport}")
    proxy.start_in_thread()

    port, sport = free_port(), free_port()
    cfg = {
        "gateway": {"port": port, "serve_port": sport, "api_keys_env": "LMFLEET_TEST_API_KEYS",
                    "admin_key_env": "LMFLEET_TEST_ADMIN_KEY", "health_poll_s": 1},
        "ledger": {"path": str(work / "ledger.sqlite")},
        "providers": [{
            "name": "backup", "base_url": f"{proxy.url}/v1", "api_key_env": "LMFLEET_TEST_PROVIDER_KEY",
            "model_map": {"smollm2": "smollm2-remote"}, "price": {"input_per_1m": 0.5, "output_per_1m": 1.5},
            "timeouts": {"connect_s": 2, "total_s": 120, "first_token_s": 30}, "max_retries": 2,
            "breaker": {"consecutive_failures": 3, "cooldown_s": 5, "backoff_base_s": 0.1, "backoff_cap_s": 1},
        }],
        "models": [
            # eager, as the embedded default runs (torch.compile would add a minute of warm-up to the fleet's start)
            {"name": "smollm2", "source": "builtin:smollm2",
             "engine": {"max_model_len": 2048, "cpu_kvcache_space_gib": 1, "max_num_seqs": 8, "enforce_eager": True},
             "deployment": {"max_ongoing_requests": 8, "request_timeout_s": 120, "stream_batching_interval_ms": 0},
             "cost": {"node_hour_usd": 0.10}},
            # eager: a random-weight model gains nothing from torch.compile's warm-up, which would share the two cores
            # with the other engines' starts; float32: eager bfloat16 kernels can die of SIGILL on CPUs with AMX
            {"name": "tiny", "source": "builtin:tiny-random",
             "engine": {"max_model_len": 1024, "cpu_kvcache_space_gib": 1, "enforce_eager": True, "dtype": "float32",
                        "profiler_dir": str(work / "profiles")},  # lmfleet profile --trace (test_profile_e2e)
             "deployment": {"request_timeout_s": 60}, "overflow": {"enabled": False}},
        ],
        # the flat key above stays tenant "default" (unlimited, interactive); A and B: test_tenants_e2e.py
        "tenants": [
            {"name": "tenant-a", "api_keys_env": "LMFLEET_TEST_TENANT_A_KEYS", "priority": "batch",
             "limits": {"max_concurrency": 4, "requests_per_minute": 100000, "tokens_per_minute": 10000000}},
            {"name": "tenant-b", "api_keys_env": "LMFLEET_TEST_TENANT_B_KEYS", "limits": {"requests_per_minute": 10000}},
        ],
    }
    config_path = work / "fleet.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log_path = work / "serve.log"
    _LOGS.extend([log_path, plog])
    # --verbose: the log holds Ray's and the engines' lines too (for failures, and for the checks that no secret leaks)
    proc = subprocess.Popen([str(VENV_BIN / "lmfleet"), "serve", "-c", str(config_path), "--verbose"], env=env,
                            cwd=work,
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    f = Fleet(f"http://127.0.0.1:{port}", ["smollm2", "tiny"], ADMIN_KEY, API_KEY, config_path, log_path, proc,
              proxy.url, f"http://127.0.0.1:{pport}", proxy)
    provider_seen: dict[int, float] = {}
    try:
        _wait_http(f"{f.base_url}/ready", proc, log_path, START_TIMEOUT_S)
        _wait_http(f"http://127.0.0.1:{pport}/v1/models", provider, plog, START_TIMEOUT_S,
                   headers={"authorization": f"Bearer {PROVIDER_KEY}"})
        f.seen_pids.update(descendants(proc.pid))
        provider_seen.update(descendants(provider.pid))
        yield f
    finally:
        end_processes(proc, f.seen_pids, signal.SIGINT)
        end_processes(provider, provider_seen)
        proxy.stop_thread()

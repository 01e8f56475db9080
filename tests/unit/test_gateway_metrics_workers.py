"""/metrics summed over a node's gateway processes (lmfleet.gateway.observe.metrics, prometheus_client's
multiprocess mode): how each gauge combines, the folder's owner, and two real gateway workers behind one port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from lmfleet.gateway.admin.dashboard import read_counters
from lmfleet.gateway.observe.metrics import MULTIPROC_ENV, GatewayMetrics, SharedMetricsDir, multiproc_dir
from lmfleet.net import free_port
from lmfleet.overflow.engine_stats import ReplicaStats
from lmfleet.serve.gateway_proc import forget_ended_workers, shared_metrics, stop_workers
from lmfleet.testing.fast_openai_server import FastServer

REPO = Path(__file__).resolve().parents[2]


def _env(shared: SharedMetricsDir) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), **shared.env()}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _node_page(path: str) -> dict[tuple[str, tuple], float]:
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path)
    return _samples(generate_latest(reg).decode())


# one process's state: in flight, model ready, budget store up, ledger failing, queue estimate, dropped rows
PROCESS = textwrap.dedent("""
    import os, sys
    from lmfleet.gateway.observe.metrics import GatewayMetrics
    in_flight, ready, store_up, failing, estimate, dropped = (float(x) for x in sys.argv[1:])
    m = GatewayMetrics()
    m.requests.labels("m", "local", "200").inc()
    m.latency.labels("m", "local").observe(0.2)
    m.in_flight.labels("m", "local").set(in_flight)
    m.model_ready.labels("m").set(ready)
    m.budget_store_up.set(store_up)
    m.ledger_failing.set(failing)
    m.queue_estimate.labels("m").set(estimate)
    m.ledger_dropped.set(dropped)
    print(os.getpid(), flush=True)
""")

# (gauge sample, labels, the node's value with both processes, with the second ended)
GAUGES = [
    ("lmfleet_in_flight_requests", (("model", "m"), ("served_by", "local")), 5.0, 2.0),  # livesum
    ("lmfleet_model_ready", (("model", "m"),), 0.0, 1.0),  # livemin: a process that sees it down routes around
    ("lmfleet_budget_store_up", (), 0.0, 1.0),  # livemin
    ("lmfleet_ledger_write_failing", (), 1.0, 0.0),  # livemax
    ("lmfleet_queue_estimate_ms", (("model", "m"),), 70.0, 40.0),  # livemostrecent: the second set it last
    ("lmfleet_ledger_rows_dropped", (), 7.0, 7.0),  # sum: since start, ended workers included
]


def test_each_gauge_combines_over_processes_as_its_mode_says():
    with SharedMetricsDir() as shared:
        pids = []
        for argv in (["2", "1", "1", "0", "40", "3"], ["3", "0", "0", "1", "70", "4"]):
            p = subprocess.run([sys.executable, "-c", PROCESS, *argv], env=_env(shared), capture_output=True,
                               text=True, timeout=120)
            assert p.returncode == 0, p.stderr[-2000:]
            pids.append(int(p.stdout))
        both = _node_page(shared.path)
        shared.worker_gone(pids[1])
        one = _node_page(shared.path)
        for name, labels, with_both, with_first in GAUGES:
            assert (both[(name, labels)], one[(name, labels)]) == (with_both, with_first), name
        for page in (both, one):  # counters and histograms: every process, ended ones included
            assert page[("lmfleet_requests_total", (("model", "m"), ("served_by", "local"), ("status", "200")))] == 2
            assert page[("lmfleet_request_latency_seconds_count", (("model", "m"), ("served_by", "local")))] == 2
    assert not Path(shared.path).exists()


def test_a_worker_that_ended_stops_counting_in_live_gauges_only():
    with SharedMetricsDir() as shared:
        ended = subprocess.Popen([sys.executable, "-c", "pass"])
        ended.wait()
        running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            kinds = ("gauge_livesum", "gauge_livemin", "gauge_sum", "counter", "histogram")
            for p in (ended, running):
                for kind in kinds:
                    (Path(shared.path) / f"{kind}_{p.pid}.db").touch()
            forgotten: set[int] = set()
            forget_ended_workers([ended, running], shared, forgotten)
            assert forgotten == {ended.pid}
            left = {f.name for f in Path(shared.path).iterdir()}
            assert left == {f"{k}_{running.pid}.db" for k in kinds} | {
                f"{k}_{ended.pid}.db" for k in ("gauge_sum", "counter", "histogram")}
            forget_ended_workers([ended, running], shared, forgotten)  # once per worker
            assert forgotten == {ended.pid}
        finally:
            running.kill()
            running.wait()


def test_a_single_process_keeps_in_process_metrics():
    assert shared_metrics(1) is None
    assert multiproc_dir() is None
    m = GatewayMetrics()
    assert m.multiproc_dir is None
    m.in_flight.labels("m", "local").set(2)
    assert 'lmfleet_in_flight_requests{model="m",served_by="local"} 2.0' in m.exposition().decode()


def test_the_starting_process_writes_to_the_folder_it_owns_and_removes_it():
    before = os.environ.get(MULTIPROC_ENV)
    shared = shared_metrics(2)
    try:
        assert shared is not None and os.environ[MULTIPROC_ENV] == shared.path == multiproc_dir()
        m = GatewayMetrics()
        m.requests.labels("m", "local", "200").inc(3)
        m.set_replicas({"m": {"r1": ReplicaStats(running=2, waiting=1), "r2": ReplicaStats(running=0)}})
        page = _samples(m.exposition().decode())
        assert page[("lmfleet_requests_total", (("model", "m"), ("served_by", "local"), ("status", "200")))] == 3
        assert any(f.name.startswith("counter_") for f in Path(shared.path).iterdir())
        assert page[("lmfleet_replica_load_imbalance", (("model", "m"),))] == 3
        m.set_replicas({"m": {"r2": ReplicaStats(running=1)}})  # r1 gone since the last poll
        page = _samples(m.exposition().decode())
        assert ("lmfleet_replica_requests_running", (("model", "m"), ("replica", "r1"))) not in page
        assert page[("lmfleet_replica_requests_running", (("model", "m"), ("replica", "r2")))] == 1
        other = subprocess.run([sys.executable, "-c", PROCESS, "0", "1", "1", "0", "0", "0"], env=_env(shared),
                               capture_output=True, text=True, timeout=120)
        assert other.returncode == 0, other.stderr[-2000:]
        assert read_counters(m)["m"].local == 3 + 1  # the dashboard's counts are the node's too
    finally:
        if shared is not None:
            shared.close()
    assert not Path(shared.path).exists()
    assert os.environ.get(MULTIPROC_ENV) == before and values.ValueClass is values.MutexValue
    assert GatewayMetrics().multiproc_dir is None


WORKER = "from lmfleet.testing.relay_load import serve_gateway_worker; import sys; serve_gateway_worker(*sys.argv[1:])"


def _fleet(folder: Path, port: int) -> Path:
    fleet = {"gateway": {"host": "127.0.0.1", "port": port, "health_poll_s": 60, "engine_metrics_poll_s": 0,
                         "metrics_public": True},
             "models": [{"name": "m", "source": "builtin:tiny-random", "overflow": {"enabled": False}}],
             "ledger": {"path": str(folder / "ledger.sqlite")}}
    path = folder / "fleet.yaml"
    path.write_text(json.dumps(fleet))  # JSON is YAML
    return path


def _listens(pid: int, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except psutil.Error:
        return False


def _get(url: str, body: bytes | None = None) -> bytes:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=10).read()


def test_two_gateway_workers_on_one_port_serve_the_node_sums(tmp_path):
    """Two gateway processes behind one port (SO_REUSEPORT), the folder owned by the process that started them:
    whichever process answers /metrics, lmfleet_requests_total is every request; the folder is gone after stop."""
    from lmfleet.models import resolve_source

    resolve_source("builtin:tiny-random")  # built once here, not by two workers at once
    port, n = free_port(), 12
    cfg = _fleet(tmp_path, port)
    body = json.dumps({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}).encode()
    t0 = time.monotonic()
    with FastServer() as fake, SharedMetricsDir() as shared:
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(cfg), fake.base_url], env=_env(shared),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
        try:
            deadline = time.monotonic() + 60
            while not all(_listens(p.pid, port) for p in procs):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                    b"".join(p.stderr.read() for p in procs if p.poll() is not None)[-3000:]
                time.sleep(0.2)
            url = f"http://127.0.0.1:{port}"
            for _ in range(n):  # a new connection each: the kernel spreads them over both processes
                assert b'"choices"' in _get(f"{url}/v1/chat/completions", body)
            writers = {f.name.split("_")[-1][:-3] for f in Path(shared.path).glob("counter_*.db")}
            assert writers == {str(p.pid) for p in procs}, "both workers served requests"
            for _ in range(4):  # any process may answer the scrape: each one sums both
                page = _samples(_get(f"{url}/metrics").decode())
                total = sum(v for (name, _), v in page.items() if name == "lmfleet_requests_total")
                assert total == n, page
        finally:
            assert stop_workers(procs, grace_s=10.0, metrics=shared) == 0
    assert not Path(shared.path).exists()
    assert time.monotonic() - t0 < 60

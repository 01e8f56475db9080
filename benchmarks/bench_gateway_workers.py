"""Relay throughput of 1, 2, 4... gateway worker processes sharing one port (SO_REUSEPORT), on a fake engine that
costs ~nothing (lmfleet/testing/fast_openai_server.py) — what ``gateway.workers`` / ``--gateway-workers`` buys.

Each configuration runs N gateway processes on one port, built the way ``lmfleet serve`` builds its gateway
(``build_gateway``), served by the same server code as its workers (``lmfleet.serve.gateway_proc``: the shared
socket, ``GatewayServer``, uvloop when installed), with no Ray: the model's only backend is the fake, overflow
off. Load: ``--concurrency`` keep-alive clients (``lmfleet.testing.relay_load``'s raw-asyncio generator, one request in flight
each) streaming ``--max-tokens``-token chat completions for ``--duration`` s; rounds alternate the order of the
configurations. Reported: req/s, P50/P99 TTFT, and the CPU (cores) of all gateway processes together, of the
fake and of the client — on a small machine the three share the cores, so read them before reading a ratio.

    .venv/bin/python benchmarks/bench_gateway_workers.py --workers 1,2,4 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from lmfleet.net import free_port
from lmfleet.testing.relay_load import PhaseResult, cpu_s, http_json, pct, run_load, serve_gateway_worker


def write_fleet(folder: Path, port: int) -> Path:
    fleet = {
        "gateway": {"host": "127.0.0.1", "port": port, "health_poll_s": 60, "engine_metrics_poll_s": 0},
        "models": [{"name": "m", "source": "builtin:tiny-random", "overflow": {"enabled": False},
                    "deployment": {"max_ongoing_requests": 1024}}],
        "ledger": {"path": str(folder / f"ledger-{port}.sqlite")},
    }
    path = folder / f"fleet-{port}.yaml"
    path.write_text(json.dumps(fleet, indent=2))  # JSON is YAML
    return path


def start_workers(folder: Path, fake_url: str, n: int) -> tuple[str, list[subprocess.Popen]]:
    port = free_port("127.0.0.1")
    cfg = write_fleet(folder, port)
    procs = []
    for i in range(n):
        log = open(folder / f"gateway-{port}-{i}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-worker", str(cfg), "--fake-url", fake_url],
                                      stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # every worker listens (its server started) and the port answers
        for p in procs:
            if p.poll() is not None:
                stop(procs)
                raise RuntimeError(f"gateway worker exited with {p.returncode}; see {folder}")
        with contextlib.suppress(OSError):
            if all(_listens(p.pid, port) for p in procs) and http_json("GET", f"{url}/health")[0] == 200:
                return url, procs
        time.sleep(0.2)
    stop(procs)
    raise TimeoutError(f"{n} gateway workers not all listening on {port} after 120 s")


def _listens(pid: int, port: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    return False


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def measure(url: str, concurrency: int, duration_s: float, max_tokens: int, gateways: list[psutil.Process],
            fake: psutil.Process) -> PhaseResult:
    import asyncio

    me = psutil.Process()
    before = {"gateway": sum(cpu_s(p) for p in gateways), "fake": cpu_s(fake), "client": cpu_s(me)}
    res = asyncio.run(run_load(url, "m", concurrency, duration_s, max_tokens))
    after = {"gateway": sum(cpu_s(p) for p in gateways), "fake": cpu_s(fake), "client": cpu_s(me)}
    res.cpu = {k: after[k] - before[k] for k in before}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4", help="worker counts to compare")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--itl-ms", type=float, default=0.0, help="the fake engine's inter-token latency")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds, tiny sizes: checks that the benchmark runs, measures nothing")
    ap.add_argument("--serve-worker", help=argparse.SUPPRESS)
    ap.add_argument("--fake-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_worker:
        serve_gateway_worker(args.serve_worker, args.fake_url)
        return
    if args.smoke:
        args.workers, args.duration, args.rounds, args.concurrency = "1", 0.5, 1, 4

    from lmfleet.testing.fast_openai_server import FastServer

    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    load_before = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    results: dict[int, list[PhaseResult]] = {n: [] for n in counts}
    fake_args = ["--itl-ms", str(args.itl_ms), "--max-tokens", str(args.max_tokens)]
    with tempfile.TemporaryDirectory(prefix="bench-gw-workers-") as tmp, FastServer(*fake_args) as fake:
        fake_ps = psutil.Process(fake.proc.pid)
        running: dict[int, tuple[str, list[subprocess.Popen]]] = {}
        try:
            for n in counts:
                running[n] = start_workers(Path(tmp), fake.base_url, n)
                measure(running[n][0], args.concurrency, 1.0, args.max_tokens, [], fake_ps)  # warm up
            for r in range(args.rounds):
                for n in (counts if r % 2 == 0 else counts[::-1]):
                    url, procs = running[n]
                    res = measure(url, args.concurrency, args.duration, args.max_tokens,
                                  [psutil.Process(p.pid) for p in procs], fake_ps)
                    results[n].append(res)
                    print(f"round {r + 1} workers={n} {res.requests / res.wall_s:8.1f} req/s  "
                          f"P50 TTFT {pct(res.ttfts, 0.5) * 1000:6.2f} ms  gateway cores "
                          f"{res.cpu['gateway'] / res.wall_s:.2f}  errors {res.errors}", flush=True)
        finally:
            for _, procs in running.values():
                stop(procs)

    print()
    print(f"# bench_gateway_workers  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {os.cpu_count()} cores  "
          f"{args.rounds} rounds x {args.duration:g} s  {args.concurrency} concurrent {args.max_tokens}-token chat "
          f"streams  fake ITL {args.itl_ms:g} ms  load average {load_before} -> "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    head = (f"{'workers':>7s} {'req/s':>8s} {'x 1 worker':>10s} {'P50 TTFT':>9s} {'P99 TTFT':>9s} {'gw cores':>8s} "
            f"{'req/gwCPUs':>10s} {'fake cores':>10s} {'client cores':>12s} {'errs':>4s}")
    print(head)
    print("-" * len(head))
    base = None
    for n in counts:
        rs = results[n]

        def med(f, rs=rs):
            return statistics.median(f(r) for r in rs)

        req_s = med(lambda r: r.requests / r.wall_s)
        base = base or req_s
        print(f"{n:7d} {req_s:8.1f} {req_s / base:9.2f}x {med(lambda r: pct(r.ttfts, 0.5) * 1000):7.2f}ms "
              f"{med(lambda r: pct(r.ttfts, 0.99) * 1000):7.2f}ms {med(lambda r: r.cpu['gateway'] / r.wall_s):8.2f} "
              f"{med(lambda r: r.requests / max(r.cpu['gateway'], 1e-9)):10.0f} "
              f"{med(lambda r: r.cpu['fake'] / r.wall_s):10.2f} {med(lambda r: r.cpu['client'] / r.wall_s):12.2f} "
              f"{sum(r.errors for r in rs):4d}")


if __name__ == "__main__":
    main()

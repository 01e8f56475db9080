"""How much load can `lmfleet bench` itself generate on this machine? (so it is not the bottleneck)

Against tests/support/fast_openai_server.py (a separate process, raw asyncio):
1. Concurrent streams: closed loop with N users, each answer streams T tokens 50 ms apart, so a
   request lasts ~T*50 ms. The harness keeps up if the mean number in flight is ~N and the measured
   ITL stays near the server's 50 ms (client-side lag shows up as ITL/TTFT above it).
2. Requests per second: open loop (Poisson) at increasing rates with short streamed answers
   (4 tokens, no delay); the harness keeps up while the achieved rate matches the offered one and
   TTFT stays low.

    .venv/bin/python benchmarks/bench_harness_capacity.py [--streams 1000,2000] [--rates 1000,2000,3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from lmfleet.bench.loadgen import LoadPlan, Target, run_load  # noqa: E402
from lmfleet.bench.metrics import measurement_window, summarize, timeseries  # noqa: E402
from lmfleet.bench.workload import BenchRequest  # noqa: E402
from tests.support.fast_openai_server import FastServer  # noqa: E402


def requests(max_tokens: int) -> list[BenchRequest]:
    return [BenchRequest("cap", "completion", 1, max_tokens, prompt="hello")]


def run(base_url: str, plan: LoadPlan, max_tokens: int) -> dict:
    records, wall = asyncio.run(run_load(Target(base_url, "fast"), requests(max_tokens), plan))
    measured = [r for r in records if not r.warmup]
    s = summarize(measured, measurement_window(records, plan.warmup))
    ts = timeseries(measured, bin_s=1.0)
    busy = [x for x, t in zip(ts["in_flight"], ts["t"]) if plan.warmup + 1 <= t <= (plan.duration or 0) - 1]
    return {"requests": s["requests"], "failed": s["failed"], "errors": s["errors_by_status"],
            "request_throughput": round(s["request_throughput"], 1),
            "mean_in_flight": round(sum(busy) / len(busy), 1) if busy else None,
            "ttft_p50_ms": round(s["ttft_ms"]["p50"], 1), "ttft_p99_ms": round(s["ttft_ms"]["p99"], 1),
            "itl_p50_ms": round(s["itl_ms"]["p50"], 1), "itl_p99_ms": round(s["itl_ms"]["p99"], 1),
            "e2el_p50_ms": round(s["e2el_ms"]["p50"], 1), "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1000,2000")
    ap.add_argument("--rates", default="1000,2000,3000")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    results = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
                          f"Python {platform.python_version()}",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "streams": [], "rates": []}
    with FastServer("--itl-ms", "50") as srv:
        for n in (int(x) for x in args.streams.split(",")):
            plan = LoadPlan(users=n, duration=args.duration, warmup=3.0, ramp_up=2.0, timeout=60)
            row = {"users": n, "server_itl_ms": 50, "tokens": 20, **run(srv.base_url, plan, 20)}
            print(json.dumps(row), flush=True)
            results["streams"].append(row)
    with FastServer() as srv:
        for rate in (float(x) for x in args.rates.split(",")):
            plan = LoadPlan(rate=rate, duration=args.duration, warmup=3.0, timeout=60)
            row = {"offered_rps": rate, "tokens": 4, **run(srv.base_url, plan, 4)}
            print(json.dumps(row), flush=True)
            results["rates"].append(row)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

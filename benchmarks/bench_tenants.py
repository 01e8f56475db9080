"""Tenants and priority classes under load (issue 14), in two modes.

**Fakes** (default): a mixed two-tenant, two-class workload at 1x, 2x and 4x local capacity, with and without
priority classes.

    .venv/bin/python benchmarks/bench_tenants.py --duration 10 --out out/bench_tenants.json

**A running fleet** (``--fleet-url``): how much a batch tenant's flood slows an interactive tenant's first tokens.
Start a fleet whose file has a batch tenant A (``priority: batch``, ``limits: {max_concurrency: 4}``) and an
interactive tenant B, then

    .venv/bin/python benchmarks/bench_tenants.py --fleet-url http://127.0.0.1:8000 --key-a A_KEY --key-b B_KEY \
        --model tiny --out out/bench_tenants_fleet.json

B sends streamed completions one after another in alternating blocks, solo / A flooding / solo / ..., and each
side pools its blocks (so both see the same drift of a shared machine's load); A's flood is ``--flood-workers``
clients in a process of their own at ``nice 19`` (lmfleet/testing/flood.py). It reports B's P50/P99 TTFT solo and
flooded and the ratio of the P99s (issue 14's bound: at most 2), A's answers and refusals, and the load average.

The real gateway (``build_gateway`` via tests/unit/gateway_fakes.py, served by uvicorn on a free port) in front of
fakes, so it runs in minutes without engines:

* local model ``m``: ``--slots`` sequences at once (Serve + engine), first token ``--local-ttft-ms`` after a slot is
  free, then ``--tokens`` tokens ``--itl-ms`` apart; so capacity = slots / service time requests per second;
* provider ``paid``: first token after ``--provider-ttft-ms`` (a hosted API's pace), same tokens, no limit, priced.

Tenants: ``chat`` (interactive) and ``jobs`` (class ``batch``: waits locally up to ``--batch-wait-s``, may not pay
for a provider). Arrivals are Poisson at load x capacity, half from each tenant (same seed in both modes):

  classes     as configured: batch yields to interactive in the local queue and never overflows;
  no-classes  the same tenants, both interactive (what lmfleet did before issue 14).

Per mode, load, tenant: P50/P99 TTFT of completed requests, completion rate, 429 rate, external share (of completed)
and the provider spend from the ledger. The client shares the process (its own event loop thread) with nothing
else, but the machine is shared: the load average is printed with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from lmfleet.testing.flood import Flood, p99, trickle
from lmfleet.testing.gateway_fakes import make_gateway

KEYS = {"chat": "sk-bench-chat", "jobs": "sk-bench-jobs"}


class Paced(httpx.AsyncByteStream):
    """SSE events ``ttft_s`` after the start (or a slot), then one token every ``itl_s``; usage at the end."""

    def __init__(self, n: int, ttft_s: float, itl_s: float, slot: asyncio.Semaphore | None = None):
        self.n, self.ttft_s, self.itl_s, self.slot = n, ttft_s, itl_s, slot

    async def __aiter__(self):
        if self.slot is not None:
            await self.slot.acquire()
        try:
            await asyncio.sleep(self.ttft_s)
            for i in range(self.n):
                if i:
                    await asyncio.sleep(self.itl_s)
                yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": " w"}}]}).encode() + b"\n\n"
            usage = {"prompt_tokens": 20, "completion_tokens": self.n, "total_tokens": 20 + self.n}
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            if self.slot is not None:
                self.slot.release()


def backends(args):
    slots: dict[int, asyncio.Semaphore] = {}  # one per event loop (the fakes' server runs in its own)

    def local(req: httpx.Request) -> httpx.Response:
        loop = id(asyncio.get_running_loop())
        slot = slots.setdefault(loop, asyncio.Semaphore(args.slots))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Paced(args.tokens, args.local_ttft_ms / 1e3, args.itl_ms / 1e3, slot))

    def provider(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Paced(args.tokens, args.provider_ttft_ms / 1e3, args.itl_ms / 1e3))

    return local, provider


def fleet_extra(args, classes: bool, tmp: Path) -> dict:
    tenants = []
    for name in KEYS:
        path = tmp / f"{name}.keys"
        path.write_text(KEYS[name] + "\n")
        t = {"name": name, "api_keys_file": str(path)}
        if classes and name == "jobs":
            t |= {"priority": "batch", "batch_may_use_providers": False}
        tenants.append(t)
    service_s = (args.local_ttft_ms + (args.tokens - 1) * args.itl_ms) / 1e3
    return {"tenants": tenants,
            "priority_classes": [{"name": "interactive", "order": 0},
                                 {"name": "batch", "order": 10, "max_wait_s": args.batch_wait_s}],
            "models": [{"name": "m", "source": "builtin:tiny-random",
                        "deployment": {"max_ongoing_requests": args.slots, "request_timeout_s": 60},
                        "overflow": {"threshold_ms": args.threshold_ms, "cold_service_s": service_s,
                                     "cold_ttft_s": args.local_ttft_ms / 1e3}}]}


class Served:
    """The gateway app on a free port, in its own thread and event loop."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def one(c: httpx.AsyncClient, tenant: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 19}], "max_tokens": tokens,
            "stream": True}
    out = {"tenant": tenant, "status": 0, "ttft_s": None, "served_by": None}
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {KEYS[tenant]}"}) as r:
            out["status"] = r.status_code
            out["served_by"] = r.headers.get("x-lmfleet-served-by")
            out["class"] = r.headers.get("x-lmfleet-priority")
            if r.status_code != 200:
                await r.aread()
                try:
                    out["code"] = (r.json().get("error") or {}).get("code")
                except ValueError:
                    out["code"] = None
                return out
            async for line in r.aiter_lines():
                if out["ttft_s"] is None and line.startswith("data:") and '"content"' in line:
                    out["ttft_s"] = time.perf_counter() - t0
    except httpx.HTTPError as e:
        out["error"] = type(e).__name__
    return out


async def run_cell(base_url: str, rate: float, duration_s: float, tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits, headers={"host": "gw"}) as c:
        tasks, t, start = [], 0.0, time.perf_counter()
        while True:
            t += rng.expovariate(rate)
            if t > duration_s:
                break
            tenant = "chat" if rng.random() < 0.5 else "jobs"
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(c, tenant, tokens)))
        return await asyncio.gather(*tasks)


def summarize(results: list[dict], spend: dict[str, float]) -> dict[str, dict]:
    out = {}
    for tenant in KEYS:
        rs = [r for r in results if r["tenant"] == tenant]
        done = [r for r in rs if r["status"] == 200 and r["ttft_s"] is not None]
        ttfts = sorted(r["ttft_s"] for r in done)
        ext = [r for r in done if (r["served_by"] or "").startswith("provider/")]
        out[tenant] = {
            "class": next((r.get("class") for r in rs if r.get("class")), None), "sent": len(rs),
            "p50_ttft_ms": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None,
            "p99_ttft_ms": round(statistics.quantiles(ttfts, n=100, method="inclusive")[98] * 1e3, 1)
            if len(ttfts) > 1 else None,
            "completion_rate": round(len(done) / len(rs), 3) if rs else None,
            "rate_429": round(sum(r["status"] == 429 for r in rs) / len(rs), 3) if rs else None,
            "external_share": round(len(ext) / len(done), 3) if done else None,
            "usd": round(spend.get(tenant, 0.0), 6),
            "codes_429": sorted({str(r.get("code")) for r in rs if r["status"] == 429}),
            "other": sorted({str(r["status"]) + (":" + r["error"] if "error" in r else "") for r in rs
                             if r["status"] not in (200, 429)}),
        }
    return out


def fleet_flood(args) -> dict:
    """B's TTFT solo and while A floods, on the running fleet at ``args.fleet_url`` (module docstring)."""
    solo: list[float] = []
    flooded: list[float] = []
    statuses: list[int] = []
    flood = Flood(args.fleet_url, args.key_a, args.model, args.flood_workers)
    loadavg_start = os.getloadavg()
    with httpx.Client(base_url=args.fleet_url, headers={"authorization": f"Bearer {args.key_b}"}, timeout=120) as b:
        trickle(b, args.model, 3, args.gap_s)  # warm: connections, the tokenizer path
        flood.start()  # the engine's larger batches once (first-time shapes)
        trickle(b, args.model, 3, args.gap_s)
        flood.stop()
        for _ in range(args.blocks):
            t, s = trickle(b, args.model, args.per_block, args.gap_s)
            solo += t
            statuses += s
            flood.start()
            t, s = trickle(b, args.model, args.per_block, args.gap_s)
            flood.stop()
            flooded += t
            statuses += s
    ms = lambda x: round(x * 1e3, 1)  # noqa: E731
    return {"b_solo": {"n": len(solo), "p50_ms": ms(statistics.median(solo)), "p99_ms": ms(p99(solo))},
            "b_flooded": {"n": len(flooded), "p50_ms": ms(statistics.median(flooded)), "p99_ms": ms(p99(flooded))},
            "p99_ratio": round(p99(flooded) / p99(solo), 2),
            "b_refused": sum(1 for x in statuses if x != 200),
            "a": {"ok": flood.ok, "refused": flood.refused, "other": flood.other},
            "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
            "args": {k: str(v) for k, v in vars(args).items() if k not in ("key_a", "key_b")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet-url", default=None, help="measure on the running fleet at this gateway URL")
    ap.add_argument("--key-a", help="--fleet-url: API key of the batch tenant that floods")
    ap.add_argument("--key-b", help="--fleet-url: API key of the interactive tenant that is measured")
    ap.add_argument("--model", default="tiny", help="--fleet-url: the model both tenants call")
    ap.add_argument("--blocks", type=int, default=4, help="--fleet-url: solo/flooded block pairs")
    ap.add_argument("--per-block", type=int, default=20, help="--fleet-url: B's requests per block")
    ap.add_argument("--gap-s", type=float, default=0.25, help="--fleet-url: pause between B's requests")
    ap.add_argument("--flood-workers", type=int, default=12, help="--fleet-url: A's concurrent clients")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per cell")
    ap.add_argument("--loads", default="1,2,4", help="multiples of local capacity")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--local-ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--provider-ttft-ms", type=float, default=300.0)
    ap.add_argument("--threshold-ms", type=float, default=500.0, help="the model's overflow threshold")
    ap.add_argument("--batch-wait-s", type=float, default=5.0, help="the batch class's max_wait_s")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.fleet_url is not None:
        if not (args.key_a and args.key_b):
            ap.error("--fleet-url needs --key-a and --key-b")
        report = fleet_flood(args)
        print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
        return
    local, provider = backends(args)
    service_s = (args.local_ttft_ms + (args.tokens - 1) * args.itl_ms) / 1e3
    capacity_rps = args.slots / service_s
    report = {"capacity_rps": round(capacity_rps, 2), "args": {k: str(v) for k, v in vars(args).items()},
              "loadavg_start": os.getloadavg(), "cells": []}
    print(f"capacity {capacity_rps:.1f} req/s ({args.slots} slots x {service_s * 1e3:.0f} ms); "
          f"load average {os.getloadavg()}")
    for load in [float(x) for x in args.loads.split(",")]:
        for mode in ("classes", "no-classes"):
            with tempfile.TemporaryDirectory() as tmp:
                app = make_gateway(Path(tmp), local, {"paid": provider}, extra=fleet_extra(args, mode == "classes",
                                                                                        Path(tmp)),
                                   provider_extra={"price": {"input_per_1m": 10.0, "output_per_1m": 30.0}})
                with Served(app) as url:
                    t0 = time.perf_counter()
                    results = asyncio.run(run_cell(url, load * capacity_rps, args.duration, args.tokens,
                                                   args.seed + int(load * 10)))
                    wall = time.perf_counter() - t0
                    usage = httpx.get(f"{url}/admin/usage", params={"by": "tenant"},
                                      headers={"authorization": "Bearer adm", "host": "gw"}, timeout=30).json()
                spend = {row["tenant"]: row["cost_usd"] for row in usage["rows"]}
            cell = {"load": load, "mode": mode, "wall_s": round(wall, 1), "loadavg": os.getloadavg()[0],
                    "tenants": summarize(results, spend)}
            report["cells"].append(cell)
            for tenant, s in cell["tenants"].items():
                print(f"{load:>3.0f}x {mode:<10} {tenant:<4} {s['class'] or '-':<11} sent {s['sent']:>4}  "
                      f"TTFT p50 {s['p50_ttft_ms']} p99 {s['p99_ttft_ms']} ms  done {s['completion_rate']}  "
                      f"429 {s['rate_429']} {s['codes_429'] or ''}  ext {s['external_share']}  ${s['usd']:.6f}  {s['other'] or ''}")
    report["loadavg_end"] = os.getloadavg()
    print(f"load average at the end {report['loadavg_end']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

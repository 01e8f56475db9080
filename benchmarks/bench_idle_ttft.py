"""One-stream TTFT after an idle gap, gateway vs Serve's endpoint (HAProxy), with new and kept-alive client
connections (session 12, docs/benchmarks.md).

    LMFLEET_CACHE=/tmp/lmfc .venv/bin/python benchmarks/bench_idle_ttft.py FLEET.yaml GATEWAY_PORT SERVE_PORT N GAP_S

Starts `lmfleet serve -c FLEET.yaml` (a one-model fleet named smollm2, e.g. the bench_fleet.yaml bench_gateway.py
writes next to its --out), then per turn, in order: HAProxy path and gateway path, each with a fresh connection
("new") and with a kept-alive one ("keep", keepalive_expiry 120 s), GAP_S idle before each request, 16-token
streams. For gateway requests the gateway's own TTFT and prepare time are read from its /metrics around the
request. Prints P50 / mean per row; stops the fleet at the end.
"""
import asyncio, os, re, statistics, subprocess, sys, time
import httpx
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gateway as b  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2

def metric(text, name):
    m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0

async def one(client, url):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 16, "stream": True, "ignore_eos": True, "temperature": 0}
    t0 = time.perf_counter()
    t = None
    async with client.stream("POST", url, json=body) as r:
        async for chunk in r.aiter_raw():
            if t is None and b'"text"' in chunk:
                t = time.perf_counter() - t0
    return t * 1000

async def main():
    urls = {"haproxy": f"http://127.0.0.1:{sport}/smollm2/v1/completions", "gateway": f"http://127.0.0.1:{gport}/v1/completions"}
    keep = {k: httpx.AsyncClient(timeout=60, limits=httpx.Limits(keepalive_expiry=120)) for k in urls}
    out = {f"{k} {m}": [] for k in urls for m in ("new", "keep")}
    inner = {"gateway new": [], "gateway keep": []}
    prep = {"gateway new": [], "gateway keep": []}
    mc = httpx.AsyncClient(timeout=10)
    for k, u in urls.items():
        for _ in range(3):
            await one(keep[k], u)
    for i in range(n):
        for k, u in urls.items():
            for mode in ("new", "keep"):
                await asyncio.sleep(gap)
                if k == "gateway":
                    m0 = (await mc.get(f"http://127.0.0.1:{gport}/metrics")).text
                    await asyncio.sleep(0.05)
                if mode == "new":
                    async with httpx.AsyncClient(timeout=60) as c:
                        t = await one(c, u)
                else:
                    t = await one(keep[k], u)
                out[f"{k} {mode}"].append(t)
                if k == "gateway":
                    m1 = (await mc.get(f"http://127.0.0.1:{gport}/metrics")).text
                    inner[f"{k} {mode}"].append(1000 * (metric(m1, "lmfleet_time_to_first_token_seconds_sum") - metric(m0, "lmfleet_time_to_first_token_seconds_sum")))
                    prep[f"{k} {mode}"].append(1000 * (metric(m1, "lmfleet_gateway_prepare_seconds_sum") - metric(m0, "lmfleet_gateway_prepare_seconds_sum")))
        if (i + 1) % 6 == 0:
            print(i + 1, {k: round(statistics.median(v), 1) for k, v in out.items()}, flush=True)
    print(f"\ngap {gap} s, {n} requests per row, 16 tokens; P50 / mean ms")
    for k, v in out.items():
        extra = ""
        if k in inner:
            extra = f"  gateway's own TTFT {statistics.median(inner[k]):.1f} / {statistics.fmean(inner[k]):.1f}, prepare {statistics.median(prep[k]):.2f}"
        print(f"  {k:14s} client TTFT {statistics.median(v):6.1f} / {statistics.fmean(v):6.1f}{extra}")

if __name__ == "__main__":
    fleet, gport, sport, n, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    lm = subprocess.Popen([sys.executable, "-m", "lmfleet.cli.main", "serve", "-c", fleet], env=env,
                          stdout=open(Path(fleet).with_suffix(".idle_ttft.log"), "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        b.wait_http(f"http://127.0.0.1:{gport}/ready", 600, lm)
        asyncio.run(main())
    finally:
        b.stop(lm)

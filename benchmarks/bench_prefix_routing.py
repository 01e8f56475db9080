"""Cache-aware routing (issue 15): Serve's default router vs prefix_aware on two SmolLM2 replicas, side by side.

    .venv/bin/python benchmarks/bench_prefix_routing.py --out out/bench_prefix_routing --rounds 2

Per round, in alternating order (round 1: default then prefix_aware; round 2 the other way), for each router:
start `lmfleet serve` with one model `smollm2`, two replicas and that `deployment.request_router`, then run

  uniform  a closed loop of --users users (or, with --rate, an open loop at that many requests per second) on a
           shared-prefix multi-turn workload: 8 system prompts of ~1,000
           tokens, 4-turn sessions (each turn carries the conversation so far), --sessions sessions open;
  skewed   the same with one hot prefix (hot_share 0.9): the hot-spot guard (prefix_aware.imbalance_threshold)
           must keep the busiest replica's share bounded,

and stop the fleet. Same seeds in every phase: the same prompts in the same order. Reported per phase: TTFT
P50/P99, output tok/s, prefix-cache hit rate and each replica's share of the requests (vLLM's prefix_cache_* and
request_success counters per replica, read through the gateway's /admin/state before and after the phase), the
largest load imbalance /admin/state showed while it ran, and the load average at the phase's start and end
(the machine is shared). The goal in issue 15: prefix_aware lowers P50 TTFT by >= 30 % vs default with the
busiest replica taking <= 65 % of requests.

Two engines on a 2-core machine: each engine gets one OpenMP thread and no CPU binding (engine.env), so the OS
puts them on separate cores. With HAProxy (direct streaming, lmfleet's default), `lmfleet serve` itself sets
RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 (lmfleet.engine.routing.routing_env): without it HAProxy does not
hand the prompt to Serve's router and prefix_aware routes blind. Under HAProxy, `default` is HAProxy's own
`leastconn` with no ingress router (docs/routing.md).

Output tok/s counts the tokens of requests started after --warmup, over the phase's wall time after --warmup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from lmfleet.bench.loadgen import LoadPlan, RequestRecord, Target, run_load
from lmfleet.bench.metrics import percentile
from lmfleet.bench.workload import PromptSynthesizer, parse_mix_inline, sample_requests
from lmfleet.net import free_port
from lmfleet.overflow.engine_stats import ReplicaStats, since
from lmfleet.testing.fleet import Procs, wait_http

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "smollm2"
ADMIN = "bench-admin"


def fleet_yaml(args, out: Path, router: str, gport: int, sport: int) -> str:
    guard = (f", prefix_aware: {{imbalance_threshold: {args.imbalance_threshold}}}"
             if router == "prefix_aware" and args.imbalance_threshold is not None else "")
    kv = f", extra_args: {{num_gpu_blocks_override: {args.kv_blocks}}}" if args.kv_blocks else ""
    return f"""gateway: {{port: {gport}, serve_port: {sport}, admin_key_env: BENCH_ADMIN, serve_proxy: {args.serve_proxy},
  engine_metrics_poll_s: 2}}
ledger: {{path: {out / 'ledger.sqlite'}}}
models:
  - name: {MODEL}
    source: builtin:smollm2
    engine: {{max_model_len: 4096, cpu_kvcache_space_gib: 2, max_num_seqs: {args.max_num_seqs},
              enable_prefix_caching: true, env: {{VLLM_CPU_OMP_THREADS_BIND: nobind, OMP_NUM_THREADS: '1'}}{kv}}}
    deployment: {{replicas: 2, max_ongoing_requests: {args.max_num_seqs}, request_timeout_s: 600,
                  request_router: {router}{guard}}}
"""


def admin_replicas(url: str) -> dict[str, ReplicaStats]:
    r = httpx.get(f"{url}/admin/state", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    r.raise_for_status()
    reps = r.json()["models"][MODEL].get("replicas", {})
    return {rid: ReplicaStats(d["running"], d["waiting"], d["prefix_cache_hits"], d["prefix_cache_queries"],
                              d["requests_finished"]) for rid, d in reps.items()}


class ImbalanceSampler:
    """The largest ``load_imbalance`` /admin/state shows while a phase runs (as old as the engine poll)."""

    def __init__(self, url: str):
        self.url, self.max, self._stop = url, 0, threading.Event()

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                r = httpx.get(f"{self.url}/admin/state", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
                self.max = max(self.max, int(r.json()["models"][MODEL].get("load_imbalance", 0)))
            except (httpx.HTTPError, ValueError, KeyError):
                pass


def settle(url: str, wait_s: float) -> dict[str, ReplicaStats]:
    """Counters after the engines' figures reached Ray's metrics page and the gateway's poll (both periodic)."""
    time.sleep(wait_s)
    return admin_replicas(url)


def summarise(records: list[RequestRecord], wall: float, delta: dict[str, ReplicaStats], warmup: float) -> dict:
    ok = [r for r in records if r.ok and not r.warmup]
    ttft = [r.ttft * 1000 for r in ok]
    total = sum(delta.values(), ReplicaStats())
    finished = sum(st.requests for st in delta.values())
    shares = sorted((st.requests / finished for st in delta.values()), reverse=True) if finished else []
    return {"requests": len(records), "ok": len(ok), "errors": len(records) - len([r for r in records if r.ok]),
            "ttft_p50_ms": percentile(ttft, 50) if ttft else None, "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
            "output_tok_s": sum(r.output_tokens for r in ok) / (wall - warmup) if wall > warmup else 0.0,
            "prefix_cache_hit_rate": total.prefix_cache_hit_rate, "replica_shares": shares,
            "busiest_share": shares[0] if shares else None}


def phase(url: str, reqs, args) -> tuple[list[RequestRecord], float]:
    if args.rate:  # open loop: the same offered load for both routers, so a faster one shows as less queueing
        plan = LoadPlan(rate=args.rate, duration=args.duration, warmup=args.warmup, seed=1, timeout=600)
    else:
        plan = LoadPlan(users=args.users, duration=args.duration, warmup=args.warmup, seed=1, timeout=600)
    return asyncio.run(run_load(Target(url, MODEL, api_key=None), reqs, plan))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_prefix_routing")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--routers", default="default,prefix_aware")
    ap.add_argument("--duration", type=float, default=90, help="seconds per workload phase")
    ap.add_argument("--warmup", type=float, default=10, help="seconds at a phase's start left out of TTFT")
    ap.add_argument("--users", type=int, default=8, help="closed-loop users (near capacity: ~2 x max_num_seqs / 2)")
    ap.add_argument("--rate", type=float, default=None,
                    help="open loop instead of --users: requests per second (Poisson arrivals; a session's next "
                    "turn still waits for its previous answer, untimed). In a closed loop near capacity a faster "
                    "router mostly serves more requests at about the same TTFT (the users send sooner); at a fixed "
                    "rate near the default router's capacity the time saved shows as TTFT. Pick it from a closed-"
                    "loop run's requests per second (2026-12-02: 1.35/s for default, 1.6/s for prefix_aware)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--input", default="32-64", help="new user tokens per turn")
    ap.add_argument("--output", default="32", help="max_tokens per turn")
    ap.add_argument("--hot-share", type=float, default=0.9, help="skewed phase: sessions on the hot prefix")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--imbalance-threshold", type=int, default=None,
                    help="prefix_aware.imbalance_threshold (default: lmfleet's, 4)")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="KV cache blocks per replica (vLLM's num_gpu_blocks_override; 128 tokens a block on CPU). "
                    "Default: 2 GiB (~46k tokens of SmolLM2), which holds every prefix on both replicas; 64 "
                    "blocks (8k tokens) holds about half the prefixes, as a busy production cache does")
    ap.add_argument("--serve-proxy", choices=("haproxy", "serve"), default="haproxy")
    ap.add_argument("--no-skewed", dest="skewed", action="store_false")
    ap.add_argument("--no-uniform", dest="uniform", action="store_false", help="run the skewed workload only")
    ap.add_argument("--settle-s", type=float, default=15, help="wait for Ray's metrics report before reading counters")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from lmfleet.models import resolve_source

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    synth = PromptSynthesizer(AutoTokenizer.from_pretrained(resolve_source("builtin:smollm2")))
    base = (f"agent:1:{args.input}:{args.output}:prefixes={args.prefixes}x{args.prefix_tokens}:turns={args.turns}"
            f":sessions={args.sessions}")
    workloads = {"uniform": sample_requests(parse_mix_inline(base), 2000, synth, seed=7)} if args.uniform else {}
    if args.skewed:
        workloads["skewed"] = sample_requests(parse_mix_inline(f"{base}:hot={args.hot_share}"), 2000, synth, seed=7)
    if not workloads:
        ap.error("--no-uniform and --no-skewed leave nothing to run")
    routers = args.routers.split(",")
    results: list[dict] = []
    for rnd in range(args.rounds):
        for router in (routers if rnd % 2 == 0 else routers[::-1]):
            gport, sport = free_port(), free_port()
            fleet = out / f"fleet_{router}.yaml"
            fleet.write_text(fleet_yaml(args, out, router, gport, sport))
            env = {**os.environ, "BENCH_ADMIN": ADMIN, "LMFLEET_ADMIN_KEY": ADMIN}
            env.pop("RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY", None)  # lmfleet serve sets what it needs
            procs = Procs()
            log = out / f"serve_{router}_r{rnd + 1}.log"
            url = f"http://127.0.0.1:{gport}"
            try:
                t_start = time.monotonic()
                p = procs.start("lmfleet serve", [str(BIN / "lmfleet"), "serve", "-c", str(fleet)], env, log,
                                stop_sig=signal.SIGINT)
                wait_http(f"{url}/ready", p, log, 1500)
                print(f"round {rnd + 1} {router}: fleet up in {time.monotonic() - t_start:.0f} s", flush=True)
                # HAProxy may still be reloading with the new replicas right after /ready: requests then go to its
                # backup (Serve's proxy), a path no phase should measure (seen 2026-12-01)
                time.sleep(10)
                procs.note_descendants()
                for wname, reqs in workloads.items():
                    load0, utc0 = os.getloadavg(), time.strftime("%H:%M:%S", time.gmtime())
                    before = admin_replicas(url)
                    with ImbalanceSampler(url) as sampler:
                        records, wall = phase(url, reqs, args)
                    delta = since(before, settle(url, args.settle_s))
                    row = {"round": rnd + 1, "router": router, "workload": wname, "rate": args.rate,
                           **summarise(records, wall, delta, args.warmup), "max_load_imbalance": sampler.max,
                           "replica_requests": {rid[-6:]: int(st.requests) for rid, st in sorted(delta.items())},
                           "utc_start": utc0, "loadavg_start": load0, "loadavg_end": os.getloadavg()}
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                procs.stop_all()
            (out / "results.json").write_text(json.dumps(results, indent=2))
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args) | {"out": str(out)},
               "results": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n| round | router | workload | TTFT P50 ms | TTFT P99 ms | out tok/s | prefix hit rate | replica shares "
          "| max imbalance | errors | load avg start/end |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        hit = f"{r['prefix_cache_hit_rate']:.0%}" if r["prefix_cache_hit_rate"] is not None else "n/a"
        p50 = f"{r['ttft_p50_ms']:.0f}" if r["ttft_p50_ms"] is not None else "n/a"
        p99 = f"{r['ttft_p99_ms']:.0f}" if r["ttft_p99_ms"] is not None else "n/a"
        print(f"| {r['round']} | {r['router']} | {r['workload']} | {p50} | {p99} | {r['output_tok_s']:.1f} | {hit} | "
              f"{' / '.join(f'{s:.0%}' for s in r['replica_shares'])} | {r['max_load_imbalance']} | {r['errors']} | "
              f"{r['loadavg_start'][0]:.1f} / {r['loadavg_end'][0]:.1f} |")


if __name__ == "__main__":
    main()

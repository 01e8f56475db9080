"""Two gateways overflow where one would (issue 12): a 2x overload through ONE gateway vs the same load split
evenly over TWO gateways of the same fleet; compares the external share and P99 TTFT.

    .venv/bin/python benchmarks/bench_gateways_overload.py --out out/bench_gateways_overload --rounds 2

Starts, once for every phase: the external provider (a bare vLLM server, same model, real API key; or a fake,
see below), `lmfleet serve` with that provider configured (gateway A) and `lmfleet gateway --address <the
fleet's Ray>` on another port (gateway B); all are ended on exit, Ctrl-C, SIGTERM or failure. Local capacity is measured with a closed loop of `--capacity-seqs` users (half through each
gateway, overflow forced off on both, which also warms both gateways' trackers). Then, per round, in
alternating order:

  one  two open-loop Poisson generators at 1x capacity each, both sending to gateway A;
  two  the same two generators (same seeds: same arrivals and prompts), one to gateway A, one to gateway B.

So the total load is 2x capacity in both phases, and the client side (one process, two generators) is the
same; only the gateway that receives each generator's requests differs. Who served each request comes from
the `x-lmfleet-served-by` header. Pass: for the phases pooled over all rounds, external share and P99 TTFT of
"two" within +-20 % of "one". Both gateways' /admin/state are sampled every second (state_*.jsonl per phase)
and the load average is recorded at each phase's start and end: the machine is shared.

Same caveat as bench_overflow.py: the provider runs on the same cores as the local engine (each pinned to its
own core), so overflow moves the queue here; it cannot add compute, and on a busy machine the provider's own
TTFT can dominate the P99. `--provider fake` replaces it with lmfleet/testing/fast_openai_server.py answering at
a hosted API's pace (300 ms to the first token, 20 ms per token by default): the P99 then shows the local
queue that the routing decision leaves.
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
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from lmfleet.bench.loadgen import LoadPlan, RequestRecord, Target, run_load
from lmfleet.bench.report import build_report, write_json
from lmfleet.bench.runner import BenchSpec, prepare
from lmfleet.bench.workload import BenchRequest, parse_mix_inline
from lmfleet.net import free_port
from lmfleet.testing.fleet import Procs, wait_http
from lmfleet.testing.overflow_load import ADMIN, PKEY, StateSampler, row, state_summary

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "smollm2"
MIX = "short:1:96-160:48-64"  # as bench_overflow.py
TOLERANCE = 0.20


def ray_address(serve_log: Path, timeout_s: float = 120.0) -> str:
    """The Ray address `lmfleet serve` prints once its engines are up (a moment after /ready turns 200)."""
    t0 = time.monotonic()
    while True:
        m = re.search(r"lmfleet gateway .*--address (\S+)", serve_log.read_text(errors="replace"))
        if m:
            return m.group(1)
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"`lmfleet serve` did not print its Ray address in {timeout_s:.0f} s:\n"
                               f"{serve_log.read_text()[-3000:]}")
        time.sleep(1)


def fleet_yaml(args, out: Path, gport: int, sport: int, pport: int) -> str:
    return f"""gateway: {{port: {gport}, serve_port: {sport}, admin_key_env: BENCH_ADMIN, \
engine_metrics_poll_s: {args.engine_metrics_poll_s}}}
ledger: {{path: {out / 'ledger.sqlite'}}}
providers:
  - name: backup
    base_url: http://127.0.0.1:{pport}/v1
    api_key_env: BENCH_PROVIDER_KEY
    model_map: {{{MODEL}: smollm2-remote}}
    price: {{input_per_1m: 0.5, output_per_1m: 1.5}}
    timeouts: {{first_token_s: {args.provider_first_token_s}, total_s: 900}}
models:
  - name: {MODEL}
    source: builtin:smollm2
    engine: {{max_model_len: 2048, cpu_kvcache_space_gib: 1, max_num_seqs: {args.capacity_seqs}, \
env: {{VLLM_CPU_OMP_THREADS_BIND: '0'}}}}
    deployment: {{max_ongoing_requests: {args.capacity_seqs}, request_timeout_s: 600}}
    cost: {{node_hour_usd: 0.10}}
    overflow: {{threshold_ms: {args.threshold_ms}}}
"""


# ------------------------------------------------------------------------------------------ load

def shuffled(pool: list[BenchRequest], seed: int) -> list[BenchRequest]:
    return random.Random(seed).sample(pool, len(pool))


async def _generators(targets: list[Target], pool: list[BenchRequest], plans: list[LoadPlan]
                      ) -> list[list[RequestRecord]]:
    runs = await asyncio.gather(*(run_load(t, shuffled(pool, p.seed), p) for t, p in zip(targets, plans)))
    return [records for records, _ in runs]


def drive(urls: list[str], pool: list[BenchRequest], plans: list[LoadPlan]) -> list[list[RequestRecord]]:
    """One generator per (url, plan), all at once in this process; each generator's records."""
    return asyncio.run(_generators([Target(u, MODEL) for u in urls], pool, plans))


def set_mode(urls: list[str], mode: str) -> None:
    for u in urls:
        httpx.post(f"{u}/admin/overflow", json={"model": MODEL, "mode": mode},
                   headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).raise_for_status()


def wait_idle(urls: list[str], timeout_s: float = 180) -> None:
    """Until both gateways see nothing in flight (their own and their peers')."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if all(httpx.get(f"{u}/admin/state", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5)
                   .json()["models"][MODEL]["in_flight"] == 0 for u in urls):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    print("warning: gateways still report requests in flight", flush=True)


def interrupted(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def route_reasons(ledger: Path, since: float, until: float) -> dict[str, int]:
    """The ledger's rows (both gateways write it) in [since, until] wall time, by served_by and route reason."""
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=10)) as db:
        rows = db.execute("SELECT served_by, route_reason, status, COUNT(*) FROM requests WHERE ts BETWEEN ? AND ? "
                          "GROUP BY 1, 2, 3", (since, until)).fetchall()
    return {f"{by} {reason} {status}": n for by, reason, status, n in rows}


def warm_provider(url: str, pool: list[BenchRequest]) -> None:
    """A fresh vLLM server's first requests are slow (~10 s here): send it a few before measuring."""
    asyncio.run(run_load(Target(url, "smollm2-remote", api_key=PKEY), pool, LoadPlan(users=4, num_requests=12)))


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------------------ figures

def figures(records: list[RequestRecord], warmup: float) -> dict:
    rep = build_report(records, warmup=warmup)
    r = row(rep)
    r["completed"] = rep["overall"]["completed"]
    r["failed"] = rep["overall"]["failed"]
    r["throughput_rps"] = rep["overall"]["request_throughput"]
    r["local_ttft_p99"] = next((p["ttft_ms"]["p99"] for n, p in rep["providers"].items() if n.startswith("local/")),
                               None)
    return r


def state_medians(path: Path, since: float, until: float) -> dict:
    """Medians of a gateway's sampled estimator inputs while arrivals came (None where never reported), and the
    share of those samples in which it was overflowing."""
    rows = [r for line in path.read_text().splitlines() if line.strip()
            if since <= (r := json.loads(line))["t"] <= until]

    def med(key: str) -> float | None:
        vals = sorted(r[key] for r in rows if r.get(key) is not None)
        return round(vals[len(vals) // 2], 3) if vals else None

    out = {k: med(k) for k in ("in_flight", "drain_rps", "base_ttft_s", "queue_estimate_ms", "engine_running")}
    out["overflowing"] = round(sum(bool(r["overflowing"]) for r in rows) / len(rows), 2) if rows else None
    return out


def ratio(b: float, a: float) -> float | None:
    return b / a if a else None


def verdict(one: dict, two: dict) -> dict:
    ext, p99 = ratio(two["external_share"], one["external_share"]), ratio(two["ttft_p99"], one["ttft_p99"])
    ok = lambda x: x is not None and abs(x - 1) <= TOLERANCE  # noqa: E731
    return {"external_share_ratio": ext, "ttft_p99_ratio": p99, "external_share_pass": ok(ext),
            "ttft_p99_pass": ok(p99), "pass": ok(ext) and ok(p99)}


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


# ------------------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_gateways_overload")
    ap.add_argument("--rounds", type=int, default=2, help="(one, two) pairs, order alternating per round")
    ap.add_argument("--duration", type=float, default=60, help="seconds of arrivals per phase (warm-up included)")
    ap.add_argument("--warmup", type=float, default=5, help="seconds at each phase's start left out of the figures")
    ap.add_argument("--load", type=float, default=2.0, help="total load, in multiples of the measured capacity")
    ap.add_argument("--capacity-seqs", type=int, default=8, help="local max_num_seqs = max_ongoing_requests")
    ap.add_argument("--threshold-ms", type=float, default=2500)
    ap.add_argument("--engine-metrics-poll-s", type=float, default=5.0, help="gateway.engine_metrics_poll_s")
    ap.add_argument("--provider-first-token-s", type=float, default=120,
                    help="the provider's first-token timeout: generous, so that a provider slowed by the shared "
                         "cores is not failed over to local (the external share then shows the routing decision)")
    ap.add_argument("--provider", choices=("vllm", "fake"), default="vllm",
                    help="vllm: a second vLLM server of the model (on these same cores); fake: "
                         "lmfleet/testing/fast_openai_server.py answering at --fake-ttft-ms / --fake-itl-ms")
    ap.add_argument("--fake-ttft-ms", type=float, default=300)
    ap.add_argument("--fake-itl-ms", type=float, default=20)
    ap.add_argument("--gap", type=float, default=10, help="seconds of idle between phases, once the queue drained")
    args = ap.parse_args()
    from lmfleet.models import resolve_source

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    smol = resolve_source("builtin:smollm2")
    pport, aport, bport, sport = free_port(), free_port(), free_port(), free_port()
    fleet = out / "fleet.yaml"
    fleet.write_text(fleet_yaml(args, out, aport, sport, pport))
    env = {**os.environ, "BENCH_ADMIN": ADMIN, "BENCH_PROVIDER_KEY": PKEY, "PYTHONUNBUFFERED": "1"}
    procs = Procs()
    # SIGINT too: a shell that starts this in the background (no job control) leaves SIGINT ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the finally below ends what was started
        signal.signal(sig, interrupted)
    a_url, b_url = f"http://127.0.0.1:{aport}", f"http://127.0.0.1:{bport}"
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "split": "two open-loop generators at load/2 each (seeds shared between phases of a round); "
                 "'one': both to gateway A; 'two': one to A, one to B",
        "phases": [], "loadavg_at_start": loadavg()}
    try:
        t_start = time.monotonic()
        if args.provider == "vllm":
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smol, "--served-model-name",
                   "smollm2-remote", "--host", "127.0.0.1", "--port", str(pport), "--max-model-len", "2048",
                   "--api-key", PKEY, "--disable-log-stats"]
        else:  # a hosted API's pace, without its compute landing on these cores
            cmd = [sys.executable, "-m", "lmfleet.testing.fast_openai_server", "--port", str(pport),
                   "--model", "smollm2-remote", "--ttft-ms", str(args.fake_ttft_ms), "--itl-ms", str(args.fake_itl_ms)]
        provider = procs.start("provider", cmd, {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"},
                               out / "provider.log")
        serve = procs.start("lmfleet serve", [str(BIN / "lmfleet"), "serve", "-c", str(fleet)], env,
                            out / "serve.log", stop_sig=signal.SIGINT, grace_s=120)
        wait_http(f"{a_url}/ready", serve, out / "serve.log", 1500)
        wait_http(f"http://127.0.0.1:{pport}/v1/models", provider, out / "provider.log", 600,
                  headers={"authorization": f"Bearer {PKEY}"})
        gw = procs.start("lmfleet gateway", [str(BIN / "lmfleet"), "gateway", "-c", str(fleet), "--address",
                                             ray_address(out / "serve.log"), "--port", str(bport),
                                             "--wait-timeout", "300"], env, out / "gateway_b.log")
        wait_http(f"{b_url}/ready", gw, out / "gateway_b.log", 400)
        procs.note_descendants()
        print(f"up after {time.monotonic() - t_start:.0f} s: gateway A {a_url} (lmfleet serve), gateway B {b_url} "
              f"(lmfleet gateway), provider :{pport}; load average {loadavg()}", flush=True)

        spec = BenchSpec(base_url=a_url, model=MODEL, plan=LoadPlan(rate=1.0, duration=1.0, seed=1),
                         mix=parse_mix_inline(MIX), tokenizer="builtin:smollm2")
        pool, _ = prepare(spec)
        urls = [a_url, b_url]
        warm_provider(f"http://127.0.0.1:{pport}", pool)

        set_mode(urls, "force_off")
        half = max(1, args.capacity_seqs // 2)
        cap_plans = [LoadPlan(users=half, duration=30, warmup=5, seed=100 + i) for i in range(2)]
        cap = figures([r for g in drive(urls, pool, cap_plans) for r in g], 5)
        cap_rps = cap["throughput_rps"]
        summary.update(capacity_rps=cap_rps, capacity_users=2 * half, capacity_loadavg=loadavg())
        print(f"local capacity: {cap_rps:.2f} req/s at {2 * half} concurrent (half through each gateway), "
              f"TTFT p50 {cap['ttft_p50']:.0f} ms; load average {loadavg()}", flush=True)
        set_mode(urls, "auto")
        wait_idle(urls)
        time.sleep(args.gap)

        rate = args.load * cap_rps / 2
        pooled_records: dict[str, list[RequestRecord]] = {"one": [], "two": []}
        for rnd in range(args.rounds):
            order = ("one", "two") if rnd % 2 == 0 else ("two", "one")
            for phase in order:
                plans = [LoadPlan(rate=rate, duration=args.duration, warmup=args.warmup, seed=1000 * (rnd + 1) + i)
                         for i in range(2)]
                phase_dir = out / f"r{rnd}_{phase}"
                phase_dir.mkdir(exist_ok=True)
                la0, t0 = loadavg(), time.time()
                with StateSampler(a_url, {"authorization": f"Bearer {ADMIN}"}, phase_dir / "state_a.jsonl"), \
                        StateSampler(b_url, {"authorization": f"Bearer {ADMIN}"}, phase_dir / "state_b.jsonl"):
                    per_gen = drive([a_url, a_url] if phase == "one" else urls, pool, plans)
                la1 = loadavg()
                records = [x for g in per_gen for x in g]
                pooled_records[phase] += records
                write_json(build_report(records, warmup=args.warmup), phase_dir / "report.json")
                r = figures(records, args.warmup)
                wait_idle(urls)
                time.sleep(2)  # the ledger writer's last rows
                r.update(round=rnd, phase=phase, loadavg_start=la0, loadavg_end=la1, rate_rps=2 * rate,
                         ledger=route_reasons(out / "ledger.sqlite", t0, time.time()),
                         external_share_by_generator=[figures(g, args.warmup)["external_share"] for g in per_gen],
                         state_a=state_summary(phase_dir / "state_a.jsonl"),
                         medians_a=state_medians(phase_dir / "state_a.jsonl", args.warmup, args.duration),
                         medians_b=state_medians(phase_dir / "state_b.jsonl", args.warmup, args.duration),
                         state_b=state_summary(phase_dir / "state_b.jsonl"))
                summary["phases"].append(r)
                print(f"round {rnd} {phase:3s}: {2 * rate:.2f} req/s, {r['requests']} requests, TTFT p50/p95/p99 "
                      f"{r['ttft_p50']:.0f}/{r['ttft_p95']:.0f}/{r['ttft_p99']:.0f} ms, external "
                      f"{r['external_share']:.1%} (by generator {[f'{x:.0%}' for x in r['external_share_by_generator']]}), "
                      f"provider's TTFT p99 {r['provider_ttft_p99']}, errors {r['failed']}, "
                      f"load average {la0} -> {la1}", flush=True)
                print(f"    A: {r['state_a']}\n       medians {r['medians_a']}\n    B: {r['state_b']}\n"
                      f"       medians {r['medians_b']}\n    local TTFT p99 {r['local_ttft_p99']}; ledger: {r['ledger']}",
                      flush=True)
                time.sleep(args.gap)

        # pooled over rounds: the records of every 'one' phase together, and of every 'two' phase
        pooled = {phase: figures(recs, args.warmup) for phase, recs in pooled_records.items()}
        summary["pooled"] = pooled
        summary["verdict"] = verdict(pooled["one"], pooled["two"])
        summary["per_round"] = []
        for rnd in range(args.rounds):
            ph = {p["phase"]: p for p in summary["phases"] if p["round"] == rnd}
            summary["per_round"].append({"round": rnd, **verdict(ph["one"], ph["two"])})
        summary["loadavg_at_end"] = loadavg()
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print_table(summary)
    finally:
        procs.stop_all()


def print_table(s: dict) -> None:
    print(f"\nlocal capacity {s['capacity_rps']:.2f} req/s; total load {s['args']['load']:g}x = "
          f"{s['args']['load'] * s['capacity_rps']:.2f} req/s; {s['args']['duration']:g} s per phase "
          f"({s['args']['warmup']:g} s warm-up); threshold {s['args']['threshold_ms']:g} ms")
    print("\n| round | gateways | requests | errors | external | TTFT P50 | TTFT P95 | TTFT P99 | local TTFT P99 "
          "| load avg (1 min) start→end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in s["phases"]:
        print(f"| {p['round']} | {p['phase']} | {p['requests']} | {p['failed']} | {p['external_share']:.1%} | "
              f"{p['ttft_p50']:.0f} | {p['ttft_p95']:.0f} | {p['ttft_p99']:.0f} | {p['local_ttft_p99'] or 0:.0f} | "
              f"{p['loadavg_start'][0]:.1f}→{p['loadavg_end'][0]:.1f} |")
    for phase in ("one", "two"):
        p = s["pooled"][phase]
        print(f"| all | {phase} | {p['requests']} | {p['failed']} | {p['external_share']:.1%} | {p['ttft_p50']:.0f} | "
              f"{p['ttft_p95']:.0f} | {p['ttft_p99']:.0f} | {p['local_ttft_p99'] or 0:.0f} | |")
    print("\n| rounds | external two/one | P99 TTFT two/one | within 20 % |")
    print("|---|---|---|---|")
    for v in s["per_round"]:
        print(f"| {v['round']} | {fmt_ratio(v['external_share_ratio'])} | {fmt_ratio(v['ttft_p99_ratio'])} | "
              f"{'yes' if v['pass'] else 'no'} |")
    v = s["verdict"]
    print(f"| pooled | {fmt_ratio(v['external_share_ratio'])} | {fmt_ratio(v['ttft_p99_ratio'])} | "
          f"{'yes' if v['pass'] else 'no'} |")


if __name__ == "__main__":
    main()

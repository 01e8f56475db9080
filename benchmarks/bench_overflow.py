"""Overflow under load: open-loop Poisson traffic at 1x, 2x and 4x the local engine's capacity, against
(a) local only (overflow forced off) and (b) local + overflow, through `lmfleet bench run`.

    .venv/bin/python benchmarks/bench_overflow.py --out out/bench_overflow

It starts the external provider (a second, bare vLLM server with the same model and a real API key)
and `lmfleet serve` with that provider configured; measures local capacity with a closed loop of
`capacity` users; then runs each (load, mode) pair and prints, per pair: P50/P95/P99 TTFT and
end-to-end latency, error rate, share served externally and $/1M output tokens.

Caveat of this machine: the "external" provider runs on the same 2 cores as the local engine, so
overflow cannot add compute here; what it shows is the routing (queue wait avoided) and its costs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from lmfleet.net import free_port
from lmfleet.testing.overflow_load import ADMIN, PKEY, StateSampler, row, state_summary

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def wait(url: str, timeout: float, headers=None) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(url, timeout=5, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(url)


def bench(url: str, out: Path, extra: list[str]) -> dict:
    cmd = [str(BIN / "lmfleet"), "bench", "run", "--url", url, "--model", "smollm2", "--out", str(out),
           "--mix", "short:1:96-160:48-64", "--tokenizer", "builtin:smollm2", "--seed", "1", *extra]
    subprocess.run(cmd, check=True, env={**os.environ, "LMFLEET_ADMIN_KEY": ADMIN}, stdout=subprocess.DEVNULL)
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_overflow")
    ap.add_argument("--duration", type=float, default=40)
    ap.add_argument("--capacity-seqs", type=int, default=8, help="local max_num_seqs = max_ongoing_requests")
    ap.add_argument("--threshold-ms", type=float, default=2500)
    ap.add_argument("--no-pin-cores", dest="pin_cores", action="store_false",
                    help="leave vLLM's default CPU binding (both engines then compute on core 0)")
    args = ap.parse_args()
    from lmfleet.models import resolve_source

    smol = resolve_source("builtin:smollm2")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    pport, gport, sport = free_port(), free_port(), free_port()
    fleet = out / "fleet.yaml"
    # vLLM's CPU build pins its compute threads to core 0 by default ("auto", keeping the last core for the
    # API server): two engines on this machine would share core 0 and slow each other ~10x. Give each its own.
    local_env = ", env: {VLLM_CPU_OMP_THREADS_BIND: '0'}" if args.pin_cores else ""
    provider_env = {"VLLM_CPU_OMP_THREADS_BIND": "1"} if args.pin_cores else {}
    fleet.write_text(f"""gateway: {{port: {gport}, serve_port: {sport}, admin_key_env: BENCH_ADMIN}}
ledger: {{path: {out / 'ledger.sqlite'}}}
providers:
  - name: backup
    base_url: http://127.0.0.1:{pport}/v1
    api_key_env: BENCH_PROVIDER_KEY
    model_map: {{smollm2: smollm2-remote}}
    price: {{input_per_1m: 0.5, output_per_1m: 1.5}}
models:
  - name: smollm2
    source: builtin:smollm2
    engine: {{max_model_len: 2048, cpu_kvcache_space_gib: 1, max_num_seqs: {args.capacity_seqs}{local_env}}}
    deployment: {{max_ongoing_requests: {args.capacity_seqs}, request_timeout_s: 600}}
    cost: {{node_hour_usd: 0.10}}
    overflow: {{threshold_ms: {args.threshold_ms}}}
""")
    env = {**os.environ, "BENCH_ADMIN": ADMIN, "BENCH_PROVIDER_KEY": PKEY}
    procs = [
        subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smol,
                          "--served-model-name", "smollm2-remote", "--port", str(pport), "--max-model-len", "2048",
                          "--api-key", PKEY, "--disable-log-stats"], env={**env, "VLLM_CPU_KVCACHE_SPACE": "1", **provider_env},
                         stdout=(out / "provider.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True),
        subprocess.Popen([str(BIN / "lmfleet"), "serve", "-c", str(fleet)], env=env,
                         stdout=(out / "serve.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True),
    ]
    url = f"http://127.0.0.1:{gport}"
    results: dict[str, dict] = {}
    try:
        wait(f"{url}/ready", 1500)
        wait(f"http://127.0.0.1:{pport}/v1/models", 1500, headers={"authorization": f"Bearer {PKEY}"})
        admin = {"authorization": f"Bearer {ADMIN}"}

        def mode(m: str) -> None:
            httpx.post(f"{url}/admin/overflow", json={"model": "smollm2", "mode": m}, headers=admin).raise_for_status()

        mode("force_off")
        cap = bench(url, out / "capacity", ["--users", str(args.capacity_seqs), "--duration", "30", "--warmup", "5"])
        cap_rps = cap["overall"]["request_throughput"]
        print(f"local capacity: {cap_rps:.2f} req/s at {args.capacity_seqs} concurrent", flush=True)
        for load in (1, 2, 4):
            for label, m in (("local only", "force_off"), ("local + overflow", "auto")):
                mode(m)
                time.sleep(3)
                (out / f"x{load}_{m}").mkdir(parents=True, exist_ok=True)
                state = out / f"x{load}_{m}" / "state.jsonl"
                with StateSampler(url, admin, state):
                    rep = bench(url, out / f"x{load}_{m}", ["--rate", f"{load * cap_rps:.3f}", "--duration",
                                                             str(args.duration), "--warmup", "5"])
                    time.sleep(5)  # let the queue drain between runs (sampled: idle local must look idle)
                results[f"{load}x {label}"] = r = row(rep)
                print(f"{load}x {label:17s} TTFT p50/p95/p99 {r['ttft_p50']:7.0f}/{r['ttft_p95']:7.0f}/"
                      f"{r['ttft_p99']:7.0f} ms  e2e p99 {r['e2e_p99']:7.0f} ms  errors {r['error_rate']:.1%}  "
                      f"external {r['external_share']:.0%}  $/1M out {r['usd_per_1m_output']}", flush=True)
                print(f"    gateway state: {state_summary(state)}", flush=True)
        summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "capacity_rps": cap_rps,
                   "threshold_ms": args.threshold_ms, "duration_s": args.duration, "results": results}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print("\n| load | mode | TTFT P50 | TTFT P95 | TTFT P99 | E2E P50 | E2E P95 | E2E P99 | errors | external "
              "| $/1M output |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for k, r in results.items():
            load, label = k.split(" ", 1)
            usd = f"{r['usd_per_1m_output']:.3f}" if r["usd_per_1m_output"] is not None else "n/a"
            print(f"| {load} | {label} | {r['ttft_p50']:.0f} | {r['ttft_p95']:.0f} | {r['ttft_p99']:.0f} | "
                  f"{r['e2e_p50']:.0f} | {r['e2e_p95']:.0f} | {r['e2e_p99']:.0f} | {r['error_rate']:.1%} | "
                  f"{r['external_share']:.0%} | {usd} |")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(90)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()

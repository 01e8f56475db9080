"""Small probes for the 32-stream TTFT tail (docs/benchmarks.md, session 13), against servers already running.

    # 32 simultaneous 16-token streams at an idle server, --reps times: when does each first token come?
    .venv/bin/python benchmarks/probe_serve_tail.py burst http://127.0.0.1:PORT/v1 --reps 2
    # one wave of 32 x 256 tokens: decode speed alone
    .venv/bin/python benchmarks/probe_serve_tail.py wave http://127.0.0.1:PORT/v1
    # one bench_gateway 32-stream phase (96 x 64 tokens) and vLLM's own TTFT histogram around it, read from a Ray
    # node's metrics agent (ray.nodes()[i]["MetricsExportPort"]): how much of the client's TTFT is the engine's
    .venv/bin/python benchmarks/probe_serve_tail.py engine-ttft http://127.0.0.1:PORT/v1 http://127.0.0.1:MPORT/metrics

Start the servers as bench_gateway.py does (its fleet file and bare vLLM command), and run probes one at a time on
a quiet machine; alternate the paths (bare vLLM's /v1, Serve's /<model>/v1, the gateway's /v1) between calls.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import load  # noqa: E402
from timeline import clumps  # noqa: E402

TTFT = "ray_vllm_time_to_first_token_seconds"


def ttft_buckets(text: str) -> dict[str, float]:
    """``le`` -> cumulative count of vLLM's TTFT histogram on a Ray metrics page, summed over engines."""
    out: Counter[str] = Counter()
    for m in re.finditer(rf'^{TTFT}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} ([0-9.e+]+)', text, re.M):
        out[m.group(1)] += float(m.group(2))
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", choices=("burst", "wave", "engine-ttft"))
    ap.add_argument("url", help="an OpenAI base URL ending in /v1")
    ap.add_argument("metrics_url", nargs="?", help="engine-ttft: a Ray node's metrics agent page")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256, help="wave: tokens per stream")
    args = ap.parse_args()
    for i in range(args.reps):
        time.sleep(3)  # let the engine go idle (vLLM's workers spin ~1 s after a request)
        if args.probe == "burst":
            r = asyncio.run(load(args.url, args.model, 32, 32, 16, {}))
            print(f"burst {i}: TTFT P50 {r['ttft_p50_ms']:.0f} ms, max {max(b for _, b in r['samples']) * 1e3:.0f} ms;"
                  f" first tokens at {clumps([a + b for a, b in r['samples']], 0.1)}", flush=True)
        elif args.probe == "wave":
            r = asyncio.run(load(args.url, args.model, 32, 32, args.tokens, {}))
            print(f"wave {i}: 32 x {args.tokens} tokens, {r['output_tok_s']:.1f} chunks/s over {r['wall_s']:.1f} s "
                  "(chunks = tokens unless the engine batches them: stream_interval)", flush=True)
        else:
            if not args.metrics_url:
                ap.error("engine-ttft needs metrics_url")
            before = ttft_buckets(httpx.get(args.metrics_url, timeout=10).text)
            r = asyncio.run(load(args.url, args.model, 32, 96, 64, {}))
            time.sleep(12)  # Ray's metrics report interval
            after = ttft_buckets(httpx.get(args.metrics_url, timeout=10).text)
            delta = {le: after[le] - before.get(le, 0.0) for le in after}
            print(f"phase {i}: client TTFT P50 {r['ttft_p50_ms']:.0f} ms, P99 {r['ttft_p99_ms']:.0f} ms; "
                  f"engine TTFT cumulative buckets (le s: requests): "
                  + ", ".join(f"{le}: {n:.0f}" for le, n in delta.items() if n), flush=True)


if __name__ == "__main__":
    main()

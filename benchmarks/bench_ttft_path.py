"""Where one stream's time to first token goes, hop by hop: bare vLLM vs each hop of lmfleet's path.

One `lmfleet serve` (direct streaming: client -> gateway -> HAProxy -> Serve replica -> vLLM) and one bare vLLM
OpenAI server with the same model and engine options. At one stream, requests go to each path in strict
rotation (A B C D A B C D ...) so that drift on a shared machine hits every path alike:

    bare      http://127.0.0.1:<vllm>/v1            bare vLLM
    replica   http://<replica host:port>/...        the Serve replica's own HTTP port (HAProxy's backend server;
                                                    only with --replica)
    haproxy   http://127.0.0.1:<serve_port>/...     Ray Serve's HAProxy (what the gateway calls)
    gateway   http://127.0.0.1:<gateway>/v1         lmfleet's gateway

Per path: P50/mean TTFT (first content token) and time to first byte of the body, and the difference from the
path before it (what that hop adds).

    LMFLEET_CACHE=/tmp/lmfc .venv/bin/python benchmarks/bench_ttft_path.py --requests 40 --out out/ttft_path

The replica's address comes from HAProxy's configuration file (RAY_SERVE_HAPROXY_CONFIG_FILE_LOC, Ray's default
/tmp/haproxy-serve/haproxy.cfg).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import REPO, free_port, pct, stop, wait_http  # noqa: E402

HAPROXY_DIR = Path(os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "/tmp/haproxy-serve/haproxy.cfg")).parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2


async def one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, float, float]:
    """One stream: (TTFT by raw chunk, time to first byte, TTFT by complete line), all in ms. The first counts the
    first chunk holding a token; the last, the moment that token's ``data:`` line is complete (what a line reader,
    e.g. bench_gateway.py's ``aiter_lines``, sees)."""
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    t0 = time.perf_counter()
    tfb = ttft = tline = None
    buf = b""
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for chunk in r.aiter_raw():
            now = time.perf_counter()
            if tfb is None:
                tfb = now - t0
            if ttft is None and b'"text"' in chunk:
                ttft = now - t0
            if tline is None:
                buf += chunk
                for line in buf.split(b"\n")[:-1]:
                    if line.startswith(b"data: {") and b'"text"' in line:
                        tline = now - t0
                        break
    return ((ttft or float("nan")) * 1000, (tfb or float("nan")) * 1000, (tline or float("nan")) * 1000)


def replica_servers(serve_port: int, timeout_s: float = 120) -> list[str]:
    """host:port of the Serve replicas HAProxy sends to: the `server SERVE_REPLICA...` lines of the configuration
    file (Ray writes one per cluster session, under HAPROXY_DIR/<session>/) that binds ``serve_port``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        for cfg in sorted(HAPROXY_DIR.glob("**/haproxy.cfg"), key=lambda p: p.stat().st_mtime, reverse=True):
            text = cfg.read_text()
            if not re.search(rf"^\s*bind\s+\S*:{serve_port}\s*$", text, re.M):
                continue
            found = re.findall(r"^\s*server\s+SERVE_REPLICA\S+\s+(\d+\.\d+\.\d+\.\d+:\d+)", text, re.M)
            if found:
                return sorted(set(found))
        time.sleep(2)
    raise RuntimeError(f"no HAProxy configuration under {HAPROXY_DIR} binds port {serve_port}")


async def pick_url(client: httpx.AsyncClient, base: str, candidates: list[str]) -> str:
    for path in candidates:
        try:
            await one(client, base + path, 2)
            return base + path
        except httpx.HTTPError:
            continue
    raise RuntimeError(f"none of {candidates} answered at {base}")


async def measure(urls: dict[str, str], requests: int, max_tokens: int,
                  gap_s: float = 0.05) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "tfb": [], "tline": []} for k in urls}
    clients = {k: httpx.AsyncClient(timeout=120) for k in urls}
    try:
        for name, url in urls.items():  # warm each path and its keep-alive connection
            for _ in range(3):
                await one(clients[name], url, 4)
        for i in range(requests):
            for name, url in urls.items():
                ttft, tfb, tline = await one(clients[name], url, max_tokens)
                out[name]["ttft"].append(ttft)
                out[name]["tfb"].append(tfb)
                out[name]["tline"].append(tline)
                await asyncio.sleep(gap_s)
            if (i + 1) % 10 == 0:
                print(f"  {i + 1}/{requests}: " + "  ".join(
                    f"{k} {statistics.median(v['ttft']):.1f}" for k, v in out.items()), flush=True)
    finally:
        for c in clients.values():
            await c.aclose()
    return out


def report(urls: dict[str, str], args: argparse.Namespace, gap: float) -> dict:
    """Measure every path at one idle gap; print the table; return it with the raw samples."""
    load0 = os.getloadavg()[0]
    t = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    res = asyncio.run(measure(urls, args.requests, args.max_tokens, gap))
    load1 = os.getloadavg()[0]
    rows = {}
    prev = None
    print(f"\n{t}, load average {load0:.1f} -> {load1:.1f}, {args.requests} requests per path, "
          f"max_tokens {args.max_tokens}, {gap:g} s between requests\n")
    print("| path | TTFT P50 ms | TTFT mean ms | TTFT P90 ms | first byte P50 ms | line TTFT P50 ms "
          "| P50 added by this hop | vs bare |")
    print("|---|---|---|---|---|---|---|---|")
    for name, v in res.items():
        p50 = pct(v["ttft"], 0.5)
        rows[name] = {"ttft_p50_ms": p50, "ttft_mean_ms": statistics.fmean(v["ttft"]),
                      "ttft_p90_ms": pct(v["ttft"], 0.9), "tfb_p50_ms": pct(v["tfb"], 0.5),
                      "tline_p50_ms": pct(v["tline"], 0.5)}
        hop = "–" if prev is None else f"{p50 - rows[prev]['ttft_p50_ms']:+.1f}"
        vs = "–" if "bare" not in rows else f"{p50 - rows['bare']['ttft_p50_ms']:+.1f}"
        r = rows[name]
        print(f"| {name} | {p50:.1f} | {r['ttft_mean_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {r['tfb_p50_ms']:.1f} | {r['tline_p50_ms']:.1f} "
              f"| {hop} | {vs} |")
        prev = name
    return {"date": t, "load": [load0, load1], "table": rows, "raw": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="requests per path (rotated)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--gap-s", default="0.05", help="idle seconds between two requests; a comma list measures each "
                    "in turn on the same fleet (e.g. 0.05,2)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "ttft_path")
    ap.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-bare", action="store_true", help="skip bare vLLM (saves an engine)")
    ap.add_argument("--replica", action="store_true",
                    help="also call the Serve replica's own port directly (not a path clients use: on Ray 2.60 it "
                    "answered ~0.9 s slower than through HAProxy, every time)")
    ap.add_argument("--deployment", default="", help="extra deployment options, YAML flow (e.g. 'max_ongoing_requests: 8')")
    args = ap.parse_args()
    from lmfleet.models import resolve_source

    args.out.mkdir(parents=True, exist_ok=True)
    gport, sport, vport = free_port(), free_port(), free_port()
    fleet = args.out / "fleet.yaml"
    extra = f", {args.deployment}" if args.deployment else ""
    fleet.write_text(f"""gateway: {{port: {gport}, serve_port: {sport}}}
ledger: {{path: {args.out / 'ledger.sqlite'}}}
models:
  - name: smollm2
    source: builtin:smollm2
    engine: {{max_model_len: 2048, cpu_kvcache_space_gib: 2, max_num_seqs: 64}}
    deployment: {{max_ongoing_requests: 64{extra}}}
""")
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    procs = []
    try:
        lm = subprocess.Popen([sys.executable, "-m", "lmfleet.cli.main", "serve", "-c", str(fleet)],
                              env={**env, **dict(kv.split("=", 1) for kv in args.serve_env)},
                              stdout=(args.out / "serve.log").open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
        procs.append(lm)
        wait_http(f"http://127.0.0.1:{gport}/ready", 1200, lm)
        print("lmfleet serve ready", flush=True)
        urls = {}
        if not args.no_bare:
            model_dir = resolve_source("builtin:smollm2")
            bare = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                 "--served-model-name", "smollm2", "--port", str(vport), "--max-model-len", "2048",
                 "--max-num-seqs", "64", "--dtype", "float32", "--disable-log-stats"],
                env={**env, "VLLM_CPU_KVCACHE_SPACE": "2"}, stdout=(args.out / "vllm.log").open("w"),
                stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(bare)
            wait_http(f"http://127.0.0.1:{vport}/v1/models", 1200, bare)
            print("bare vLLM ready", flush=True)
            urls["bare"] = f"http://127.0.0.1:{vport}/v1/completions"
        servers = replica_servers(sport)
        print(f"replica servers (from HAProxy's configuration): {servers}", flush=True)

        async def resolve() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                if args.replica:
                    urls["replica"] = await pick_url(c, f"http://{servers[0]}",
                                                     ["/smollm2/v1/completions", "/v1/completions"])
                urls["haproxy"] = await pick_url(c, f"http://127.0.0.1:{sport}", ["/smollm2/v1/completions"])
        asyncio.run(resolve())
        urls["gateway"] = f"http://127.0.0.1:{gport}/v1/completions"
        print(json.dumps(urls, indent=1), flush=True)
        tables = {}
        for gap in [float(g) for g in str(args.gap_s).split(",")]:
            tables[f"{gap:g}"] = report(urls, args, gap)
        (args.out / "ttft_path.json").write_text(json.dumps({"urls": urls, "by_gap_s": tables}, indent=1))
    finally:
        for p in reversed(procs):
            stop(p)


if __name__ == "__main__":
    main()

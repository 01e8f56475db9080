"""Overflow policies on one bursty trace: predictive, hedge, ttft_timeout, on_error and local only, against the
oracle's spend.

    .venv/bin/python benchmarks/bench_overflow_policies.py --out out/bench_overflow_policies [--duration 90] [--rounds 2]
    .venv/bin/python benchmarks/bench_overflow_policies.py --smoke   # seconds of trace: the harness works

It starts the fake provider (``lmfleet.testing.fast_openai_server --latency-model``: TTFT log-normal, median
400 ms, P99 1.5 s, 25 ms per output token; priced at ``--price-in``/``--price-out`` $/1M tokens) and
``lmfleet serve`` with SmolLM2 on one replica. It measures the replica's capacity on the trace's mix (a closed
loop of ``max_num_seqs`` users, local only, after ``--warmup-s`` of the same load), builds the bursty open-loop
trace of ``lmfleet.bench.trace`` from it (one seed for every policy), replays it once local only as a warm-up
(not counted: a fresh CPU engine's first bursts of simultaneous prefills run several times slower), and then once
per policy per round, alternating policies within each round (``POST /admin/overflow`` switches the policy;
``local only`` is overflow forced off; the gateway's miss margin and prefill slope, learned from the requests kept
local, carry over from one policy to the next as they would in service). Every replay sends fresh prompt text of
the same lengths: vLLM's prefix cache would otherwise serve the long prompts from the replay before. An aiohttp
client streams every request and records its TTFT and the gateway's headers (``x-lmfleet-served-by``,
``-route-reason``, ``-hedged``, ``-queue-estimate-ms``); spend comes from the ledger (``/admin/usage`` over the
run's window, hedge and failover losers included).

Per policy (rounds pooled): TTFT SLO attainment (TTFT <= ``--threshold-ms``), TTFT P50/P95/P99, external
share, dollars and $/1M tokens (prompt + output, all requests), prompt tokens sent to both the local engine
and a provider (hedged requests, and ttft_timeout failovers: an upper bound on the tokens prefilled twice, since a
local attempt cancelled while still queued in vLLM was not prefilled), requests answered after a cancelled
local attempt (ttft_timeout failovers, hedges the provider won), errors; and the estimate's error on the
streamed requests kept local, per round: the ledger's ``predicted_wait_ms`` against ``realised_wait_ms`` (the
gateway's TTFT of the local answer), read through ``/admin/usage?estimate=1`` over the round's window -- the
figures ``lmfleet usage --estimate`` prints (:mod:`lmfleet.overflow.estimate_error`) -- and over all rounds of the
policy, from the client's side (the ``x-lmfleet-queue-estimate-ms`` header against the client's TTFT).

The oracle (:mod:`lmfleet.overflow.oracle`): the local service model fitted on the ``local only`` runs (a
request counts as queued when ``max_num_seqs`` earlier requests were still streaming as it was sent), then
the cheapest spill set that meets the SLO on the same trace: its spend is the bound a policy's is compared to.

The client and the fake provider stand for machines outside the fleet. On a small machine they would wait for CPU
behind the fleet's own processes (vLLM's CPU engine binds its threads to one core; the gateway, Ray Serve and the
rest share the others) and add that wait to every TTFT, the provider's included: when the bench starts its own
fleet they run at autogroup nice ``--outside-nice`` (-10, root only; this process's session and the provider's).
``uptime``'s load is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lmfleet.bench.trace import TraceRequest, TraceSpec, bursty_trace
from lmfleet.config.models import ProviderPrice
from lmfleet.overflow.estimate_error import estimate_error, percentile
from lmfleet.overflow.oracle import LocalServiceModel, ServiceSample, oracle_spill
from lmfleet.provenance import is_external
from lmfleet.testing.fleet import autogroup_nice

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
ADMIN = "bench-admin"
KEYS = {"admin": ADMIN, "api": ""}
"""The admin key and the client's API key in use (``--admin-key``, ``--api-key`` with ``--url``)."""
PKEY = "sk-bench-provider"
MODEL = "smollm2"
LOCAL_ONLY = "local only"
POLICIES = ("predictive", "hedge", "ttft_timeout", "on_error", LOCAL_ONLY)
WORDS = ("the of and to in is was for on are with as by at be this from or an have not which one all were "
         "when there can more if out so what up its about into than them only other new some could time these "
         "two may then do first any my now such like our over man me even most made after also did many before "
         "must through back years where much your way well down should because each just those people how too").split()


@dataclass
class Outcome:
    """One replayed request, as the client saw it."""

    index: int
    prompt_tokens: int
    output_tokens: int
    sent_s: float
    """Seconds after the run's start when it was sent (its arrival)."""
    ttft_s: float | None
    e2e_s: float | None
    status: int
    served_by: str = ""
    route_reason: str = ""
    hedged: bool = False
    estimate_ms: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft_s is not None

    @property
    def external(self) -> bool:
        return is_external(self.served_by) if self.served_by else False

    @property
    def both_sent(self) -> bool:
        """The prompt went to the local engine and to a provider."""
        return self.hedged or self.route_reason == "ttft_timeout"

    @property
    def after_cancel(self) -> bool:
        """Answered by a provider after the local attempt was cancelled."""
        return self.route_reason in ("ttft_timeout", "hedge_won")


# ---- pure: the figures ---------------------------------------------------------------------------------------

def summarize(outcomes: list[Outcome], slo_s: float, spend_usd: float) -> dict:
    """One policy's figures (rounds pooled); the module docstring says what each means."""
    n = len(outcomes)
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s * 1000 for o in ok]  # type: ignore[operator]
    tokens = sum(o.prompt_tokens + o.output_tokens for o in ok)
    prompt = sum(o.prompt_tokens for o in outcomes)
    twice = sum(o.prompt_tokens for o in outcomes if o.both_sent)
    return {
        "requests": n, "errors": n - len(ok),
        "slo_attainment": sum(1 for t in ttfts if t <= slo_s * 1000) / n if n else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p95_ms": percentile(ttfts, 95),
        "ttft_p99_ms": percentile(ttfts, 99),
        "kept_local_ttft_p99_ms": percentile([o.ttft_s * 1000 for o in ok if not o.external], 99),  # type: ignore[operator]
        "external_share": sum(1 for o in ok if o.external) / len(ok) if ok else 0.0,
        "spend_usd": spend_usd, "usd_per_1m_tokens": spend_usd / tokens * 1e6 if tokens else None,
        "prompt_tokens": prompt, "prompt_tokens_sent_twice": twice,
        "sent_twice_share": twice / prompt if prompt else 0.0,
        "answered_after_cancel": sum(1 for o in ok if o.after_cancel),
        "hedged": sum(1 for o in outcomes if o.hedged),
    }


def pooled_estimate(outcomes: list[Outcome], threshold_ms: float) -> dict | None:
    """The estimate's error over every round of one policy, client-measured: the ``x-lmfleet-queue-estimate-ms``
    header against the client's TTFT, of the requests answered locally (None: none). The per-round figures come
    from the ledger (the gateway's TTFT); the client's adds its own few milliseconds."""
    pairs = [(o.estimate_ms, o.ttft_s * 1000) for o in outcomes  # type: ignore[operator]
             if o.ok and not o.external and o.estimate_ms is not None]
    return estimate_error(MODEL, pairs).as_dict(threshold_ms) if pairs else None


def service_samples(outcomes: list[Outcome], slots: int) -> list[ServiceSample]:
    """The oracle's inputs from a ``local only`` run: a request queued when ``slots`` earlier ones still ran."""
    done = sorted((o for o in outcomes if o.ok and o.e2e_s is not None), key=lambda o: o.sent_s)
    out = []
    for i, o in enumerate(done):
        running = sum(1 for p in done[:i] if p.sent_s + p.e2e_s > o.sent_s)  # type: ignore[operator]
        out.append(ServiceSample(o.prompt_tokens, o.output_tokens, o.ttft_s, o.e2e_s, running >= slots))  # type: ignore[arg-type]
    return out


def table(results: dict[str, dict], oracle_usd: float | None) -> str:
    head = ("| policy | requests | SLO attained | TTFT P50 | P95 | P99 | kept-local P99 | external | $ spent | "
            "$/1M tok | x oracle $ | prompt tok sent twice | answered after cancel | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        ratio = (f"{r['spend_usd'] / oracle_usd:.2f}" if oracle_usd else "n/a")
        per = f"{r['usd_per_1m_tokens']:.3f}" if r["usd_per_1m_tokens"] is not None else "n/a"
        lines.append(
            f"| {name} | {r['requests']} | {r['slo_attainment']:.1%} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} "
            f"| {r['ttft_p99_ms']:.0f} | {r['kept_local_ttft_p99_ms']:.0f} | {r['external_share']:.0%} | "
            f"{r['spend_usd']:.5f} | {per} | {ratio} | {r['prompt_tokens_sent_twice']} "
            f"({r['sent_twice_share']:.1%}) | {r['answered_after_cancel']} | {r['errors']} |")
    return "\n".join(lines)


# ---- I/O: the fleet, the client ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_text(r: TraceRequest, seed: int, salt: int = 0) -> str:
    """The request's prompt: ``r.prompt_tokens`` random words. ``salt``: which replay sends it; every replay sends
    fresh text of the same lengths, so that vLLM's prefix cache does not serve a replay's long prompts from an
    earlier one (a prefilled 2,500-token prompt answers in a fraction of the uncached time)."""
    rng = random.Random((seed * 1_000_003 + r.index) * 65_537 + salt)
    return " ".join(rng.choice(WORDS) for _ in range(r.prompt_tokens))


async def send(session, url: str, r: TraceRequest, seed: int, t0: float, ignore_eos: bool, salt: int = 0) -> Outcome:
    import aiohttp

    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt_text(r, seed, salt)}],
            "max_tokens": r.output_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"authorization": f"Bearer {KEYS['api']}"} if KEYS["api"] else {}
    sent = time.monotonic()
    o = Outcome(r.index, r.prompt_tokens, r.output_tokens, sent - t0, None, None, 0)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            o.status = resp.status
            h = resp.headers
            o.served_by, o.route_reason = h.get("x-lmfleet-served-by", ""), h.get("x-lmfleet-route-reason", "")
            o.hedged = h.get("x-lmfleet-hedged", "").lower() in ("1", "true", "yes")
            est = h.get("x-lmfleet-queue-estimate-ms")
            o.estimate_ms = float(est) if est else None
            if resp.status != 200:
                o.error = (await resp.text())[:200]
                return o
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    o.prompt_tokens = ev["usage"].get("prompt_tokens", o.prompt_tokens)
                    o.output_tokens = ev["usage"].get("completion_tokens", o.output_tokens)
                if o.ttft_s is None and any((c.get("delta") or {}).get("content") for c in ev.get("choices", [])):
                    o.ttft_s = time.monotonic() - sent
            o.e2e_s = time.monotonic() - sent
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        o.error = f"{type(e).__name__}: {e}"[:200]
    return o


async def replay(url: str, trace: list[TraceRequest], seed: int, ignore_eos: bool, salt: int) -> list[Outcome]:
    """Send every request at its arrival time (open loop), whatever the answers; ``salt``: :func:`prompt_text`."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.monotonic()
        tasks = []
        for r in trace:
            delay = t0 + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(s, url, r, seed, t0, ignore_eos, salt)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(url: str, trace: list[TraceRequest], users: int, duration_s: float, seed: int,
                      ignore_eos: bool) -> float:
    """Requests per second that ``users`` back-to-back clients complete on the trace's mix: each starts requests
    for ``duration_s``; every answer counts, over the time until the last one ended (requests of several seconds
    each would otherwise be cut off at the end and the capacity under-measured)."""
    import aiohttp

    done = 0
    t0 = time.monotonic()

    async def user(k: int) -> None:
        nonlocal done
        i = k
        while time.monotonic() - t0 < duration_s:
            o = await send(s, url, trace[i % len(trace)], seed, t0, ignore_eos, salt=-1 - i // len(trace))
            i += users
            done += o.ok

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(user(k) for k in range(users)))
    return done / (time.monotonic() - t0)


def admin(url: str, method: str, path: str, body: dict | None = None) -> dict:
    import httpx

    r = httpx.request(method, f"{url}{path}", json=body, headers={"authorization": f"Bearer {KEYS['admin']}"},
                  timeout=30)
    r.raise_for_status()
    return r.json()


def set_policy(url: str, name: str, threshold_ms: float, hedge_after_ms: float, timeout_ms: float) -> None:
    if name == LOCAL_ONLY:
        admin(url, "POST", "/admin/overflow", {"model": MODEL, "mode": "force_off"})
        return
    admin(url, "POST", "/admin/overflow", {"model": MODEL, "mode": "auto", "threshold_ms": threshold_ms,
                                           "policy": name, "hedge_after_ms": hedge_after_ms,
                                           "ttft_timeout_ms": timeout_ms})


def provider_spend_usd(url: str, since: float, until: float) -> float:
    usage = admin(url, "GET", f"/admin/usage?since={since}&until={until}")
    return sum(r["cost_usd"] for r in usage["rows"] if is_external(r["served_by"]))


def estimate_error_of(url: str, since: float, until: float) -> dict | None:
    """The estimate's error on the model's requests kept local in the window, from the ledger (None: none)."""
    models = admin(url, "GET", f"/admin/usage?estimate=1&since={since}&until={until}")["models"]
    return next((m for m in models if m["model"] == MODEL), None)


def estimate_line(name: str, label: str, e: dict) -> str:
    return (f"  {name:12s} {label}: n={e['requests']} median |err| {e['median_abs_error_ms']:.0f} ms, P90 |err| "
            f"{e['p90_abs_error_ms']:.0f} ms ({e['p90_abs_error_pct_of_threshold']:.0f} % of threshold), bias "
            f"{e['bias_ms']:+.0f} ms, median actual/predicted {e['median_actual_over_predicted']}")


def wait_ready(url: str, timeout: float, procs: list[subprocess.Popen]) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a fleet process exited before the fleet was ready (see its log)")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(url)


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_overflow_policies")
    ap.add_argument("--duration", type=float, default=90, help="seconds of trace per policy per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threshold-ms", type=float, default=2500, help="the TTFT SLO and overflow threshold")
    ap.add_argument("--hedge-after-ms", type=float, default=1500)
    ap.add_argument("--ttft-timeout-ms", type=float, default=2500)
    ap.add_argument("--miss-quantile", type=lambda v: None if v.lower() == "none" else float(v), default=0.9,
                    help="the fleet's overflow.miss_quantile (the miss margin's quantile; docs/overflow.md); "
                    "none: no margin")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--capacity-rps", type=float, default=None, help="skip the capacity measurement")
    ap.add_argument("--outside-nice", type=int, default=-10,
                    help="scheduling priority (autogroup nice, -20..19) of this client and the fake provider, which "
                    "stand for machines outside the fleet: below 0 (root only) they no longer wait for CPU behind "
                    "the fleet's own processes; 0: no change")
    ap.add_argument("--warmup-s", type=float, default=60,
                    help="seconds of closed-loop load before the capacity is measured (not counted)")
    ap.add_argument("--price-in", type=float, default=0.5, help="provider $/1M prompt tokens")
    ap.add_argument("--price-out", type=float, default=1.5, help="provider $/1M output tokens")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--smoke", action="store_true", help="a few seconds of trace, one round: the harness works")
    ap.add_argument("--url", default=None, help="use this running fleet (one started with --serve-only)")
    ap.add_argument("--admin-key", default=ADMIN, help="with --url: the fleet's admin key")
    ap.add_argument("--api-key", default="", help="with --url: an API key of the fleet (none: no auth)")
    ap.add_argument("--serve-only", action="store_true", help="start the fleet, print its URL, run until Ctrl-C")
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.rounds = 8, 1
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"load at start: {load()}", flush=True)
    if args.url:
        KEYS.update(admin=args.admin_key, api=args.api_key)
        before = admin(args.url, "GET", "/admin/state")["models"][MODEL]
        try:
            run(args, args.url)
        finally:  # the fleet as it was (the policy: predictive, the default)
            admin(args.url, "POST", "/admin/overflow", {"model": MODEL, "mode": before["mode"],
                                                        "threshold_ms": before["threshold_ms"],
                                                        "policy": "predictive"})
        return
    pport, gport, sport = free_port(), free_port(), free_port()
    fleet = out / "fleet.yaml"
    fleet.write_text(f"""gateway: {{port: {gport}, serve_port: {sport}, admin_key_env: BENCH_ADMIN}}
ledger: {{path: {out / 'ledger.sqlite'}}}
providers:
  - name: backup
    base_url: http://127.0.0.1:{pport}/v1
    api_key_env: BENCH_PROVIDER_KEY
    model_map: {{{MODEL}: smollm2-remote}}
    price: {{input_per_1m: {args.price_in}, output_per_1m: {args.price_out}}}
models:
  - name: {MODEL}
    source: builtin:smollm2
    engine: {{max_model_len: 4096, cpu_kvcache_space_gib: 1, max_num_seqs: {args.max_num_seqs}}}
    deployment: {{max_ongoing_requests: {args.max_num_seqs}, request_timeout_s: 600}}
    cost: {{node_hour_usd: 0.10}}
    overflow: {{threshold_ms: {args.threshold_ms}, miss_quantile: {json.dumps(args.miss_quantile)}}}
""")
    env = {**os.environ, "BENCH_ADMIN": ADMIN, "BENCH_PROVIDER_KEY": PKEY}
    procs = [
        subprocess.Popen([sys.executable, "-m", "lmfleet.testing.fast_openai_server", "--port", str(pport),
                          "--model", "smollm2-remote", "--latency-model", "400,1500,25", "--seed", str(args.seed)],
                         env=env, stdout=(out / "provider.log").open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True),
        subprocess.Popen([str(BIN / "lmfleet"), "serve", "-c", str(fleet)], env=env,
                         stdout=(out / "serve.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True),
    ]
    url = f"http://127.0.0.1:{gport}"
    print(f"client and fake provider (outside the fleet): {autogroup_nice('self', args.outside_nice)}, "
          f"{autogroup_nice(procs[0].pid, args.outside_nice)}", flush=True)
    # SIGINT too: a shell that starts this in the background (no job control) leaves SIGINT ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the finally below ends what was started
        signal.signal(sig, interrupted)
    try:
        t_start = time.monotonic()
        wait_ready(f"{url}/ready", 1800, procs)
        print(f"fleet ready after {time.monotonic() - t_start:.0f} s at {url}", flush=True)
        if args.serve_only:
            while True:
                signal.pause()
        else:
            run(args, url)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}): stopping the fleet", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal does not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def interrupted(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace, url: str) -> None:
    """Calibrate, replay the trace per policy and round, and report (module docstring)."""
    out: Path = args.out
    slo_s = args.threshold_ms / 1000
    price = ProviderPrice(input_per_1m=args.price_in, output_per_1m=args.price_out)
    shape = dict(duration_s=args.duration, burst_s=8.0, burst_every_s=45.0) if not args.smoke else \
        dict(duration_s=args.duration, burst_s=2.0, burst_every_s=12.0, long_prompt=(200, 600))
    cal = bursty_trace(TraceSpec(capacity_rps=1.0, **shape), args.seed + 1)
    set_policy(url, LOCAL_ONLY, args.threshold_ms, args.hedge_after_ms, args.ttft_timeout_ms)
    cap = args.capacity_rps
    if cap is None:
        # a fresh CPU engine answers its first minute or two of load 2-3x slower: measured then, the capacity
        # is too low and the trace too light for the warm engine
        asyncio.run(closed_loop(url, cal, args.max_num_seqs, 2 if args.smoke else args.warmup_s, args.seed, True))
        cap = asyncio.run(closed_loop(url, cal, args.max_num_seqs, 5 if args.smoke else 30, args.seed, True))
    spec = TraceSpec(capacity_rps=cap, **shape)
    trace = bursty_trace(spec, args.seed)
    print(f"capacity {cap:.2f} req/s; trace: {len(trace)} requests over {args.duration:.0f} s "
          f"(mean {spec.mean_load}x, bursts {spec.burst_load}x, burstiness {spec.burstiness}), seed {args.seed}",
          flush=True)
    if not args.smoke:
        # the engine's first bursts of simultaneous prefills run several times slower than later ones (the first
        # policy replayed would pay for it): one replay of the trace, local only and not counted, first
        t = time.monotonic()
        asyncio.run(replay(url, trace, args.seed, ignore_eos=True, salt=0))
        print(f"warm-up replay of the trace (local only, not counted): {time.monotonic() - t:.0f} s", flush=True)
    runs: dict[str, list[Outcome]] = {p: [] for p in args.policies}
    spend: dict[str, float] = {p: 0.0 for p in args.policies}
    estimates: dict[str, list[dict]] = {p: [] for p in args.policies}
    salt = 0  # one per replay: fresh prompt text every time (prompt_text)
    for rnd in range(args.rounds):
        order = args.policies if rnd % 2 == 0 else list(reversed(args.policies))
        for name in order:
            set_policy(url, name, args.threshold_ms, args.hedge_after_ms, args.ttft_timeout_ms)
            time.sleep(3)
            since = time.time()
            salt += 1
            res = asyncio.run(replay(url, trace, args.seed, ignore_eos=True, salt=salt))
            time.sleep(2)  # the last ledger rows
            until = time.time()
            spend[name] += provider_spend_usd(url, since - 1, until)
            e = estimate_error_of(url, since - 1, until)
            if e is not None:
                estimates[name].append({"round": rnd + 1, **e})
            runs[name] += res
            r = summarize(res, slo_s, 0.0)
            print(f"round {rnd + 1} {name:12s} SLO {r['slo_attainment']:.1%}  TTFT p50/p99 "
                  f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms  external {r['external_share']:.0%}  "
                  f"errors {r['errors']}", flush=True)
    results = {name: summarize(runs[name], slo_s, spend[name]) for name in args.policies}
    oracle = None
    if LOCAL_ONLY in runs:
        try:
            model = LocalServiceModel.fit(service_samples(runs[LOCAL_ONLY], args.max_num_seqs),
                                          args.max_num_seqs)
            res = oracle_spill(trace, model, args.threshold_ms, price)
            oracle = {"model": asdict(model), "spilled": len(res.spilled), "of": len(trace),
                      "spend_usd": res.spend_nusd / 1e9 * args.rounds}
        except ValueError as e:
            print(f"oracle: not computed ({e})", flush=True)
    print(f"\nload at end: {load()}")
    print(f"\nthreshold {args.threshold_ms:.0f} ms, hedge_after {args.hedge_after_ms:.0f} ms, ttft_timeout "
          f"{args.ttft_timeout_ms:.0f} ms, miss_quantile {args.miss_quantile}, {args.rounds} round(s), "
          f"provider $ {args.price_in}/{args.price_out} "
          "per 1M in/out\n")
    print(table(results, oracle["spend_usd"] if oracle else None))
    if oracle:
        print(f"\noracle: spills {oracle['spilled']} of {oracle['of']} requests per round, "
              f"${oracle['spend_usd']:.5f} over {args.rounds} round(s); local model {oracle['model']}")
    print("\nestimate (streamed requests kept local, from the ledger: predicted vs realised wait):")
    pooled = {name: pooled_estimate(runs[name], args.threshold_ms) for name in args.policies}
    for name, per_round in estimates.items():
        for e in per_round:
            print(estimate_line(name, f"round {e['round']}", e))
        if pooled[name] is not None:
            print(estimate_line(name, f"rounds 1-{args.rounds} pooled (client's TTFT)", pooled[name]))
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "capacity_rps": cap,
               "trace": asdict(spec), "requests_per_round": len(trace), "seed": args.seed,
               "threshold_ms": args.threshold_ms, "hedge_after_ms": args.hedge_after_ms,
               "ttft_timeout_ms": args.ttft_timeout_ms, "miss_quantile": args.miss_quantile, "rounds": args.rounds,
               "results": results,
               "outside_nice": args.outside_nice, "oracle": oracle, "estimate": estimates,
               "estimate_pooled_client": pooled}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "outcomes.jsonl").write_text("".join(
        json.dumps({"policy": k, **asdict(o)}) + "\n" for k, v in runs.items() for o in v))


if __name__ == "__main__":
    main()

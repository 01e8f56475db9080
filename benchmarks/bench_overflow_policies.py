"""Overflow policies on one trace: predictive, hedge, ttft_timeout, on_error and local only, against the oracle's
spend, and optionally the real LiteLLM proxy beside them.

    .venv/bin/python benchmarks/bench_overflow_policies.py --out out/bench_overflow_policies [--duration 90] [--rounds 2]
    .venv/bin/python benchmarks/bench_overflow_policies.py --smoke   # seconds of trace: the harness works
    .venv/bin/python benchmarks/bench_overflow_policies.py --shape onoff|ramp|prefill|output   # another shape
    .venv/bin/python benchmarks/bench_overflow_policies.py --trace azure:start=600:requests=250:load=1.3:tokens=0.25
    make litellm && .venv/bin/python benchmarks/bench_overflow_policies.py --litellm   # + LiteLLM arms

The trace: ``--shape`` (:mod:`lmfleet.bench.shapes`; ``gamma``, the default, is the bursty trace of
:mod:`lmfleet.bench.trace`) built at the measured capacity, or ``--trace`` (:mod:`lmfleet.bench.replay`): a window of
a recorded trace in the Azure format (by default ``../shared/traces/AzureLLMInferenceTrace_code.csv`` beside the
checkout, CC-BY 4.0: its credit is printed with the figures), paced to a multiple of the measured capacity and its
token counts scaled and capped by the context (``--max-model-len`` less a margin for the chat template). The
header, and ``trace`` in summary.json, name the trace, its window and every factor.

It starts the fake provider (``lmfleet.testing.fast_openai_server --latency-model``: TTFT log-normal, median
400 ms, P99 1.5 s, 25 ms per output token; priced at ``--price-in``/``--price-out`` $/1M tokens) and
``lmfleet serve`` with SmolLM2 on one replica. It measures the replica's capacity on the trace's mix (a closed
loop of ``max_num_seqs`` users, local only, after ``--warmup-s`` of the same load), builds the bursty open-loop
trace of ``lmfleet.bench.trace`` from it (one seed for every policy), replays it once local only as a warm-up
(not counted: a fresh CPU engine's first bursts of simultaneous prefills run several times slower), and then once
per policy per round, alternating policies within each round (``POST /admin/overflow`` switches the policy;
``local only`` is overflow forced off; the gateway's miss margin and prefill line, learned from the requests kept
local, carry over from one policy to the next as they would in service). Every arm runs with
``overflow.prefill_gate`` at its default, ``auto`` (on for this CPU engine with its provider; docs/overflow.md), but
``local only``, which runs with it off; ``--policies "predictive ungated"`` adds an arm of predictive with it off,
``"predictive gated"`` one with it on; ``"predictive no floor"`` one with ``overflow.miss_floor`` 0;
``"predictive prefill line"`` one whose gated requests are priced on the prefill line, not the gate's service line
(``POST /admin/overflow`` ``gate_line`` false; docs/overflow.md, the prefill gate). Every
replay sends fresh prompt text of the same lengths: vLLM's prefix cache would otherwise serve the long prompts from
the replay before. An aiohttp
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

The oracle (:mod:`lmfleet.overflow.oracle`): the local service model -- ``max_num_seqs`` slots, prompts
prefilled one after another, its prefill line fitted by least absolute deviations on the local answers of every
policy's rounds that did not queue (``max_num_seqs`` earlier local answers still streaming, or one still before its
first token, as it was sent), its decode rate on the ``local only`` runs -- then the cheapest spill set that meets the SLO on the
same trace: its spend is the bound a policy's is compared to. The model has no other interference between
requests (decode speed does not depend on the load): it can be wrong both ways,
so the ``oracle plan`` arm checks it on the engine. It replays the trace with the spill set of the model fitted on
round 1 sent straight to the provider and the rest through the gateway, local only (last in round 1,
first in round 2; with ``--url``, only when ``--provider-url`` is given, its key from ``BENCH_PROVIDER_KEY``).
Its attainment says whether the oracle's spend is a bound a policy could reach: below the SLO, the model was
optimistic, and the oracle's spend is too low.

``--litellm``: the real LiteLLM proxy (``make litellm`` installs it into ``.venv-litellm``;
:mod:`lmfleet.testing.litellm_proxy`) routed to the engine's own Serve endpoint (``/smollm2/v1`` on ``serve_port``, as
the gateway reaches it) with ``stream_timeout`` at each of ``--litellm-timeouts-ms`` (the threshold and 0.6x it by
default), ``fallbacks`` to the same fake provider and ``num_retries: 0``; each timeout is one more arm of every round
(the gateway forced local meanwhile, so that it sends nothing). Its spend is the provider's bill for the answers it
gave (their usage at its price: LiteLLM has no lmfleet ledger); a fallback sent the prompt twice. Its
``stream_timeout`` also bounds every gap between chunks: a stall mid-stream ends in an error, not a fallback. It is
stopped by pid at the end, on failure and on Ctrl-C.

The client and the fake provider stand for machines outside the fleet. On a small machine they would wait for CPU
behind the fleet's own processes (vLLM's CPU engine binds its threads to one core; the gateway, Ray Serve and the
rest share the others) and add that wait to every TTFT, the provider's included: when the bench starts its own
fleet they run at autogroup nice ``--outside-nice`` (-10, root only; this process's session and the provider's),
and so does the LiteLLM proxy, which would run on a node of its own.
``uptime``'s load is printed at the start and the end. ``--dataset-out``: rows for ``estimator_loto.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from lmfleet.bench.overflow_figures import (GATED, LOCAL_ONLY, NO_FLOOR, OLDLINE, ORACLE_PLAN, UNGATED,  # noqa: F401
                                            Outcome, estimate_line, header_lines, local_model, pooled_estimate,
                                            provider_bill_usd, service_samples, summarize, table)
from lmfleet.bench.loto import append_rows, dataset_rows
from lmfleet.bench.mix import BenchInputError
from lmfleet.bench.replay import parse_replay, read_trace_file, replay as replay_trace
from lmfleet.bench.shapes import SHAPES, shape_trace
from lmfleet.bench.trace import TraceRequest
from lmfleet.config.models import ProviderPrice
from lmfleet.net import free_port
from lmfleet.overflow.margin import FLOOR
from lmfleet.overflow.oracle import oracle_spill
from lmfleet.provenance import is_external
from lmfleet.testing.fleet import autogroup_nice
from lmfleet.testing.litellm_proxy import LiteLLMProxy, arm_model, litellm_bin, litellm_config
from lmfleet.testing.overflow_client import Endpoint, closed_loop, replay

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
ADMIN = "bench-admin"
KEYS = {"admin": ADMIN, "api": ""}
"""The admin key and the client's API key in use (``--admin-key``, ``--api-key`` with ``--url``)."""
PKEY = "sk-bench-provider"
MODEL = "smollm2"
POLICIES = ("predictive", "hedge", "ttft_timeout", "on_error", LOCAL_ONLY)
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"
CONTEXT_MARGIN = 64
"""Tokens of the context a replayed request leaves free: the chat template's, and words that are two tokens."""


def admin(url: str, method: str, path: str, body: dict | None = None) -> dict:
    import httpx

    r = httpx.request(method, f"{url}{path}", json=body, headers={"authorization": f"Bearer {KEYS['admin']}"},
                  timeout=30)
    r.raise_for_status()
    return r.json()


def set_policy(url: str, name: str, threshold_ms: float, hedge_after_ms: float, timeout_ms: float) -> None:
    if name == LOCAL_ONLY:
        admin(url, "POST", "/admin/overflow", {"model": MODEL, "mode": "force_off", "prefill_gate": False})
        return
    admin(url, "POST", "/admin/overflow", {"model": MODEL, "mode": "auto", "threshold_ms": threshold_ms,
                                           "policy": "predictive" if name in (GATED, UNGATED, NO_FLOOR, OLDLINE)
                                           else name,
                                           "gate_line": name != OLDLINE,
                                           "prefill_gate": {GATED: True, UNGATED: False}.get(name, "auto"),
                                           "miss_floor": 0.0 if name == NO_FLOOR else FLOOR,
                                           "hedge_after_ms": hedge_after_ms,
                                           "ttft_timeout_ms": timeout_ms})


def provider_spend_usd(url: str, since: float, until: float) -> float:
    usage = admin(url, "GET", f"/admin/usage?since={since}&until={until}")
    return sum(r["cost_usd"] for r in usage["rows"] if is_external(r["served_by"]))


def estimate_error_of(url: str, since: float, until: float, features: bool = False) -> tuple[dict | None, list]:
    """The model's estimate error in the window, from the ledger (None: none), and with ``features`` its rows."""
    got = admin(url, "GET", f"/admin/usage?estimate=1&since={since}&until={until}" + "&features=1" * features)
    return next((m for m in got["models"] if m["model"] == MODEL), None), got.get("requests", [])


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


def wait_engines_idle(url: str, timeout_s: float) -> float:
    """Seconds waited until the engines report nothing running or waiting: requests of the previous arm that reached
    them past the gateway (LiteLLM's, abandoned by their client at its timeout) would otherwise queue ahead of the
    next arm, unseen by its gateway. No counts (metrics off, or an idle engine's series expired) count as idle."""
    t0 = time.monotonic()
    while True:
        s = admin(url, "GET", "/admin/state")["models"][MODEL]
        if (s["engine_running"] or 0) + (s["engine_waiting"] or 0) + s["in_flight"] == 0 \
                or time.monotonic() - t0 >= timeout_s:
            return time.monotonic() - t0
        time.sleep(1)


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
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engine's token budget per step (engine.max_num_batched_tokens), to replay with your "
                    "fleet's; default: vLLM's (2048 on CPU)")
    ap.add_argument("--capacity-rps", type=float, default=None, help="skip the capacity measurement")
    ap.add_argument("--outside-nice", type=int, default=-10,
                    help="scheduling priority (autogroup nice, -20..19) of this client and the fake provider, which "
                    "stand for machines outside the fleet: below 0 (root only) they no longer wait for CPU behind "
                    "the fleet's own processes; 0: no change")
    ap.add_argument("--warmup-s", type=float, default=60,
                    help="seconds of closed-loop load before the capacity is measured (not counted)")
    ap.add_argument("--price-in", type=float, default=0.5, help="provider $/1M prompt tokens")
    ap.add_argument("--price-out", type=float, default=1.5, help="provider $/1M output tokens")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES),
                    choices=(*POLICIES, GATED, UNGATED, NO_FLOOR, OLDLINE),
                    help=f"the arms (each with overflow.prefill_gate auto, the default: on for this CPU engine, but "
                    f"{LOCAL_ONLY!r}: off; {GATED!r} / {UNGATED!r}: predictive with it on / off; {NO_FLOOR!r}: "
                    f"predictive with overflow.miss_floor 0, the others with its default; {OLDLINE!r}: predictive "
                    f"with gated requests priced on the prefill line)")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds of trace, one round, answers of at most 16 tokens: the harness works")
    ap.add_argument("--dataset-out", type=Path, help="JSON lines: the requests kept local, for estimator_loto.py")
    ap.add_argument("--url", default=None, help="use this running fleet (one started with --serve-only)")
    ap.add_argument("--admin-key", default=ADMIN, help="with --url: the fleet's admin key")
    ap.add_argument("--api-key", default="", help="with --url: an API key of the fleet (none: no auth)")
    ap.add_argument("--serve-only", action="store_true", help="start the fleet, print its URL, run until Ctrl-C")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--shape", choices=SHAPES, default="gamma",
                      help="a synthetic load shape (lmfleet.bench.shapes; gamma: lmfleet.bench.trace's bursts)")
    what.add_argument("--trace", default=None, metavar="azure[:PATH][:OPTION=VALUE...]",
                      help="replay a trace in the Azure format (lmfleet.bench.replay): options start=S, duration=D "
                      "or requests=N (default 250; --smoke 12), load=X (x the measured capacity; default 1.3), "
                      "rate=R or speed=S, tokens=F (default 1); PATH defaults to ../shared/traces/"
                      "AzureLLMInferenceTrace_code.csv beside the checkout")
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="the engine's context; replayed token counts are capped to it (less a margin)")
    ap.add_argument("--litellm", action="store_true",
                    help="add the real LiteLLM proxy (`make litellm`) as arms, routed to the same Serve endpoint "
                    "with fallbacks to the same provider")
    ap.add_argument("--litellm-timeouts-ms", type=lambda v: [float(x) for x in v.split(",")], default=None,
                    help="LiteLLM's stream_timeout per arm, comma-separated (default: the threshold and 0.6x it)")
    ap.add_argument("--serve-url", default=None,
                    help="with --url --litellm: the model's base URL behind Serve (http://HOST:SERVE_PORT/smollm2/v1)")
    ap.add_argument("--provider-url", default=None,
                    help="with --url: the provider's base URL (http://HOST:PORT/v1) and model smollm2-remote, for "
                    "--litellm and the oracle plan arm")
    args = ap.parse_args()
    if args.smoke:
        args.duration, args.rounds = 5, 1
    if args.litellm_timeouts_ms is None:
        args.litellm_timeouts_ms = [args.threshold_ms, round(0.6 * args.threshold_ms)]
    try:  # before the fleet starts: a wrong --trace or a missing LiteLLM fails in a second, not after minutes
        workload(args, None)
        if args.litellm:
            litellm_bin(REPO)
    except (BenchInputError, FileNotFoundError) as e:
        ap.error(str(e))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"load at start: {load()}", flush=True)
    # SIGINT too: a shell that starts this in the background (no job control) leaves SIGINT ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the finallys below end what was started
        signal.signal(sig, interrupted)
    if args.url:
        KEYS.update(admin=args.admin_key, api=args.api_key)
        if args.litellm and not (args.serve_url and args.provider_url):
            ap.error("--url with --litellm needs --serve-url and --provider-url")
        before = admin(args.url, "GET", "/admin/state")["models"][MODEL]
        proxy = None
        try:
            proxy, arms = start_litellm(args, args.serve_url, args.provider_url, dict(os.environ)) if args.litellm \
                else (None, {})
            run(args, args.url, arms, Endpoint(args.provider_url.removesuffix("/v1"), "smollm2-remote",
                                               os.environ.get("BENCH_PROVIDER_KEY", ""),
                                               served_by="provider/oracle-plan") if args.provider_url else None)
        finally:  # the fleet as it was (the policy: predictive, the default), the proxy stopped
            if proxy is not None:
                proxy.stop()
            admin(args.url, "POST", "/admin/overflow", {"model": MODEL, "mode": before["mode"],
                                                        "threshold_ms": before["threshold_ms"],
                                                        "policy": "predictive",
                                                        "prefill_gate": before.get("prefill_gate_setting", "auto"),
                                                        "gate_line": before.get("gate_line", True)})
        return
    pport, gport, sport = free_port(), free_port(), free_port()
    fleet = out / "fleet.yaml"
    batched = f", max_num_batched_tokens: {args.max_num_batched_tokens}" if args.max_num_batched_tokens else ""
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
    engine: {{max_model_len: {args.max_model_len}, cpu_kvcache_space_gib: 1, max_num_seqs: {args.max_num_seqs}{batched}}}
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
    proxy = None
    try:
        t_start = time.monotonic()
        wait_ready(f"{url}/ready", 1800, procs)
        print(f"fleet ready after {time.monotonic() - t_start:.0f} s at {url}", flush=True)
        if args.serve_only:
            while True:
                signal.pause()
        else:
            proxy, arms = start_litellm(args, f"http://127.0.0.1:{sport}/{MODEL}/v1", f"http://127.0.0.1:{pport}/v1",
                                        env) if args.litellm else (None, {})
            run(args, url, arms, Endpoint(f"http://127.0.0.1:{pport}", "smollm2-remote", PKEY,
                                          served_by="provider/oracle-plan"))
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}): stopping the fleet", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal does not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        if proxy is not None:
            proxy.stop()
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


def start_litellm(args: argparse.Namespace, serve_base: str, provider_base: str,
                  env: dict) -> tuple[LiteLLMProxy, dict[str, Endpoint]]:
    """The real LiteLLM proxy, one model group per ``--litellm-timeouts-ms``, at the client's and the provider's CPU
    treatment (it stands for a node of its own); the arms' endpoints by name. The caller stops it."""
    cfg = litellm_config(MODEL, serve_base, provider_base, "smollm2-remote", "BENCH_PROVIDER_KEY",
                         [t / 1000 for t in args.litellm_timeouts_ms])
    key = f"sk-litellm-{random.randrange(1 << 60):x}"
    proxy = LiteLLMProxy(litellm_bin(REPO), cfg, free_port(), key, args.out / "litellm",
                         {**env, "BENCH_PROVIDER_KEY": env.get("BENCH_PROVIDER_KEY", PKEY)})
    try:
        took = proxy.start()
    except BaseException:
        proxy.stop()
        raise
    print(f"LiteLLM proxy {proxy.version()} ready after {took:.0f} s at {proxy.base_url} (pid "
          f"{proxy.proc.pid}): {autogroup_nice(proxy.proc.pid, args.outside_nice)}", flush=True)
    return proxy, {f"litellm {t:.0f}ms": Endpoint(proxy.base_url, arm_model(MODEL, t / 1000), key, provider_base)
                   for t in args.litellm_timeouts_ms}


def workload(args: argparse.Namespace, capacity_rps: float | None) -> tuple[list[TraceRequest], dict]:
    """The trace to replay (``--shape`` or ``--trace``) at ``capacity_rps`` and its description for the report;
    with ``capacity_rps`` None, the same requests unpaced (for measuring the capacity on their mix)."""
    if args.trace is None:
        trace, shape = shape_trace(args.shape, capacity_rps or 1.0, args.duration, args.seed + (capacity_rps is None),
                                   short=args.smoke)
        return trace, {"kind": "shape", "describe": shape.describe(), **asdict(shape)}
    spec = parse_replay(args.trace, default_path=DEFAULT_TRACE)
    if spec.duration_s is None and spec.requests is None:
        spec = replace(spec, requests=12 if args.smoke else 250)
    if spec.load is None and spec.rate_rps is None and spec.speed is None:
        spec = replace(spec, load=1.3)
    if capacity_rps is None:
        spec = replace(spec, load=None, speed=1.0)
    if spec.path not in TRACES:
        TRACES[spec.path] = read_trace_file(spec.path)
    r = replay_trace(spec, TRACES[spec.path], capacity_rps=capacity_rps,
                     max_model_len=args.max_model_len - CONTEXT_MARGIN)
    return r.requests, {"kind": "trace", "describe": r.describe(), **r.header()}


TRACES: dict[Path, list] = {}  # each trace file read once
SMOKE_OUTPUT_TOKENS = 16


def spill_plan(trace: list[TraceRequest], spilled: tuple[int, ...], provider: Endpoint) -> dict[int, Endpoint]:
    """The oracle's spill set (positions in ``trace``) as :func:`replay`'s ``to``: request index -> provider."""
    return {trace[i].index: provider for i in spilled}


def run(args: argparse.Namespace, url: str, litellm: dict[str, Endpoint] | None = None,
        provider: Endpoint | None = None) -> None:
    """Calibrate, replay the trace per policy (and LiteLLM arm, and with ``provider`` the oracle's plan) and round,
    and report (module docstring)."""
    out: Path = args.out
    slo_s = args.threshold_ms / 1000
    price = ProviderPrice(input_per_1m=args.price_in, output_per_1m=args.price_out)
    gateway = Endpoint(url, MODEL, KEYS["api"])
    litellm = litellm or {}
    cal, _ = workload(args, None)
    set_policy(url, LOCAL_ONLY, args.threshold_ms, args.hedge_after_ms, args.ttft_timeout_ms)
    cap = args.capacity_rps
    if cap is None:
        # a fresh CPU engine answers its first minute or two of load 2-3x slower: measured then, the capacity
        # is too low and the trace too light for the warm engine
        asyncio.run(closed_loop(gateway, cal, args.max_num_seqs, 2 if args.smoke else args.warmup_s, args.seed, True))
        cap = asyncio.run(closed_loop(gateway, cal, args.max_num_seqs, 5 if args.smoke else 30, args.seed, True))
    trace, info = workload(args, cap)
    if args.smoke:  # seconds per arm: the harness is what a smoke run checks, not the engine's decoding
        trace = [replace(r, output_tokens=min(r.output_tokens, SMOKE_OUTPUT_TOKENS)) for r in trace]
    print(f"capacity {cap:.2f} req/s; {len(trace)} requests over {trace[-1].arrival_s if trace else 0:.0f} s, seed "
          f"{args.seed}; " + "\n".join(header_lines(info)), flush=True)
    if not args.smoke:
        # the engine's first bursts of simultaneous prefills run several times slower than later ones (the first
        # policy replayed would pay for it): one replay of the trace, local only and not counted, first
        t = time.monotonic()
        asyncio.run(replay(gateway, trace, args.seed, ignore_eos=True, salt=0))
        print(f"warm-up replay of the trace (local only, not counted): {time.monotonic() - t:.0f} s", flush=True)
    # the oracle's plan needs a local only round first: last in round 1, first in the reversed round 2
    plan_arm = [ORACLE_PLAN] if provider is not None and LOCAL_ONLY in args.policies else []
    arms = [*args.policies, *litellm, *plan_arm]
    plan: dict[int, Endpoint] | None = None
    plan_usd = None
    runs: dict[str, list[Outcome]] = {p: [] for p in arms}
    rounds_of: dict[str, list[list[Outcome]]] = {p: [] for p in arms}  # per round: sent_s restarts at 0
    spend: dict[str, float] = {p: 0.0 for p in arms}
    estimates: dict[str, list[dict]] = {p: [] for p in args.policies}
    salt = 0  # one per replay: fresh prompt text every time (prompt_text)
    for rnd in range(args.rounds):
        order = list(arms) if rnd % 2 == 0 else list(reversed(arms))
        for name in order:
            if name == ORACLE_PLAN and plan is None:
                try:
                    fitted = local_model(rounds_of, args.policies, args.max_num_seqs)
                except ValueError as e:
                    print(f"oracle plan: not replayed ({e})", flush=True)
                    arms.remove(ORACLE_PLAN)
                    continue
                spilled = oracle_spill(trace, fitted, args.threshold_ms, price)
                plan, plan_usd = spill_plan(trace, spilled.spilled, provider), spilled.spend_nusd / 1e9
            # LiteLLM reaches the engine on Serve's port, past the gateway: the gateway keeps it to itself; the
            # oracle's plan sends its spills straight to the provider and the rest through the gateway, local only
            set_policy(url, LOCAL_ONLY if name in litellm or name == ORACLE_PLAN else name, args.threshold_ms,
                       args.hedge_after_ms, args.ttft_timeout_ms)
            time.sleep(1 if args.smoke else 3)  # the previous arm's last streams end
            if (waited := wait_engines_idle(url, 0 if args.smoke else 300)) >= 1:
                print(f"before {name}: waited {waited:.0f} s for the engines to finish earlier requests", flush=True)
            since = time.time()
            salt += 1
            res = asyncio.run(replay(litellm.get(name, gateway), trace, args.seed, ignore_eos=True, salt=salt,
                                     to=plan if name == ORACLE_PLAN else None))
            if name in litellm or name == ORACLE_PLAN:  # not in the ledger: the provider's bill from its usage
                spend[name] += provider_bill_usd(res, price)
            else:
                time.sleep(1 if args.smoke else 2)  # the last ledger rows
                until = time.time()
                spend[name] += provider_spend_usd(url, since - 1, until)
                e, rows = estimate_error_of(url, since - 1, until, args.dataset_out is not None)
                append_rows(args.dataset_out, dataset_rows(rows, args.trace or args.shape, name, rnd + 1))
                if e is not None:
                    estimates[name].append({"round": rnd + 1, **e})
            runs[name] += res
            rounds_of[name].append(res)
            r = summarize(res, slo_s, 0.0)
            print(f"round {rnd + 1} {name:12s} SLO {r['slo_attainment']:.1%}  TTFT p50/p99 "
                  f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms  external {r['external_share']:.0%}  "
                  f"errors {r['errors']}", flush=True)
    results = {name: summarize(runs[name], slo_s, spend[name]) for name in arms}
    oracle = None
    if LOCAL_ONLY in runs:
        try:
            model = local_model(rounds_of, args.policies, args.max_num_seqs)
            res = oracle_spill(trace, model, args.threshold_ms, price)
            oracle = {"model": asdict(model), "spilled": len(res.spilled), "of": len(trace),
                      "spend_usd": res.spend_nusd / 1e9 * args.rounds}
        except ValueError as e:
            print(f"oracle: not computed ({e})", flush=True)
    if oracle is not None and plan is not None:
        oracle["plan"] = {"spilled": len(plan), "modelled_spend_usd": plan_usd * args.rounds,
                          "replayed_slo_attainment": results[ORACLE_PLAN]["slo_attainment"],
                          "replayed_spend_usd": results[ORACLE_PLAN]["spend_usd"]}
    print(f"\nload at end: {load()}")
    print("\n" + "\n".join(header_lines(info)))
    print(f"\nthreshold {args.threshold_ms:.0f} ms, hedge_after {args.hedge_after_ms:.0f} ms, ttft_timeout "
          f"{args.ttft_timeout_ms:.0f} ms, miss_quantile {args.miss_quantile}, miss_floor {FLOOR} "
          f"(predictive no floor: 0), {args.rounds} round(s), "
          f"provider $ {args.price_in}/{args.price_out} per 1M in/out, engine max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens or 'vLLM default'}\n")
    print(table(results, oracle["spend_usd"] if oracle else None))
    for name, ep in litellm.items():
        print(f"{name}: the real LiteLLM proxy (stream_timeout {ep.model.rsplit('-', 1)[-1]}, fallbacks to the "
              "same provider, num_retries 0), straight to Serve's endpoint; spend from the provider's usage")
    same = next((n for n in litellm if n == f"litellm {args.ttft_timeout_ms:.0f}ms"), None)
    if same and "ttft_timeout" in results:
        a, b = results["ttft_timeout"], results[same]
        print(f"lmfleet ttft_timeout vs LiteLLM at the same {args.ttft_timeout_ms:.0f} ms: SLO "
              f"{a['slo_attainment']:.1%} vs {b['slo_attainment']:.1%}, TTFT P99 {a['ttft_p99_ms']:.0f} vs "
              f"{b['ttft_p99_ms']:.0f} ms, errors {a['errors']} vs {b['errors']}")
    if oracle:
        print(f"\noracle: spills {oracle['spilled']} of {oracle['of']} requests per round, "
              f"${oracle['spend_usd']:.5f} over {args.rounds} round(s); local model {oracle['model']}")
        if "plan" in oracle:
            p = oracle["plan"]
            verdict = "" if p["replayed_slo_attainment"] >= 0.99 else (
                " -- below the SLO: the local model is optimistic, the oracle's $ is too low")
            print(f"oracle plan: round 1's fit spills {p['spilled']} requests (modelled "
                  f"${p['modelled_spend_usd']:.5f}); replayed: SLO {p['replayed_slo_attainment']:.1%}, "
                  f"${p['replayed_spend_usd']:.5f}{verdict}")
    print("\nestimate (streamed requests kept local, from the ledger: predicted vs realised wait):")
    pooled = {name: pooled_estimate(runs[name], args.threshold_ms) for name in args.policies}
    for name, per_round in estimates.items():
        for e in per_round:
            print(estimate_line(name, f"round {e['round']}", e))
        if pooled[name] is not None:
            print(estimate_line(name, f"rounds 1-{args.rounds} pooled (client's TTFT)", pooled[name]))
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "capacity_rps": cap,
               "trace": info, "requests_per_round": len(trace), "seed": args.seed,
               "threshold_ms": args.threshold_ms, "hedge_after_ms": args.hedge_after_ms,
               "ttft_timeout_ms": args.ttft_timeout_ms, "miss_quantile": args.miss_quantile, "miss_floor": FLOOR,
               "rounds": args.rounds,
               "price": {"input_per_1m": args.price_in, "output_per_1m": args.price_out},
               "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, "results": results,
               "outside_nice": args.outside_nice, "oracle": oracle, "estimate": estimates,
               "estimate_pooled_client": pooled,
               "litellm": {name: {"model": ep.model, "url": ep.url} for name, ep in litellm.items()} or None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "outcomes.jsonl").write_text("".join(
        json.dumps({"policy": k, "round": n + 1, **asdict(o)}) + "\n"
        for k, rounds in rounds_of.items() for n, v in enumerate(rounds) for o in v))


if __name__ == "__main__":
    main()

"""What relaying a stream costs the gateway: direct vs through lmfleet, on a fake engine that costs ~nothing.

Paths, measured in one run with rounds alternated (medians reported):

    direct     client -> fast fake OpenAI server (lmfleet/testing/fast_openai_server.py)
    provider   client -> gateway -> the fake as an external provider (overflow forced on)
    local      client -> gateway -> the fake standing in for Ray Serve (overflow forced off)

Each gateway path is run once per uvicorn variant (``--variants``, loop:http pairs), each variant in
its own gateway process so that psutil can charge it its CPU. ``--tree-b REF_OR_PATH`` runs a second
source tree beside this one (tree A): a path is used as is, a git ref is checked out with ``git worktree
add`` into a temporary folder and removed at the end (``--tree-c``: a third, alike). Each tree's gateway
is its own process, started by that tree's own ``benchmarks/bench_relay.py`` with ``PYTHONPATH=<tree>/src``;
within a round the trees alternate on each path (A, B, then B, A in the next round); the client and the
fake are tree A's. Load: ``--concurrency`` clients (keep-alive connections, one request in flight each)
streaming ``--max-tokens``-token chat completions for ``--duration`` seconds per phase, then one client
for ``--ttft-duration`` seconds for the TTFT at rest. ``%direct`` is the ratio of the medians;
``%dir/rd`` the median of each round's ratio to that round's direct phase (steadier when others' work on
the machine drifts between rounds; the targets read it).
Targets (issue 47): gateway >= 75 % of direct req/s at 64 concurrent 32-token streams (httpx client),
and <= 1 ms added P50 TTFT (one client).

    .venv/bin/python benchmarks/bench_relay.py --rounds 3 --duration 10
    .venv/bin/python benchmarks/bench_relay.py --client httpx --rounds 2 --duration 8 --tree-b 7963f4a
    ... --profile out/relay.prof   # cProfile the first variant's gateway of each tree (slows it: a separate run)

The load generator is raw asyncio (a Protocol per connection, no HTTP library) so that it stays cheaper
than what it measures; its CPU, the fake's and the gateway's are printed beside the figures (2-core
machine: the three share it, so read "cores" columns before trusting a ratio). Because the client is
this light, "direct" with ``--itl-ms 0`` runs at thousands of req/s (an httpx client gets ~660): the
%direct column is against this client, and with ``--itl-ms 0`` it measures per-request overhead only.
``--client openai`` drives the same load through the official client (what applications send with; ~11 ms of
client CPU per 32-token stream here, so the client bounds "direct" and %direct only says whether the gateway
slows such a user down).
``--itl-ms 1`` makes the fake stream token by token, closer to an engine. The header prints the
machine's load average before and after: other work on the machine moves every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lmfleet.net import free_port
from lmfleet.testing.relay_load import LOADERS, PhaseResult, http_json, make_gateway_app, measure, pct

ADMIN_ENV = "LMFLEET_BENCH_ADMIN_KEY"
HERE = Path(__file__).resolve()
TREE_A = HERE.parents[1]


# ---------------------------------------------------------------------------------------------
# the source trees under test
# ---------------------------------------------------------------------------------------------
@dataclass
class Tree:
    """A source tree whose gateway is measured: ``root/src`` on the child's PYTHONPATH, ``root/benchmarks/
    bench_relay.py`` its entry (so that each tree assembles its gateway with its own code)."""

    label: str
    root: Path
    spec: str
    worktree: bool = False  # checked out by this run: removed at the end

    @property
    def entry(self) -> Path:
        return self.root / "benchmarks" / "bench_relay.py"


def open_tree(label: str, spec: str, tmp: Path) -> Tree:
    """A path as is, else a git ref of this repository checked out (detached) into ``tmp``."""
    path = Path(spec).expanduser()
    if path.is_dir():
        tree = Tree(label, path.resolve(), spec)
    else:
        dest = tmp / f"tree-{label}"
        r = subprocess.run(["git", "-C", str(TREE_A), "worktree", "add", "--detach", "--quiet", str(dest), spec],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"--tree-{label.lower()} {spec!r} is neither a folder nor a git ref of {TREE_A}: "
                             f"{r.stderr.strip()}")
        tree = Tree(label, dest, spec, worktree=True)
    if not (tree.root / "src" / "lmfleet").is_dir() or "--serve-gateway" not in tree.entry.read_text():
        close_tree(tree)
        raise SystemExit(f"tree {label} ({spec}) has no src/lmfleet or no benchmarks/bench_relay.py --serve-gateway")
    return tree


def close_tree(tree: Tree) -> None:
    if tree.worktree:
        r = subprocess.run(["git", "-C", str(TREE_A), "worktree", "remove", "--force", str(tree.root)],
                           capture_output=True)
        if r.returncode != 0:  # its folder went some other way: drop what git still records of it
            shutil.rmtree(tree.root, ignore_errors=True)
            subprocess.run(["git", "-C", str(TREE_A), "worktree", "prune"], capture_output=True)


def describe(tree: Tree) -> str:
    r = subprocess.run(["git", "-C", str(tree.root), "log", "-1", "--format=%h %cs"], capture_output=True, text=True)
    head = r.stdout.strip()[:70] if r.returncode == 0 else "not a git tree"
    dirty = subprocess.run(["git", "-C", str(tree.root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"{tree.label} = {tree.spec}: {tree.root} ({head}{', with uncommitted changes' if dirty else ''})"


# ---------------------------------------------------------------------------------------------
# the gateway under test (its own process)
# ---------------------------------------------------------------------------------------------

def write_fleet(folder: Path, port: int, fake_url: str) -> Path:
    fleet = {
        "gateway": {"host": "127.0.0.1", "port": port, "admin_key_env": ADMIN_ENV, "health_poll_s": 60,
                    "engine_metrics_poll_s": 0},
        "models": [{"name": "m", "source": "builtin:tiny-random", "deployment": {"max_ongoing_requests": 1024}}],
        "providers": [{"name": "fake", "base_url": f"{fake_url}/v1", "model_map": {"m": "fake-model"},
                       "max_retries": 0}],
        "ledger": {"path": str(folder / f"ledger-{port}.sqlite")},
    }
    path = folder / f"fleet-{port}.yaml"
    path.write_text(json.dumps(fleet, indent=2))  # JSON is YAML
    return path


def serve_gateway(config: str, fake_url: str, loop: str, http: str, profile_out: str | None) -> None:
    """Child-process entry: run the gateway until SIGINT/SIGTERM."""
    import cProfile

    import uvicorn

    from lmfleet.config import load_config

    from lmfleet.gateway.front.server import quiet_gc, uvicorn_options

    fleet = load_config(config)
    app = make_gateway_app(fleet, fake_url)
    quiet_gc()  # as `lmfleet serve` does
    # "lmfleet": the HTTP protocol and limits `lmfleet serve` runs with (uvicorn's httptools protocol, guarded)
    opts = uvicorn_options(fleet.gateway) if http == "lmfleet" else {"http": http}
    server = uvicorn.Server(uvicorn.Config(app, host=fleet.gateway.host, port=fleet.gateway.port, loop=loop,
                                           log_level="warning", access_log=False, lifespan="on", **opts))
    prof = cProfile.Profile(time.process_time) if profile_out else None  # CPU time: others share the machine
    if prof:
        prof.enable()
    try:
        server.run()
    finally:
        if prof:
            prof.disable()
            prof.dump_stats(profile_out)


@dataclass
class Gateway:
    variant: str
    tree: Tree
    url: str
    proc: subprocess.Popen
    ps: psutil.Process = field(init=False)

    def __post_init__(self) -> None:
        self.ps = psutil.Process(self.proc.pid)


def start_gateway(folder: Path, fake_url: str, variant: str, tree: Tree, admin_key: str,
                  profile_out: str | None) -> Gateway:
    loop, http = variant.split(":")
    # the tree's sources only: none of tree A's may shadow tree B's
    env = {**os.environ, ADMIN_ENV: admin_key, "PYTHONPATH": str(tree.root / "src")}
    port = free_port("127.0.0.1")
    cfg = write_fleet(folder, port, fake_url)
    argv = [sys.executable, str(tree.entry), "--serve-gateway", str(cfg), "--fake-url", fake_url, "--loop", loop,
            "--http", http]
    if profile_out:
        argv += ["--profile-out", profile_out]
    log = open(folder / f"gateway-{port}.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    gw = Gateway(variant, tree, f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"gateway {variant} exited with {proc.returncode}; its log ends:\n{tail}")
        with contextlib.suppress(OSError):
            if http_json("GET", f"{gw.url}/health")[0] == 200:
                return gw
        time.sleep(0.2)
    stop_process(proc)
    raise TimeoutError(f"gateway {variant} did not answer /health within 120 s:\n"
                       f"{Path(log.name).read_text(errors='replace')[-3000:]}")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def summarise(rs: list[PhaseResult], gateway: bool) -> dict[str, float]:
    def med(f):
        return statistics.median(f(r) for r in rs)

    out = {
        "req_s": med(lambda r: r.requests / r.wall_s),
        "events_s": med(lambda r: r.events / r.wall_s),
        "tokens_s": med(lambda r: r.tokens / r.wall_s),
        "ttft_p50_ms": med(lambda r: pct(r.ttfts, 0.5) * 1000),
        "ttft_p99_ms": med(lambda r: pct(r.ttfts, 0.99) * 1000),
        "errors": sum(r.errors for r in rs),
        "client_cores": med(lambda r: r.cpu["client"] / r.wall_s),
        "fake_cores": med(lambda r: r.cpu["fake"] / r.wall_s),
    }
    if gateway:
        out["gateway_cores"] = med(lambda r: r.cpu["gateway"] / r.wall_s)
        out["events_per_gw_cpu_s"] = med(lambda r: r.events / max(r.cpu["gateway"], 1e-9))
        out["gw_cpu_ms_per_1k_tokens"] = med(lambda r: r.cpu["gateway"] * 1000 / max(r.tokens, 1) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase at --concurrency")
    ap.add_argument("--ttft-duration", type=float, default=3.0, help="seconds per phase at 1 client (0: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="the fake engine's time to first token")
    ap.add_argument("--itl-ms", type=float, default=0.0, help="the fake engine's inter-token latency")
    ap.add_argument("--fake-dialect", help="the fake answers as this provider (e.g. openai: every event names its "
                                           "model, so the provider path puts the client's name back in each)")
    ap.add_argument("--variants", default="uvloop:lmfleet",
                    help="uvicorn loop:http pairs, one gateway process each; http \"lmfleet\" is what lmfleet serve runs "
                         "(httptools behind gateway/front/server.py guarded_protocol)")
    ap.add_argument("--paths", default="provider,local", help="gateway paths to measure (direct always runs)")
    ap.add_argument("--fleet-tokens-s", type=float, default=50_000.0, help="fleet output rate to size gateways for")
    ap.add_argument("--profile", type=Path, help="cProfile the first variant's gateway into this file (tree B's "
                                                  "into the same name with -B before the suffix)")
    ap.add_argument("--tree-b", metavar="REF_OR_PATH",
                    help="a second source tree measured beside this one: a folder, or a git ref of this repository "
                         "(checked out into a temporary worktree, removed at the end)")
    ap.add_argument("--tree-c", metavar="REF_OR_PATH", help="a third source tree, as --tree-b (needs --tree-b)")
    ap.add_argument("--target-pct", type=float, default=75.0, help="the req/s target, in %% of direct")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds, tiny sizes: checks that the benchmark runs, measures nothing")
    ap.add_argument("--client", choices=sorted(LOADERS), default="raw",
                    help="load generator: raw asyncio (cheapest; measures the relay's own ceiling), the official "
                         "openai client (what applications send with; it bounds 'direct' at this machine's 2 cores), "
                         "or a plain httpx / aiohttp client (the issue's first figures used httpx)")
    # child-process mode
    ap.add_argument("--serve-gateway", help=argparse.SUPPRESS)
    ap.add_argument("--fake-url", help=argparse.SUPPRESS)
    ap.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    ap.add_argument("--http", default="h11", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_gateway:
        serve_gateway(args.serve_gateway, args.fake_url, args.loop, args.http, args.profile_out)
        return
    if args.smoke:
        args.duration, args.ttft_duration, args.rounds, args.concurrency, args.paths = 0.5, 0.3, 1, 4, "local"
        args.tree_b = args.tree_b or str(TREE_A)  # the two-tree path too: this tree against itself

    from lmfleet.testing.fast_openai_server import FastServer

    args.load_before = ", ".join(f"{x:.1f}" for x in os.getloadavg())  # others' work shares the machine
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    admin_key = "bench-admin"
    fake_args = ["--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms), "--max-tokens", str(args.max_tokens)]
    if args.fake_dialect:
        fake_args += ["--dialect", args.fake_dialect]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-relay-")))
        trees = [Tree("A", TREE_A, "this tree")]
        if args.tree_c and not args.tree_b:
            raise SystemExit("--tree-c needs --tree-b")
        for label, spec in (("B", args.tree_b), ("C", args.tree_c)):
            if spec:
                trees.append(open_tree(label, spec, tmp))
                stack.callback(close_tree, trees[-1])
        args.trees = [describe(t) for t in trees]
        for line in args.trees:
            print(line, flush=True)
        fake = stack.enter_context(FastServer(*fake_args))
        fake_ps = psutil.Process(fake.proc.pid)
        gateways: list[Gateway] = []
        stack.callback(lambda: [stop_process(gw.proc) for gw in gateways])
        for i, v in enumerate(variants):
            for tree in trees:
                prof = profile_path(args.profile, tree) if args.profile and i == 0 else None
                gateways.append(start_gateway(tmp, fake.base_url, v, tree, admin_key, prof))
        # phases: (name, url, model, overflow mode, gateway); the trees side by side on each path
        phases = [("direct", fake.base_url, "fake-model", None, None)]
        for p in paths:
            for gw in gateways:
                label = f" {gw.tree.label}" if len(trees) > 1 else ""
                phases.append((f"{p}{label} [{gw.variant}]", gw.url, "m",
                               "force_on" if p == "provider" else "force_off", gw))
        results: dict[str, dict[int, list[PhaseResult]]] = {name: {} for name, *_ in phases}
        conc_levels = [args.concurrency] + ([1] if args.ttft_duration > 0 else [])
        for name, url, model, mode, gw in phases:  # warm every path once (connections, imports, caches)
            if mode:
                http_json("POST", f"{gw.url}/admin/overflow", {"model": "m", "mode": mode}, admin_key)
            measure(url, model, args.concurrency, 1.0, args.max_tokens, {"fake": fake_ps}, args.client)
        for r in range(args.rounds):
            order = phases if r % 2 == 0 else phases[::-1]  # alternate so that drift hits every path alike
            for name, url, model, mode, gw in order:
                if mode:
                    code, body = http_json("POST", f"{gw.url}/admin/overflow", {"model": "m", "mode": mode},
                                           admin_key)
                    if code != 200:
                        raise RuntimeError(f"/admin/overflow answered {code}: {body}")
                procs = {"fake": fake_ps, **({"gateway": gw.ps} if gw else {})}
                for c in conc_levels:
                    dur = args.duration if c == args.concurrency else args.ttft_duration
                    res = measure(url, model, c, dur, args.max_tokens, procs, args.client)
                    results[name].setdefault(c, []).append(res)
                    print(f"round {r + 1} {name:28s} c={c:<3d} {res.requests / res.wall_s:8.1f} req/s "
                          f"P50 TTFT {pct(res.ttfts, 0.5) * 1000:6.2f} ms  errors {res.errors}", flush=True)
        for gw in gateways:  # before the report: a profile is written when its gateway stops
            stop_process(gw.proc)
    report(args, results, phases)


def profile_path(base: Path, tree: Tree) -> str:
    base = base.resolve()
    return str(base if tree.label == "A" else base.with_name(f"{base.stem}-{tree.label}{base.suffix}"))


def report(args, results, phases) -> None:
    c = args.concurrency
    rows = {name: summarise(results[name][c], gateway=gw is not None) for name, _, _, _, gw in phases}
    ttft1 = {name: statistics.median(pct(r.ttfts, 0.5) * 1000 for r in results[name][1])
             for name, *_ in phases if 1 in results[name]}
    direct = rows["direct"]
    # each phase against the direct phase of its own round, then the median: drift between rounds (others' work
    # on the machine) cancels out of the ratio
    per_round = {name: statistics.median(g.requests / g.wall_s / max(d.requests / d.wall_s, 1e-9)
                                         for g, d in zip(results[name][c], results["direct"][c]))
                 for name, *_ in phases}
    cpu = os.cpu_count()
    print()
    print(f"# bench_relay  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {cpu} cores  "
          f"{args.rounds} rounds x {args.duration:g} s  {args.client} client  {c} concurrent {args.max_tokens}-token chat streams  "
          f"fake TTFT {args.ttft_ms:g} ms ITL {args.itl_ms:g} ms  load average {args.load_before} -> "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for line in args.trees:
        print(f"#   {line}")
    head = (f"{'path':28s} {'req/s':>7s} {'%direct':>7s} {'%dir/rd':>7s} {'events/s':>9s} {'P50 TTFT':>9s} {'P99 TTFT':>9s} "
            f"{'1-cl P50':>9s} {'+P50':>6s} {'gw cores':>8s} {'ev/gwCPUs':>9s} {'gw ms/1k tok':>12s} "
            f"{'fake cores':>10s} {'client cores':>12s} {'errs':>4s}")
    print(head)
    print("-" * len(head))
    for name, *_ in phases:
        s = rows[name]
        t1 = ttft1.get(name, float("nan"))
        added = t1 - ttft1.get("direct", float("nan"))
        gw = "gateway_cores" in s
        cols = ((f"{added:+5.2f}", f"{s.get('gateway_cores', 0):.2f}", f"{s.get('events_per_gw_cpu_s', 0):.0f}",
                 f"{s.get('gw_cpu_ms_per_1k_tokens', 0):.1f}") if gw else ("-", "-", "-", "-"))
        print(f"{name:28s} {s['req_s']:7.1f} {100 * s['req_s'] / direct['req_s']:6.1f}% "
              f"{100 * per_round[name]:6.1f}% {s['events_s']:9.0f} "
              f"{s['ttft_p50_ms']:7.2f}ms {s['ttft_p99_ms']:7.2f}ms {t1:7.2f}ms {cols[0]:>6s} {cols[1]:>8s} "
              f"{cols[2]:>9s} {cols[3]:>12s} {s['fake_cores']:10.2f} {s['client_cores']:12.2f} {s['errors']:4d}")
    print()
    for name, *_ in phases:
        s = rows[name]
        if "gateway_cores" not in s:
            continue
        cores = args.fleet_tokens_s * s["gw_cpu_ms_per_1k_tokens"] / 1000 / 1000
        t1 = ttft1.get(name, float("nan")) - ttft1.get("direct", float("nan"))
        ok_rate = per_round[name] >= args.target_pct / 100
        ok_ttft = t1 <= 1.0
        print(f"{name:28s} {args.fleet_tokens_s:,.0f} tok/s fleet needs {cores:5.1f} gateway cores;  "
              f"targets: >={args.target_pct:g}% direct req/s (per round) {'MET' if ok_rate else 'MISSED'}, "
              f"<=1 ms added P50 TTFT {'MET' if ok_ttft else 'MISSED'}")
    compare_trees(rows, ttft1, phases)
    if direct["client_cores"] > 0.85:
        print(f"note: the load generator used {direct['client_cores']:.2f} cores on the direct path: "
              "direct req/s is a lower bound (the client, not the fake, may be the limit)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "at_concurrency": rows,
                                        "ttft_p50_ms_1_client": ttft1}, indent=2))
    if args.profile:
        import pstats

        for gw in {gw.tree.label: gw for *_, gw in phases if gw}.values():
            path = Path(profile_path(args.profile, gw.tree))
            if path.exists():
                print(f"\n# gateway profile, tree {gw.tree.label} [{gw.variant}], top 25 by own time: {path}")
                pstats.Stats(str(path)).sort_stats("tottime").print_stats(25)


def compare_trees(rows: dict, ttft1: dict, phases: list) -> None:
    """Each other tree against tree A on each path and variant: req/s ratio, the difference in 1-client P50
    TTFT and the ratio of gateway CPU per token."""
    by_key: dict[tuple[str, str], dict[str, str]] = {}
    for name, *_, gw in phases:
        if gw:
            by_key.setdefault((name.split(" ")[0], gw.variant), {})[gw.tree.label] = name
    lines = []
    for (path, variant), names in by_key.items():
        for other in sorted(names.keys() - {"A"}):
            a, b = rows[names["A"]], rows[names[other]]
            dt = ttft1.get(names["A"], float("nan")) - ttft1.get(names[other], float("nan"))
            lines.append(f"{path} [{variant}]: A/{other} req/s {a['req_s'] / b['req_s']:.3f}, A's 1-client P50 TTFT "
                         f"{dt:+.2f} ms against {other}'s, gateway CPU per 1k tokens A/{other} "
                         f"{a['gw_cpu_ms_per_1k_tokens'] / max(b['gw_cpu_ms_per_1k_tokens'], 1e-9):.3f}")
    if lines:
        print()
        print("\n".join(lines))


if __name__ == "__main__":
    main()

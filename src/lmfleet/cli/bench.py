"""``lmfleet bench``: load-test any OpenAI-compatible endpoint (see docs/bench.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from lmfleet.bench.cost import parse_price
from lmfleet.bench.loadgen import LoadPlan
from lmfleet.bench.metrics import SLO
from lmfleet.bench.replay import parse_replay
from lmfleet.bench.report import check_consistency, render_tables
from lmfleet.bench.runner import BenchSpec, plan_trace, prepare, run_benchmark, write_outputs
from lmfleet.bench.sweep import parse_values, plan_for, run_sweep, set_overflow, write_sweep
from lmfleet.bench.workload import BenchInputError, load_mix, with_weights
from lmfleet.cli.common import EXIT_USAGE, fail

app = typer.Typer(help="Load-test an OpenAI-compatible endpoint (lmfleet or any other) and report per provider.",
                  no_args_is_help=True)

DEFAULT_MIX = "chat:1:128-512:64-256:chat"

O: dict[str, Any] = {
    "url": typer.Option(..., "--url", help="Base URL of the server, without /v1 (e.g. http://127.0.0.1:8000)."),
    "model": typer.Option(..., "--model", "-m", help="Model name to request."),
    "api_key": typer.Option(None, "--api-key", envvar="LMFLEET_BENCH_API_KEY", help="Bearer key for the endpoint."),
    "users": typer.Option(None, "--users", "-u", min=1, help="Closed loop: number of virtual users (default 8)."),
    "rate": typer.Option(None, "--rate", "-r", min=0.001, help="Open loop: arrivals per second."),
    "burstiness": typer.Option(1.0, "--burstiness", min=0.01,
                               help="Open loop: gamma shape of arrival gaps; 1 = Poisson, <1 burstier."),
    "think": typer.Option("0", "--think-time", help="Closed loop: seconds a user waits between requests, "
                                                    "N or LO-HI (uniform)."),
    "ramp_up": typer.Option(0.0, "--ramp-up", min=0, help="Seconds over which users start / the rate rises."),
    "duration": typer.Option(None, "--duration", "-d", min=0.1, help="Stop sending after this many seconds."),
    "requests": typer.Option(None, "--requests", "-n", min=1, help="Stop after this many requests."),
    "warmup": typer.Option(0.0, "--warmup", min=0, help="Seconds at the start whose requests are excluded."),
    "max_conc": typer.Option(None, "--max-concurrency", min=1, help="Open loop: cap on requests in flight."),
    "mix": typer.Option(DEFAULT_MIX, "--mix", help="Workload mix: a YAML/JSON file or inline "
                                                   "NAME:WEIGHT:IN:OUT[:chat|completion],..."),
    "weight": typer.Option([], "--weight", help="Override a class weight: NAME=W (repeatable)."),
    "dataset": typer.Option(None, "--dataset", help="ShareGPT JSON or JSONL prompts instead of --mix."),
    "dataset_api": typer.Option("chat", "--dataset-api", help="API for dataset or trace prompts: chat or completion."),
    "trace": typer.Option(None, "--trace", help="Replay a trace in the Azure format (CSV: TIMESTAMP, ContextTokens, "
                          "GeneratedTokens) at its recorded times: azure:PATH[:start=S][:duration=D|:requests=N]"
                          "[:rate=R|:speed=S][:tokens=F] (docs/bench.md). Prompts of the recorded lengths; an open "
                          "loop instead of --users/--rate."),
    "tokenizer": typer.Option(None, "--tokenizer", help="Tokenizer for prompt synthesis: path, hub id or "
                                                         "builtin:NAME (default: from the server, see docs)."),
    "trust_remote_code": typer.Option(False, "--trust-remote-code",
                                      help="Let the tokenizer run code shipped with it (as engine.trust_remote_code)."),
    "seed": typer.Option(0, "--seed", help="Seed for prompts, class choice and arrivals."),
    "no_stream": typer.Option(False, "--no-stream", help="Send non-streaming requests (TTFT = E2E)."),
    "ignore_eos": typer.Option(False, "--ignore-eos", help="vLLM only: generate exactly max_tokens."),
    "slo_ttft": typer.Option(None, "--slo-ttft-ms", min=0, help="Goodput SLO on TTFT (ms)."),
    "slo_tpot": typer.Option(None, "--slo-tpot-ms", min=0, help="Goodput SLO on TPOT (ms)."),
    "slo_e2el": typer.Option(None, "--slo-e2el-ms", min=0, help="Goodput SLO on end-to-end latency (ms)."),
    "price": typer.Option([], "--price", help="KEY=IN:OUT USD per 1M tokens, e.g. local=0.05:0.10 (repeatable)."),
    "no_ledger": typer.Option(False, "--no-ledger", help="Do not ask the gateway's /admin/usage ledger for cost."),
    "timeout": typer.Option(600.0, "--timeout", min=1, help="Per-request timeout (s)."),
    "out": typer.Option(Path("bench-out"), "--out", "-o", help="Folder for report.json/.csv/.html."),
    "quiet": typer.Option(False, "--quiet", "-q", help="No progress bar."),
}


def _think(text: str) -> tuple[float, float]:
    try:
        parts = [float(x) for x in text.split("-")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 0 or parts[0] > parts[-1]:
        raise BenchInputError(f"--think-time {text!r}: expected seconds N or LO-HI with 0 <= LO <= HI")
    return parts[0], parts[-1]


def _weights(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, w = item.partition("=")
        try:
            out[name] = float(w)
            if not sep:
                raise ValueError
        except ValueError:
            raise BenchInputError(f"--weight {item!r}: expected NAME=WEIGHT") from None
    return out


def build_spec(url: str, model: str, api_key: Optional[str], users: Optional[int], rate: Optional[float],
               burstiness: float, think: str, ramp_up: float, duration: Optional[float], requests: Optional[int],
               warmup: float, max_conc: Optional[int], mix: str, weight: list[str], dataset: Optional[Path],
               dataset_api: str, tokenizer: Optional[str], seed: int, no_stream: bool, ignore_eos: bool,
               slo_ttft: Optional[float], slo_tpot: Optional[float], slo_e2el: Optional[float], price: list[str],
               no_ledger: bool, timeout: float, *, trust_remote_code: bool = False,
               trace: Optional[str] = None) -> BenchSpec:
    """Flags -> a checked ``BenchSpec``; every inconsistency is a ``BenchInputError``."""
    if users and rate:
        raise BenchInputError("give --users (closed loop) or --rate (open loop), not both")
    replay_spec, arrivals = None, None
    if trace:
        if users or rate or dataset or weight:
            raise BenchInputError("--trace sets the requests and their times: drop --users, --rate, --dataset and "
                                  "--weight")
        replay_spec = parse_replay(trace)
        if replay_spec.load is not None:
            raise BenchInputError("--trace load= is a multiple of a measured capacity (bench_overflow_policies.py "
                                  "measures one); here give rate=R (mean requests/s) or speed=S")
        replayed = plan_trace(replay_spec)
        arrivals, rate = tuple(r.arrival_s for r in replayed.requests), replayed.mean_rps
        requests = min(requests or len(arrivals), len(arrivals))
    if dataset_api not in ("chat", "completion"):
        raise BenchInputError(f"--dataset-api {dataset_api!r}: expected chat or completion")
    if duration is None and requests is None:
        duration = 60.0
    if duration is not None and warmup >= duration:
        raise BenchInputError(f"--warmup {warmup:g} s must be shorter than --duration {duration:g} s")
    plan = LoadPlan(users=None if rate else (users or 8), rate=rate, burstiness=burstiness, think_time=_think(think),
                    ramp_up=ramp_up, duration=duration, num_requests=requests, warmup=warmup,
                    max_concurrency=max_conc, seed=seed, timeout=timeout, arrivals=arrivals)
    workload = None if dataset or trace else with_weights(load_mix(mix), _weights(weight))
    if dataset and weight:
        raise BenchInputError("--weight applies to --mix classes, not to --dataset")
    return BenchSpec(base_url=url, model=model, plan=plan, mix=workload, dataset=dataset, dataset_api=dataset_api,
                     tokenizer=tokenizer, trust_remote_code=trust_remote_code, api_key=api_key, stream=not no_stream,
                     slo=SLO(slo_ttft, slo_tpot, slo_e2el), prices=dict(parse_price(p) for p in price),
                     admin_key=os.environ.get("LMFLEET_ADMIN_KEY"), use_ledger=not no_ledger,
                     extra_body={"ignore_eos": True} if ignore_eos else None, trace=replay_spec)


@app.command("run")
def run(url: str = O["url"], model: str = O["model"], api_key: Optional[str] = O["api_key"],
        users: Optional[int] = O["users"], rate: Optional[float] = O["rate"], burstiness: float = O["burstiness"],
        think_time: str = O["think"], ramp_up: float = O["ramp_up"], duration: Optional[float] = O["duration"],
        requests: Optional[int] = O["requests"], warmup: float = O["warmup"],
        max_concurrency: Optional[int] = O["max_conc"], mix: str = O["mix"], weight: list[str] = O["weight"],
        dataset: Optional[Path] = O["dataset"], dataset_api: str = O["dataset_api"],
        trace: Optional[str] = O["trace"],
        tokenizer: Optional[str] = O["tokenizer"], trust_remote_code: bool = O["trust_remote_code"],
        seed: int = O["seed"], no_stream: bool = O["no_stream"],
        ignore_eos: bool = O["ignore_eos"], slo_ttft_ms: Optional[float] = O["slo_ttft"],
        slo_tpot_ms: Optional[float] = O["slo_tpot"], slo_e2el_ms: Optional[float] = O["slo_e2el"],
        price: list[str] = O["price"], no_ledger: bool = O["no_ledger"], timeout: float = O["timeout"],
        out: Path = O["out"], quiet: bool = O["quiet"]) -> None:
    """Run one benchmark and write report.json, report.csv and report.html to --out."""
    console = Console(stderr=True)
    try:
        spec = build_spec(url, model, api_key, users, rate, burstiness, think_time, ramp_up, duration, requests,
                          warmup, max_concurrency, mix, weight, dataset, dataset_api, tokenizer, seed, no_stream,
                          ignore_eos, slo_ttft_ms, slo_tpot_ms, slo_e2el_ms, price, no_ledger, timeout,
                          trust_remote_code=trust_remote_code, trace=trace)
        pool, _ = prepare(spec)
    except BenchInputError as e:
        fail(str(e), EXIT_USAGE)
    report = run_benchmark(spec, pool, console=None if quiet else console)
    render_tables(report)
    paths = write_outputs(report, out)
    for problem in check_consistency(report):
        typer.echo(f"lmfleet: warning: {problem}", err=True)
    typer.echo(f"lmfleet: wrote {', '.join(str(p) for p in paths.values())}", err=True)


@app.command("sweep")
def sweep(over: str = typer.Option(..., "--over", help="What to sweep: rate, users or overflow (threshold ms)."),
          values: str = typer.Option(..., "--values", help="Comma-separated values, e.g. 1,2,4,8."),
          url: str = O["url"], model: str = O["model"], api_key: Optional[str] = O["api_key"],
          users: Optional[int] = O["users"], rate: Optional[float] = O["rate"], burstiness: float = O["burstiness"],
          think_time: str = O["think"], ramp_up: float = O["ramp_up"], duration: Optional[float] = O["duration"],
          requests: Optional[int] = O["requests"], warmup: float = O["warmup"],
          max_concurrency: Optional[int] = O["max_conc"], mix: str = O["mix"], weight: list[str] = O["weight"],
          dataset: Optional[Path] = O["dataset"], dataset_api: str = O["dataset_api"],
          tokenizer: Optional[str] = O["tokenizer"], trust_remote_code: bool = O["trust_remote_code"],
          seed: int = O["seed"], no_stream: bool = O["no_stream"],
          ignore_eos: bool = O["ignore_eos"], slo_ttft_ms: Optional[float] = O["slo_ttft"],
          slo_tpot_ms: Optional[float] = O["slo_tpot"], slo_e2el_ms: Optional[float] = O["slo_e2el"],
          price: list[str] = O["price"], no_ledger: bool = O["no_ledger"], timeout: float = O["timeout"],
          out: Path = O["out"], quiet: bool = O["quiet"]) -> None:
    """Run the same workload at each value and plot P99 latency and $/1M tokens against it."""
    import dataclasses

    console = Console(stderr=True)
    try:
        vals = parse_values(values, over)
        if over == "rate":
            rate, users = rate or vals[0], None
        spec = build_spec(url, model, api_key, users, rate, burstiness, think_time, ramp_up, duration, requests,
                          warmup, max_concurrency, mix, weight, dataset, dataset_api, tokenizer, seed, no_stream,
                          ignore_eos, slo_ttft_ms, slo_tpot_ms, slo_e2el_ms, price, no_ledger, timeout,
                          trust_remote_code=trust_remote_code)
        pool, _ = prepare(spec)
        if over == "overflow":  # fail before any load if the admin endpoint is missing or refuses
            set_overflow(url, model, vals[0], spec.admin_key)
    except BenchInputError as e:
        fail(str(e), EXIT_USAGE)

    def step(value: float) -> dict[str, Any]:
        if over == "overflow":
            set_overflow(url, model, value, spec.admin_key)
        step_spec = dataclasses.replace(spec, plan=plan_for(spec.plan, over, value))
        console.print(f"[bold]sweep {over} = {value:g}")
        report = run_benchmark(step_spec, pool, console=None if quiet else console, meta={f"sweep_{over}": value})
        write_outputs(report, out / f"{over}-{value:g}")
        return report

    try:
        rows = run_sweep(over, vals, step)
    except BenchInputError as e:  # the admin endpoint refused a later value: load was already sent
        fail(str(e), 1)
    paths = write_sweep(rows, over, out)
    typer.echo(json.dumps(rows, indent=2))
    typer.echo(f"lmfleet: wrote {', '.join(str(p) for p in paths.values())}", err=True)

"""One benchmark run end to end: check the target, build the requests, send the load, write the report.

Everything that can be wrong with the input is checked in ``prepare`` before any load is sent and
raised as ``BenchInputError`` (the CLI exits 2).
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from lmfleet.bench.cost import Price, fetch_usage, usage_covering
from lmfleet.bench.html import write_html
from lmfleet.bench.loadgen import LiveStats, LoadPlan, RequestRecord, Target, run_load
from lmfleet.bench.metrics import SLO, percentile
from lmfleet.bench.replay import Replay, ReplaySpec, read_trace_file, replay
from lmfleet.bench.report import build_report, write_csv, write_json
from lmfleet.bench.workload import (BenchInputError, BenchRequest, PromptSynthesizer, WorkloadMix, check_context,
                                    load_dataset, sample_requests, trace_requests)
from lmfleet.models import BUILTIN_MODELS, resolve_source
from lmfleet.models.tokenizer import TokenizerLoadError, load_tokenizer


@dataclass
class BenchSpec:
    """A complete description of one run (what the CLI flags say)."""

    base_url: str
    model: str
    plan: LoadPlan
    mix: WorkloadMix | None = None
    dataset: Path | None = None
    dataset_api: str = "chat"
    tokenizer: str | None = None
    trust_remote_code: bool = False
    """Let the tokenizer run code shipped with it (like ``engine.trust_remote_code``)."""
    api_key: str | None = None
    stream: bool = True
    slo: SLO = SLO()
    prices: dict[str, Price] = field(default_factory=dict)
    admin_key: str | None = None
    use_ledger: bool = True
    extra_body: dict | None = None
    trace: ReplaySpec | None = None
    """Replay this trace (its window, pace and token factor) instead of --mix; ``plan.arrivals`` holds its times."""


@dataclass
class TargetInfo:
    model_ids: list[str]
    max_model_len: int | None
    root: str | None


def probe_target(base_url: str, model: str, api_key: str | None, timeout: float = 10.0) -> TargetInfo:
    """``GET /v1/models``: the server answers, serves ``model``, and (vLLM) tells its context length."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        r = httpx.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise BenchInputError(f"cannot reach {url}: {type(e).__name__}: {e}; is the server up and the URL right "
                              "(base URL without /v1)?") from None
    if r.status_code in (401, 403):
        raise BenchInputError(f"{url} answered {r.status_code}: pass the right --api-key")
    if r.status_code != 200:
        return TargetInfo([], None, None)  # some servers have no model list; do not insist
    try:
        data = r.json().get("data", [])
    except ValueError:
        raise BenchInputError(f"{url} did not answer JSON; is this an OpenAI-compatible server?") from None
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    if ids and model not in ids:
        raise BenchInputError(f"model {model!r} is not served at {base_url}; it serves {ids}")
    entry = next((m for m in data if m.get("id") == model), {})
    return TargetInfo(ids, entry.get("max_model_len"), entry.get("root"))


def resolve_tokenizer_path(spec_tokenizer: str | None, model: str, info: TargetInfo) -> str:
    """``--tokenizer`` (a path, hub id or ``builtin:NAME``); else the server's model folder (vLLM's
    ``root``) if it exists here; else ``builtin:<model>`` when the model name is a built-in."""
    if spec_tokenizer:
        if spec_tokenizer.startswith("builtin:"):
            try:
                return resolve_source(spec_tokenizer, progress=lambda *_: None)
            except ValueError as e:
                raise BenchInputError(f"--tokenizer: {e}") from None
        return spec_tokenizer
    if info.root and Path(info.root).is_dir():
        return info.root
    aliases = {"tiny": "tiny-random"}
    name = aliases.get(model, model)
    if name in BUILTIN_MODELS:
        return resolve_source(f"builtin:{name}", progress=lambda *_: None)
    raise BenchInputError(f"cannot tell which tokenizer model {model!r} uses; pass --tokenizer PATH_OR_HUB_ID "
                          "or builtin:NAME")


def load_bench_tokenizer(path: str, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer prompts are synthesized with; ``path`` may be a hub id (bench runs on a client machine)."""
    try:
        return load_tokenizer(path, trust_remote_code=trust_remote_code, local_files_only=False)
    except TokenizerLoadError as e:
        raise BenchInputError(f"cannot load tokenizer {path!r}: {e.__cause__ or e}") from None


def plan_trace(spec: ReplaySpec, max_model_len: int | None = None) -> Replay:
    """The replay of ``spec`` (its token counts capped by ``max_model_len`` if known)."""
    return replay(spec, read_trace_file(spec.path), max_model_len=max_model_len)


def build_requests(spec: BenchSpec, tokenizer: Any, info: TargetInfo) -> list[BenchRequest]:
    if spec.trace is not None:  # one request per recorded one, in order: no pool
        r = plan_trace(spec.trace, info.max_model_len or _tokenizer_context(tokenizer))
        return trace_requests(r.requests, PromptSynthesizer(tokenizer), spec.dataset_api, spec.plan.seed,
                              ignore_eos=bool((spec.extra_body or {}).get("ignore_eos")))
    # request i is pool[i % len(pool)]: a bounded pool keeps synthesis time small for long runs
    n = min(spec.plan.num_requests or 2000, 2000)
    if spec.dataset or spec.mix is None:
        return load_dataset(spec.dataset, n, spec.plan.seed, tokenizer, api=spec.dataset_api)
    check_context(spec.mix, info.max_model_len or _tokenizer_context(tokenizer))
    return sample_requests(spec.mix, n, PromptSynthesizer(tokenizer), seed=spec.plan.seed or spec.mix.seed)


def _tokenizer_context(tokenizer: Any) -> int | None:
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and n < 10**7 else None


def prepare(spec: BenchSpec) -> tuple[list[BenchRequest], TargetInfo]:
    info = probe_target(spec.base_url, spec.model, spec.api_key)
    tokenizer = load_bench_tokenizer(resolve_tokenizer_path(spec.tokenizer, spec.model, info),
                                     trust_remote_code=spec.trust_remote_code) \
        if (spec.mix is not None or spec.trace is not None or spec.tokenizer) else None
    return build_requests(spec, tokenizer, info), info


async def _progress_loop(stats: LiveStats, plan: LoadPlan, console: Console, t0: float, stop: asyncio.Event) -> None:
    total = plan.num_requests or plan.duration
    with Progress(TextColumn("[bold]bench"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("", total=total)
        while True:
            elapsed = time.perf_counter() - t0
            ttft = percentile(stats.last_ttfts[-500:], 50) * 1000
            progress.update(task, completed=stats.done if plan.num_requests else min(elapsed, total),
                            description=f"done {stats.done}  in-flight {stats.in_flight}  failed {stats.failed}  "
                                        f"{stats.output_tokens / max(elapsed, 1e-9):.0f} tok/s  TTFT p50 {ttft:.0f} ms")
            if stop.is_set():
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


async def execute(spec: BenchSpec, requests: list[BenchRequest], console: Console | None,
                  label: str | None = None) -> tuple[list[RequestRecord], float]:
    target = Target(spec.base_url, spec.model, spec.api_key, label=label or "endpoint", extra_body=spec.extra_body)
    stats = LiveStats()
    stop = asyncio.Event()
    t0 = time.perf_counter()
    shown = asyncio.create_task(_progress_loop(stats, spec.plan, console, t0, stop)) if console else None
    try:
        return await run_load(target, requests, spec.plan, stats, stream=spec.stream)
    finally:
        stop.set()
        if shown:
            await shown


def run_benchmark(spec: BenchSpec, requests: list[BenchRequest], console: Console | None = None,
                  meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send the load and build the report (no files written)."""
    started = time.time()
    records, wall = asyncio.run(execute(spec, requests, console, label=_endpoint_label(spec.base_url)))
    ledger = usage_covering(lambda: fetch_usage(spec.base_url, started, spec.admin_key),
                            {r.provider for r in records if r.ok}) if spec.use_ledger else None
    meta = {
        "base_url": spec.base_url, "model": spec.model, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                   time.gmtime(started)),
        "wall_s": wall, "load": _describe_plan(spec.plan), "stream": spec.stream,
        "workload": _describe_workload(spec),
        "cost_source": "ledger" if ledger else ("prices" if spec.prices else "none"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus", **(meta or {}),
    }
    return build_report(records, warmup=spec.plan.warmup, slo=spec.slo, prices=spec.prices, ledger=ledger,
                        meta=meta)


def write_outputs(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "csv": out_dir / "report.csv", "html": out_dir / "report.html"}
    write_json(report, paths["json"])
    write_csv(report, paths["csv"])
    write_html(report, paths["html"])
    return paths


def _endpoint_label(base_url: str) -> str:
    return base_url.split("://", 1)[-1].rstrip("/")


def _describe_workload(spec: BenchSpec) -> str:
    if spec.trace is not None:
        return plan_trace(spec.trace).describe() + " (token counts capped by the server's context)"
    return "dataset " + str(spec.dataset) if spec.dataset else _describe_mix(spec.mix)


def _describe_plan(p: LoadPlan) -> str:
    load = (f"closed loop, {p.users} users, think {p.think_time[0]:g}-{p.think_time[1]:g} s" if p.users
            else f"open loop, the trace's arrivals (mean {p.rate:.3g} req/s)" if p.arrivals
            else f"open loop, {p.rate:g} req/s, burstiness {p.burstiness:g}")
    stop = " ".join(x for x in (f"{p.duration:g} s" if p.duration else "",
                                f"{p.num_requests} requests" if p.num_requests else "") if x)
    return f"{load}; {stop}; warm-up {p.warmup:g} s; ramp-up {p.ramp_up:g} s; seed {p.seed}"


def _describe_mix(mix: WorkloadMix | None) -> str:
    if mix is None:
        return "-"
    return ", ".join(f"{c.name} {c.weight:g} ({c.api}, in {c.input_tokens.lo}-{c.input_tokens.hi}, "
                     f"out {c.output_tokens.lo}-{c.output_tokens.hi}{_describe_sessions(c)})" for c in mix.classes)


def _describe_sessions(c) -> str:
    out = f", {c.prefixes.count} system prompts of {c.prefixes.tokens} tokens" if c.prefixes else ""
    if c.prefixes and c.prefixes.hot_share:
        out += f" ({c.prefixes.hot_share:.0%} on one)"
    return out + (f", {c.turns}-turn sessions" if c.turns > 1 else "")

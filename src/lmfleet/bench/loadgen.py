"""The load generator: sends streamed OpenAI requests and times every chunk.

Timing follows ``vllm bench serve`` (vllm/benchmarks/lib/endpoint_request_func.py): the clock starts
just before the POST; TTFT is the arrival of the first SSE event that carries ``choices``; each later
such event adds one ITL gap; end-to-end latency ends at the last ``choices`` event (the trailing
usage event and ``[DONE]`` do not count). Output tokens come from ``usage.completion_tokens``
(requested with ``stream_options.include_usage``), else the number of content events.

Two load models: closed loop (``users`` virtual users, each sends, waits for the answer, thinks,
repeats; optional linear ramp-up) and open loop (arrivals at ``rate`` req/s with gamma-distributed
gaps: burstiness 1 = Poisson, < 1 burstier, > 1 more regular — the same as vLLM's ``--burstiness``; or, for a
replayed trace, at the recorded times ``arrivals``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import aiohttp

from lmfleet.bench.workload import BenchRequest

SERVED_BY_HEADER = "x-lmfleet-served-by"


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds, ``start`` relative to the run's start."""

    cls: str
    provider: str
    start: float
    status: int = 0  # HTTP status; 0 = no response (connection error, timeout)
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def end(self) -> float:
        return self.start + self.latency


@dataclass(frozen=True)
class LoadPlan:
    """How much load, of what shape. Exactly one of ``users`` / ``rate`` is set; at least one of
    ``duration`` / ``num_requests``."""

    users: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    think_time: tuple[float, float] = (0.0, 0.0)
    ramp_up: float = 0.0
    duration: float | None = None
    num_requests: int | None = None
    warmup: float = 0.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout: float = 600.0
    arrivals: tuple[float, ...] | None = None
    """Open loop: request i at ``arrivals[i]`` seconds (a replayed trace) instead of gamma gaps at ``rate``."""


@dataclass
class LiveStats:
    """Running figures for the progress display (cheap counters, updated per request)."""

    sent: int = 0
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    output_tokens: int = 0
    last_ttfts: list[float] = field(default_factory=list)


class Target:
    """Where to send: an OpenAI-compatible base URL (without ``/v1``) and a model name."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, label: str | None = None,
                 extra_body: dict | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.label = label or "endpoint"
        self.extra_body = extra_body or {}

    def payload(self, req: BenchRequest, stream: bool = True) -> tuple[str, bytes]:
        body: dict = {"model": self.model, "max_tokens": req.max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if req.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        if req.api == "chat":
            body["messages"] = req.messages
            return f"{self.base_url}/v1/chat/completions", json.dumps(body).encode()
        body["prompt"] = req.prompt
        return f"{self.base_url}/v1/completions", json.dumps(body).encode()


async def send_one(session: aiohttp.ClientSession, target: Target, req: BenchRequest, t0: float,
                   stream: bool = True) -> RequestRecord:
    url, body = target.payload(req, stream)
    st = time.perf_counter()
    rec = RequestRecord(cls=req.cls, provider=target.label, start=st - t0, prompt_tokens=req.input_tokens)
    last = st
    n_events = 0
    try:
        async with session.post(url, data=body, headers=target.headers) as resp:
            rec.status = resp.status
            rec.provider = resp.headers.get(SERVED_BY_HEADER, target.label)
            if resp.status != 200:
                rec.error = (await resp.text())[:300] or resp.reason or "error"
                rec.latency = time.perf_counter() - st
                return rec
            if not stream:
                data = await resp.json(content_type=None)
                last = time.perf_counter()
                rec.ttft = last - st
                _apply_usage(rec, data.get("usage"))
                n_events = 1
            else:
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    now = time.perf_counter()
                    data = json.loads(payload)
                    if data.get("choices"):
                        if n_events == 0:
                            rec.ttft = now - st
                        else:
                            rec.itl.append(now - last)
                        last = now
                        n_events += 1
                    if data.get("usage"):
                        _apply_usage(rec, data["usage"])
                    if data.get("error"):
                        rec.error = str(data["error"])[:300]
        if n_events == 0 and not rec.error:
            rec.error = "no token received"
        if not rec.output_tokens:
            rec.output_tokens = n_events
        rec.latency = last - st
    except asyncio.TimeoutError:
        rec.error, rec.latency = "timeout", time.perf_counter() - st
    except (aiohttp.ClientError, OSError, json.JSONDecodeError) as e:
        rec.error, rec.latency = f"{type(e).__name__}: {e}"[:300], time.perf_counter() - st
    return rec


def _apply_usage(rec: RequestRecord, usage: dict | None) -> None:
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])


class TurnOrder:
    """Holds turn k of a session back until turn k-1 has been answered.

    Request ``i`` is ``requests[i % n]``: keys carry the pass over the list (``i // n``) so that a session repeated
    in the next pass waits for its own earlier turn. Turn k-1 always has a lower index, so it was taken (and is
    being sent) before turn k waits for it: no deadlock.
    """

    def __init__(self, n: int):
        self.n = max(n, 1)
        self._events: dict[tuple[int, str, int], asyncio.Event] = {}

    def _event(self, key: tuple[int, str, int]) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    async def wait(self, i: int, req: BenchRequest) -> None:
        if req.session and req.turn > 1:
            key = (i // self.n, req.session, req.turn - 1)
            await self._event(key).wait()
            self._events.pop(key, None)

    def finish(self, i: int, req: BenchRequest) -> None:
        """(A session's last turn leaves one event nobody waits for: one per session, freed with the run.)"""
        if req.session:
            self._event((i // self.n, req.session, req.turn)).set()


def arrival_gaps(rate: float, burstiness: float, rng: random.Random):
    """Gaps between open-loop arrivals: gamma(shape=burstiness, mean=1/rate)."""
    theta = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, theta)


def trace_gaps(arrivals: Sequence[float]):
    """The gaps of recorded arrivals (the first from 0), then 0s (the plan stops after the last)."""
    last = 0.0
    for t in arrivals:
        yield max(0.0, t - last)
        last = t
    while True:
        yield 0.0


async def run_load(target: Target, requests: Sequence[BenchRequest], plan: LoadPlan,
                   stats: LiveStats | None = None, stream: bool = True,
                   on_record: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Run the plan; return every record and the wall time of the run. Request ``i`` is
    ``requests[i % len(requests)]``, so the sequence is reproducible."""
    stats = stats or LiveStats()
    conns = plan.users or plan.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=conns, limit_per_host=conns, force_close=False,
                                     ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=plan.timeout, sock_connect=30)
    records: list[RequestRecord] = []
    rng = random.Random(plan.seed)
    counter = iter(range(10**12))
    t0 = time.perf_counter()
    deadline = t0 + plan.duration if plan.duration else None

    order = TurnOrder(len(requests))

    def next_request() -> tuple[int, BenchRequest] | None:
        i = next(counter)
        if plan.num_requests is not None and i >= plan.num_requests:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        return i, requests[i % len(requests)]

    async def one(session: aiohttp.ClientSession, item: tuple[int, BenchRequest]) -> None:
        i, req = item
        stats.sent += 1
        stats.in_flight += 1
        rec = await send_one(session, target, req, t0, stream)
        order.finish(i, req)
        stats.in_flight -= 1
        stats.done += 1
        rec.warmup = rec.start < plan.warmup
        if rec.ok:
            stats.output_tokens += rec.output_tokens
            stats.last_ttfts.append(rec.ttft)
            if len(stats.last_ttfts) > 2000:
                del stats.last_ttfts[:1000]
        else:
            stats.failed += 1
        records.append(rec)
        if on_record:
            on_record(rec)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     auto_decompress=False, read_bufsize=2**16) as session:
        if plan.users:
            async def user(k: int) -> None:
                urng = random.Random(plan.seed * 1_000_003 + k)
                if plan.ramp_up:
                    await asyncio.sleep(plan.ramp_up * k / plan.users)
                while (item := next_request()) is not None:
                    await order.wait(*item)  # a session's next turn follows its previous answer (not timed)
                    await one(session, item)
                    lo, hi = plan.think_time
                    if hi > 0:
                        await asyncio.sleep(urng.uniform(lo, hi))

            await asyncio.gather(*(user(k) for k in range(plan.users)))
        else:
            sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
            tasks: set[asyncio.Task] = set()
            gaps = arrival_gaps(plan.rate, plan.burstiness, rng) if plan.arrivals is None else trace_gaps(plan.arrivals)
            next_t = time.perf_counter()
            if plan.arrivals:  # the first request at its own time
                next_t += next(gaps)
                await asyncio.sleep(max(0.0, next_t - time.perf_counter()))

            async def limited(item: tuple[int, BenchRequest]) -> None:
                await order.wait(*item)  # before taking a slot: the previous turn may need one
                if sem is None:
                    await one(session, item)
                else:
                    async with sem:
                        await one(session, item)

            while (item := next_request()) is not None:
                task = asyncio.create_task(limited(item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                gap = next(gaps)
                if plan.ramp_up and plan.arrivals is None:  # linear ramp of the rate from 5% to 100% over ramp_up s
                    gap /= min(1.0, max(0.05, (time.perf_counter() - t0) / plan.ramp_up))
                next_t += gap
                delay = next_t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if tasks:
                await asyncio.gather(*tasks)
    return records, time.perf_counter() - t0

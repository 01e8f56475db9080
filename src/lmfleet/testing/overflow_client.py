"""The overflow-policies benchmark's client: fresh prompt text of a trace's lengths, streamed at each request's
arrival (open loop) or back to back (closed loop, to measure capacity), timed from the client's side.

An :class:`Endpoint` is lmfleet's gateway (its ``x-lmfleet-*`` headers say who answered and why) or the real
LiteLLM proxy (``litellm_provider`` set: its ``x-litellm-*`` headers say whether the fallback answered), or a
provider reached directly (``served_by`` set).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

from lmfleet.bench.overflow_figures import LITELLM_FALLBACK, Outcome
from lmfleet.bench.trace import TraceRequest
from lmfleet.testing.litellm_proxy import answered_by_provider

__all__ = ["WORDS", "Endpoint", "closed_loop", "prompt_text", "replay", "send"]

WORDS = ("the of and to in is was for on are with as by at be this from or an have not which one all were "
         "when there can more if out so what up its about into than them only other new some could time these "
         "two may then do first any my now such like our over man me even most made after also did many before "
         "must through back years where much your way well down should because each just those people how too").split()


@dataclass(frozen=True)
class Endpoint:
    """Where the client sends: a base URL without ``/v1``, the model name and key to send."""

    url: str
    model: str = "smollm2"
    api_key: str = ""
    litellm_provider: str = ""
    """A LiteLLM proxy: the provider's base URL, to tell its fallbacks from the engine's answers."""
    served_by: str = ""
    """What answers here when no gateway says so (a provider reached directly): the outcomes' ``served_by``."""


def prompt_text(r: TraceRequest, seed: int, salt: int = 0) -> str:
    """The request's prompt: ``r.prompt_tokens`` random words. ``salt``: which replay sends it; every replay sends
    fresh text of the same lengths, so that vLLM's prefix cache does not serve a replay's long prompts from an
    earlier one (a prefilled 2,500-token prompt answers in a fraction of the uncached time)."""
    rng = random.Random((seed * 1_000_003 + r.index) * 65_537 + salt)
    return " ".join(rng.choice(WORDS) for _ in range(r.prompt_tokens))


async def send(session, ep: Endpoint, r: TraceRequest, seed: int, t0: float, ignore_eos: bool,
               salt: int = 0) -> Outcome:
    """Stream one request; what the client saw (the gateway's headers, or LiteLLM's: :class:`Endpoint`)."""
    import aiohttp

    body = {"model": ep.model, "messages": [{"role": "user", "content": prompt_text(r, seed, salt)}],
            "max_tokens": r.output_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
    sent = time.monotonic()
    o = Outcome(r.index, r.prompt_tokens, r.output_tokens, sent - t0, None, None, 0)
    try:
        async with session.post(f"{ep.url}/v1/chat/completions", json=body, headers=headers) as resp:
            o.status = resp.status
            h = resp.headers
            o.served_by, o.route_reason = h.get("x-lmfleet-served-by", ""), h.get("x-lmfleet-route-reason", "")
            if ep.served_by:
                o.served_by, o.route_reason = ep.served_by, "direct"
            if ep.litellm_provider:
                fell_back = answered_by_provider(h, ep.litellm_provider)
                o.served_by = "provider/litellm-fallback" if fell_back else f"local/{ep.model}"
                o.route_reason = LITELLM_FALLBACK if fell_back else "local_ok"
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
                if ev.get("error"):  # a stream ended by the proxy (LiteLLM's stream_timeout between chunks)
                    o.error = f"stream error: {ev['error']}"[:200]
                if ev.get("usage"):
                    o.prompt_tokens = ev["usage"].get("prompt_tokens", o.prompt_tokens)
                    o.output_tokens = ev["usage"].get("completion_tokens", o.output_tokens)
                if o.ttft_s is None and any((c.get("delta") or {}).get("content") for c in ev.get("choices", [])):
                    o.ttft_s = time.monotonic() - sent
            o.e2e_s = time.monotonic() - sent
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        o.error = f"{type(e).__name__}: {e}"[:200]
    return o


async def replay(ep: Endpoint, trace: list[TraceRequest], seed: int, ignore_eos: bool, salt: int,
                 to: Mapping[int, Endpoint] | None = None) -> list[Outcome]:
    """Send every request at its arrival time (open loop), whatever the answers; ``salt``: :func:`prompt_text`;
    ``to``: trace indices sent to another endpoint than ``ep`` (an oracle's spill plan)."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.monotonic()
        tasks = []
        for r in trace:
            delay = t0 + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(s, (to or {}).get(r.index, ep), r, seed, t0, ignore_eos, salt)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(ep: Endpoint, trace: list[TraceRequest], users: int, duration_s: float, seed: int,
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
            o = await send(s, ep, trace[i % len(trace)], seed, t0, ignore_eos, salt=-1 - i // len(trace))
            i += users
            done += o.ok

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(user(k) for k in range(users)))
    return done / (time.monotonic() - t0)

"""Fakes for gateway unit tests: backends behind httpx.MockTransport, a Router around them."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from lmfleet.config import parse_config
from lmfleet.gateway.health import HealthBoard
from lmfleet.gateway.metrics import GatewayMetrics
from lmfleet.gateway.router import LocalModel, Provider, Router
from lmfleet.overflow import CircuitBreaker, Ledger, LoadTracker, LocalCostMeter

Handler = Callable[[httpx.Request], httpx.Response]


def chat_json(model: str, text: str = "Paris.", prompt: int = 7, completion: int = 2) -> dict:
    return {"id": "x", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def sse_events(model: str, words: list[str], *, usage: bool = True, done: bool = True) -> list[bytes]:
    out = []
    for w in words:
        out.append(b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "model": model,
                                           "choices": [{"index": 0, "delta": {"content": w}}]}).encode() + b"\n\n")
    if usage:
        out.append(b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "model": model, "choices": [],
                                           "usage": {"prompt_tokens": 5, "completion_tokens": len(words),
                                                     "total_tokens": 5 + len(words)}}).encode() + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


class BreakingStream(httpx.AsyncByteStream):
    """Yields some events, then raises like a connection reset."""

    def __init__(self, events: list[bytes], error: Exception | None = None):
        self.events = events
        self.error = error

    async def __aiter__(self):
        for e in self.events:
            yield e
        if self.error is not None:
            raise self.error


def stream_response(events: list[bytes], error: Exception | None = None) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=BreakingStream(events, error))


class CountingTokenizer:
    """Counts one token per word; good enough to test the context-length check."""

    def encode(self, text, add_special_tokens=True):
        return text.split()

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [w for m in messages for w in (m["content"] or "").split()] + ["<gen>"]


def make_router(tmp_path, local: Handler, providers: dict[str, Handler] | None = None, *,
                ready: bool = True, extra: dict | None = None, max_model_len: int = 64) -> Router:
    providers = providers or {}
    data = {
        "models": [{"name": "m", "source": "builtin:tiny-random",
                    "deployment": {"max_ongoing_requests": 4, "request_timeout_s": 10},
                    "overflow": {"threshold_ms": 1000, "local_first_token_timeout_s": 2}}],
        "providers": [{"name": n, "base_url": f"http://{n}.test/v1", "model_map": {"m": f"{n}-model"},
                       "price": {"input_per_1m": 1.0, "output_per_1m": 2.0}, "max_retries": 1,
                       "breaker": {"backoff_base_s": 0.01, "backoff_cap_s": 0.02}} for n in providers],
        "ledger": {"path": str(tmp_path / "ledger.sqlite")},
    }
    for k, v in (extra or {}).items():
        data[k] = v
    fleet = parse_config(data)
    mc = fleet.models[0]
    lm = LocalModel(cfg=mc, base_url="http://local.test/m/v1", max_model_len=max_model_len,
                    tokenizer=CountingTokenizer(), tracker=LoadTracker(4), capacity=4,
                    meter=LocalCostMeter(0.0), threshold_ms=mc.overflow.threshold_ms)
    provs = {p.name: Provider(p, httpx.AsyncClient(transport=httpx.MockTransport(providers[p.name])),
                              {"authorization": "Bearer sk-secret-provider-key"}, CircuitBreaker.from_config(p.breaker))
             for p in fleet.providers}
    health = HealthBoard({"m": "lmfleet-m"}, None)
    if not ready:
        health.mark_failed("m", "engine is dead")
    return Router(fleet, {"m": lm}, provs, httpx.AsyncClient(transport=httpx.MockTransport(local)), health,
                  GatewayMetrics(), Ledger(fleet.ledger.path))

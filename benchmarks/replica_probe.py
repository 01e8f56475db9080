"""Timestamps from inside a Serve replica: when each HTTP request reached vLLM's app and when its first body byte
left, and when vLLM's ``AsyncLLM.add_request`` ran. For ``bench_gateway.py --replica-probe``; not part of lmfleet.

Loaded in the replica through Ray Serve LLM's engine-class escape hatch: ``bench_gateway.py --replica-probe`` puts
this folder on the replica's ``PYTHONPATH`` and sets ``RAYLLM_VLLM_ENGINE_CLS=replica_probe.TimedVLLMEngine``
(``engine.env`` in the fleet file). Each event is one JSON line in ``LMFLEET_PROBE_LOG``::

    {"ev": "http", "entry": t, "arrival": t, "first_byte": t, "end": t, "path": "/smollm2/v1/completions"}
    {"ev": "add_request", "t": t}

    {"ev": "gc", "t": t, "gen": 2, "ms": 41.0}          (every collection of 5 ms or more)
    {"ev": "gcsum", "t": t, "ms": [g0, g1, g2], "n": [n0, n1, n2]}   (all collections, per second)
    {"ev": "lag", "t": t, "ms": 120.0}                  (the event loop answered a 10 ms timer >= 20 ms late)

(wall-clock ``time.time()``, comparable with the load generator's ``time.time()`` on the same machine).
The bare vLLM server of the same run gets :class:`TimingMiddleware` alone, through vLLM's own ``--middleware``
option (no ``add_request`` events there).
``entry`` is when Serve's ``Replica._direct_ingress_asgi`` got the request from uvicorn (null in bare vLLM);
``arrival`` is when the request entered vLLM's ASGI app, i.e. after Serve's wrapper passed it on;
``add_request`` is when vLLM handed it to the engine core (after parsing and tokenizing it).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import time

from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

LOG_ENV = "LMFLEET_PROBE_LOG"
_RID = re.compile(rb"\[rid (\d+)\]")  # bench_gateway's per-request id at the start of the prompt


class _Log:
    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the replica

    def write(self, **event) -> None:
        self._f.write(json.dumps(event) + "\n")


class _LoopWatch:
    """Once per process: a GC callback (each collection's generation and duration) and a 10 ms timer on the serving
    event loop whose lateness shows when the loop was blocked (GC, a long callback) or not scheduled."""

    started = False

    @classmethod
    def start(cls, log: _Log) -> None:
        if cls.started:
            return
        cls.started = True
        t0 = [0.0]
        acc = {"ms": [0.0, 0.0, 0.0], "n": [0, 0, 0], "since": time.time()}

        def on_gc(phase, info):
            if phase == "start":
                t0[0] = time.perf_counter()
                return
            ms = (time.perf_counter() - t0[0]) * 1000
            g = info.get("generation", 0)
            acc["ms"][g] += ms
            acc["n"][g] += 1
            now = time.time()
            if ms >= 5:
                log.write(ev="gc", t=now, gen=g, ms=round(ms, 2))
            if now - acc["since"] >= 1:
                log.write(ev="gcsum", t=now, ms=[round(x, 2) for x in acc["ms"]], n=acc["n"])
                acc.update(ms=[0.0, 0.0, 0.0], n=[0, 0, 0], since=now)

        gc.callbacks.append(on_gc)

        async def watch():
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                late = (time.perf_counter() - t - 0.01) * 1000
                if late >= 20:
                    log.write(ev="lag", t=time.time(), ms=round(late, 1))

        asyncio.get_running_loop().create_task(watch())


class TimingMiddleware:
    """Pure ASGI middleware: arrival, first non-empty body chunk sent, last chunk sent."""

    def __init__(self, app, log: _Log | None = None):
        self.app = app
        self.log = log or _Log(os.environ.get(LOG_ENV, "/tmp/lmfleet_replica_probe.jsonl"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrival = time.time()
        _LoopWatch.start(self.log)
        first = None
        rid = None
        inner_receive = receive

        async def receive():  # noqa: F811 - reads the request id bench_gateway puts at the prompt's start
            nonlocal rid
            msg = await inner_receive()
            if rid is None and msg.get("type") == "http.request":
                m = _RID.search(msg.get("body", b"")[:4096])
                rid = int(m.group(1)) if m else -1
            return msg

        async def timed_send(msg):
            nonlocal first
            await send(msg)
            if msg["type"] == "http.response.body":
                if first is None and msg.get("body"):
                    first = time.time()
                if not msg.get("more_body", False):
                    self.log.write(ev="http", entry=scope.get(ENTRY_KEY), arrival=arrival, first_byte=first,
                                   end=time.time(), path=scope.get("path", ""), rid=rid)

        await self.app(scope, receive, timed_send)


ENTRY_KEY = "lmfleet_probe_entry"


def _patch_serve_entry() -> None:
    """Stamp each HTTP request's entry into Serve's ``Replica._direct_ingress_asgi`` (after uvicorn parsed it, before
    Serve's wrapper) in its ASGI scope; :class:`TimingMiddleware` logs it as ``entry``. Serve looks the method up
    when it starts the replica's HTTP server, after the engine (and so this module) was loaded."""
    from ray.serve._private import replica as serve_replica

    original = serve_replica.Replica._direct_ingress_asgi
    if getattr(original, "_lmfleet_probe", False):
        return

    async def stamped(self, scope, receive, send):
        if scope.get("type") == "http":
            scope[ENTRY_KEY] = time.time()
        return await original(self, scope, receive, send)

    stamped._lmfleet_probe = True
    serve_replica.Replica._direct_ingress_asgi = stamped


class TimedVLLMEngine(VLLMEngine):
    async def build_asgi_app(self):
        _patch_serve_entry()
        app = await super().build_asgi_app()
        log = _Log(os.environ.get(LOG_ENV, "/tmp/lmfleet_replica_probe.jsonl"))
        client = self._engine_client
        original = client.add_request

        async def add_request(*args, **kwargs):
            log.write(ev="add_request", t=time.time())
            return await original(*args, **kwargs)

        client.add_request = add_request
        app.middleware_stack = None  # vLLM built the stack already; Starlette rebuilds it with ours
        app.add_middleware(TimingMiddleware, log=log)
        return app

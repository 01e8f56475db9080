"""The gateway's HTTP server settings: keep-alive, a connection cap, and a deadline on each request's head.

uvicorn (0.54) has an idle keep-alive timeout and ``limit_concurrency`` but no limit on how long a client may
take to send a request's line and headers: a client that trickles one header byte a second holds a connection
(and, under ``limit_concurrency``, a slot) for ever. :func:`guarded_protocol` adds that deadline, and a cap on
the head's size, to uvicorn's own HTTP protocol class::

    uvicorn.Config(app, host=..., port=..., **uvicorn_options(fleet.gateway))
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from lmfleet.config.models import GatewayConfig

MAX_HEAD_BYTES = 64 * 1024
"""Largest request line + headers; more and the connection is closed (h11's own default is 16 KiB)."""


def _base_protocol() -> type:
    try:
        import httptools  # noqa: F401

        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # uvicorn's "auto" falls back the same way
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def guarded_protocol(header_timeout_s: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type:
    """uvicorn's HTTP protocol, closing a connection whose request head is not complete ``header_timeout_s``
    after its first byte (or after the connection opened), or that grows past ``max_head_bytes``.

    A head is complete when uvicorn has made the request's cycle (``self.cycle``): both of its parsers set it
    once the headers are in. Between requests of a kept-alive connection uvicorn's own keep-alive timer runs.
    """
    base: Any = _base_protocol()

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        _waiting_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # a new request on a kept-alive connection
            super().data_received(data)
            if self._head_timer is None:
                return
            if self.cycle is not self._waiting_cycle:
                self._disarm()  # the head is in
                return
            self._head_bytes += len(data)
            if self._head_bytes > max_head_bytes:
                self._disarm()
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._waiting_cycle = self.cycle
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is self._waiting_cycle and not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTPProtocol


def uvicorn_options(cfg: GatewayConfig) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for the gateway's limits (gateway.keep_alive_s, max_connections,
    header_timeout_s)."""
    return {"timeout_keep_alive": cfg.keep_alive_s, "limit_concurrency": cfg.max_connections,
            "http": guarded_protocol(cfg.header_timeout_s), "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


GC_THRESHOLDS = (20_000, 20, 20)
"""Collector thresholds while serving (Python's default: 700, 10, 10)."""


def quiet_gc() -> None:
    """Keep the cyclic garbage collector off the data path of a gateway process; called once, after the app is
    built and before it serves (it changes the whole process's collector settings, so the app does not call it).

    The process carries a large, long-lived heap (FastAPI, pydantic, tokenizers, Ray); with Python's default
    thresholds each request's short-lived objects trigger collections that walk it. ``gc.freeze()`` moves what
    is alive after start-up out of the collector's sight, and larger thresholds make the remaining collections
    rarer. Measured with ``benchmarks/bench_relay.py`` (64 streams): without it the gateway's P99 TTFT was
    ~350 ms instead of ~50-75 ms and its CPU per 1,000 tokens higher (docs/benchmarks.md).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)

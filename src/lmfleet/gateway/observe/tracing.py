"""OpenTelemetry spans for every request through the gateway, exported over OTLP/HTTP (protobuf).

Off by default: without ``observability.otlp_endpoint`` :func:`request_tracer` returns None and the data path
only tests ``span is None`` (no OpenTelemetry import, no allocation). On:

    lmfleet.request              POST /v1/chat/completions, from auth to the last byte of the answer
      lmfleet.upstream           one per attempt (local/MODEL or provider/NAME), to the first token or the error
      lmfleet.relay              a stream, from its first token to its end

A ``traceparent`` header from the client makes the request span a child of the caller's trace; the attempt's
span context goes upstream in a ``traceparent`` header (vLLM joins it when its own tracing is on). Spans are
batched and sent by a background thread (``BatchSpanProcessor``); a collector that is down costs dropped spans,
never a request. The tracer provider is the gateway's own, not the process-global one that Ray and vLLM may set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from lmfleet.config.redact import redact_url

log = logging.getLogger("lmfleet.gateway")

__all__ = ["RequestTracer", "request_tracer", "traces_url"]


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector: ``http://host:4318`` -> ``http://host:4318/v1/traces``."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


class RequestTracer:
    """Starts and ends the gateway's spans. Built by :func:`request_tracer`; ``exporter`` is for tests."""

    def __init__(self, endpoint: str | None, *, service_name: str = "lmfleet-gateway", sample_ratio: float = 1.0,
                 exporter: Any = None, batch: bool = True) -> None:
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            assert endpoint is not None
            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=5)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("lmfleet.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self._getter = DefaultGetter()
        self._in_context = set_span_in_context
        self._server, self._client = SpanKind.SERVER, SpanKind.CLIENT
        self._status, self._error = Status, StatusCode.ERROR

    # ---- spans ---------------------------------------------------------------------------------------------
    def start_request(self, path: str, headers: list[tuple[bytes, bytes]]) -> Any:
        """The request's span, a child of the client's ``traceparent`` when it sent one."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                   if k in (b"traceparent", b"tracestate")}
        parent = self._propagator.extract(carrier, getter=self._getter) if carrier else None
        return self.tracer.start_span("lmfleet.request", context=parent, kind=self._server,
                                      attributes={"http.request.method": "POST", "url.path": path})

    def end_request(self, span: Any, status: int, attributes: Mapping[str, Any]) -> None:
        span.set_attribute("http.response.status_code", status)
        for k, v in attributes.items():
            if v is not None:
                span.set_attribute(k, v)
        if status >= 500 or status == 499:
            span.set_status(self._status(self._error, f"HTTP {status}"))
        span.end()

    def start_attempt(self, parent: Any, backend: str, attempt: int) -> Any:
        return self.tracer.start_span("lmfleet.upstream", context=self._in_context(parent), kind=self._client,
                                      attributes={"lmfleet.backend": backend, "lmfleet.attempt": attempt})

    def end_attempt(self, span: Any, error: BaseException | None = None) -> None:
        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(self._status(self._error, str(getattr(error, "message", "")) or type(error).__name__))
        span.end()

    def start_relay(self, parent: Any) -> Any:
        return self.tracer.start_span("lmfleet.relay", context=self._in_context(parent))

    def end_relay(self, span: Any, status: int, output_tokens: int) -> None:
        span.set_attribute("lmfleet.output_tokens", output_tokens)
        if status != 200:
            span.set_attribute("http.response.status_code", status)
            span.set_status(self._status(self._error, f"stream ended with {status}"))
        span.end()

    def traceparent(self, span: Any) -> dict[str, str]:
        """The headers that carry ``span``'s context upstream."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        return carrier

    def close(self) -> None:
        """Send what is batched (a few seconds at most) and stop the exporter's thread."""
        t0 = time.monotonic()
        try:
            self.provider.shutdown()
        except Exception as e:  # a collector that is gone must not hold up a shutdown
            log.warning("tracing: spans could not be flushed at shutdown (%s)", type(e).__name__)
        if time.monotonic() - t0 > 5:
            log.warning("tracing: flushing spans took %.1f s", time.monotonic() - t0)


def request_tracer(cfg: Any) -> RequestTracer | None:
    """The tracer ``observability:`` asks for, or None (tracing off: the default)."""
    if cfg is None or not cfg.otlp_endpoint:
        return None
    log.info("tracing: OTLP spans to %s (sample ratio %g)", redact_url(traces_url(cfg.otlp_endpoint)),
             cfg.sample_ratio)
    return RequestTracer(cfg.otlp_endpoint, service_name=cfg.service_name, sample_ratio=cfg.sample_ratio)

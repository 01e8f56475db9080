"""The OpenAI-compatible gateway: one front door for every model, local engines and external providers.

The folders follow a request: the front door reads and admits it, routing decides where it may go, the relay
runs it against a backend and streams the answer back, observe records it; admin is the operator's side.
The request path, stage by stage, is :mod:`lmfleet.gateway.front.pipeline`.

The folders are layers and import only downward at run time (tests/unit/test_architecture.py)::

    build, app, admin, service  ->  front  ->  routing  ->  relay  ->  observe  ->  core

Where things are::

    build.py               build_gateway(): assembles everything below (lmfleet serve and the tests use it)
    service.py             Gateway: the assembled parts and their lifecycle (start, close)
    app.py                 create_app(): the FastAPI app that wires the routes below

    front/                 the front door: a request until it is routed
      pipeline.py          the OpenAI routes as named stages: authenticate, read, validate, admit, size, route, run
      tenancy.py           the tenant stage: model and class checks
      access.py            keys, trusted Host names, exposure checks, reading the body (415/413/408)
      validation.py        checks on OpenAI request bodies (pure)
      errors.py            error_response(): the one place errors become HTTP (the tree is core's)
      server.py            uvicorn settings: keep-alive, connection cap, request-head deadline

    routing/               where a request may go
      router.py            the routing decision: an ordered list of backends per request (+ tenant limits)
      served.py            ServedModel: a served model's backends and routing state; a request's prompt size
      backends.py          LocalBackend (a Ray Serve deployment), ProviderBackend (an external provider)
      budget.py            exact spend caps: reservations before a paid request is sent
      health.py            readiness of each model's local deployment (Serve's status, polled)
      pollers.py           vLLM's queue counts from every Ray node's metrics page
      peers.py             gateways that know about each other (shared estimates, queue shares)

    relay/                 running a request against its backends
      run.py               RequestRun: the attempt loop (retries, fallbacks), the answers, the record
      machine.py           the attempt loop's phases, events and transition function (pure)
      race.py              Race: a local attempt against overflow.policy's timer (ttft_timeout, hedge)
      stream.py            relay_stream(): the per-chunk relay of a streamed answer
      backend.py           Backend: the protocol the relay drives one attempt through, and its Ask
      localslot.py         LocalSlot: a request's place in the local priority queue; release() at the end
      replicaless.py       WaitingForReplica: local attempts moved on when Serve has no replica to hold them
      response.py          RelayResponse: a streamed answer as plain ASGI sends
      disconnect.py        DisconnectWatch: a client that leaves cancels its request
      rewrite.py           the relay's slow path over SSE bytes: usage, model name, error events (pure)
      upstream.py          the HTTP calls and the classification of upstream failures
      streamclient.py      the lean HTTP/1.1 client for streams over plain HTTP
      sse.py               server-sent events: split, read usage (pure)
      usage.py             an answer without usage: its text (pure), counted with the model's tokenizer

    observe/               what the gateway records
      recorder.py          metrics and the cost ledger of every finished request (the ledger writer)
      metrics.py           the Prometheus metrics
      tracing.py           OpenTelemetry spans per request
      loopwatch.py         the event-loop watchdog

    core/                  the types every layer shares (imports nothing of the gateway)
      errors.py            GatewayError and the Upstream* tree; error_body (OpenAI's shape)
      request.py           ParsedRequest; check_context (prompt + max_tokens within the context)
      headers.py           the provenance header names (x-lmfleet-served-by, ...)
      tokens.py            prompt token counts with the model's own tokenizer

    admin/                 the operator's side
      routes.py            every /admin/* route
      ops.py               /health, /ready, /metrics, /dashboard
      dashboard.py         the dashboard's data (readings, series, rates)
      profile.py           Profiler: vLLM's profiler on every replica, trace files, request anatomy sums
      recent_errors.py     the last warnings and errors, for the dashboard
"""

from lmfleet.gateway.build import build_gateway, load_api_keys

__all__ = ["build_gateway", "load_api_keys"]

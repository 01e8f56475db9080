"""The OpenAI-compatible gateway: one front door for every model, local engines and external providers.

Where things are::

    build.py     build_gateway(): assembles everything below (lmfleet serve and the tests use it)
    app.py       OpenAI routes, auth, errors -> HTTP
    ops.py       /health, /ready, /metrics, /admin/*
    router.py    the routing decision: an ordered list of backends per request
    run.py       one request's run: tries the backends, relays the stream, records metrics and the ledger
    backends.py  LocalBackend (a Ray Serve deployment), ProviderBackend (an external provider)
    upstream.py  the HTTP calls and the classification of upstream failures
    errors.py    the exception tree
    validation.py, tokens.py, sse.py, health.py, pollers.py, metrics.py: the parts they use
"""

from lmfleet.gateway.build import build_gateway, load_api_keys

__all__ = ["build_gateway", "load_api_keys"]

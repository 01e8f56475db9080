"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from lmfleet.testing.pg_server import PgUnavailable
from lmfleet.testing.pg_shared import shared_pg_server


@pytest.fixture
async def close_started_gateways():
    """Close every gateway that :func:`lmfleet.testing.gateway_fakes.started_client` started during the test."""
    from lmfleet.testing.gateway_fakes import STARTED_GATEWAYS

    yield
    while STARTED_GATEWAYS:
        await STARTED_GATEWAYS.pop().state.gateway.close()


@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server shared by the whole run (skips the test where none can be started)."""
    pytest.importorskip("psycopg", reason="the PostgreSQL client is missing: pip install -e '.[test]'")
    try:
        return shared_pg_server()
    except PgUnavailable as e:
        pytest.skip(f"PostgreSQL server cannot be started here: {e}")


@pytest.fixture
def driver_runtime_env(monkeypatch):
    """The Serve LLM builders' one call into a running Ray (the driver's runtime_env), answered as a fresh
    driver's, so that building an application needs no cluster (one did not start within 30 s on a busy 2-core
    machine)."""
    import types

    import ray

    if not ray.is_initialized():
        monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(runtime_env={}))

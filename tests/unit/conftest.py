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

"""One throwaway PostgreSQL per test session, shared by every test module that needs a database.

    server = shared_pg_server()       # started on first use (a few seconds), destroyed when the session ends
    url = fresh_database(server)      # a new, empty database on it: tests do not see each other's rows

Pytest fixtures of session scope are per module when a module defines them, so the modules call this
instead of starting their own server. A test that stops or restarts its server must start its own.
"""

from __future__ import annotations

import atexit
import threading
import uuid

from lmfleet.testing.pg_server import PgServer, PgUnavailable

__all__ = ["fresh_database", "shared_pg_server"]

_lock = threading.Lock()
_server: PgServer | None = None
_failure: PgUnavailable | None = None


def shared_pg_server() -> PgServer:
    """The session's server; raises ``PgUnavailable`` (every time, after the first try) when it cannot start."""
    global _server, _failure
    with _lock:
        if _failure is not None:
            raise _failure
        if _server is None:
            try:
                _server = PgServer.start()
            except PgUnavailable as e:
                _failure = e
                raise
            atexit.register(_server.destroy)
        return _server


def fresh_database(server: PgServer) -> str:
    """The URL of a new empty database on ``server``."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + "/" + name

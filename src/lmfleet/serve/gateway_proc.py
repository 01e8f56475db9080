"""Gateway processes: the HTTP server loop shared by ``lmfleet serve`` and ``lmfleet gateway``, worker processes
on one port, and ``lmfleet gateway`` itself (a gateway for a fleet another process deployed).

Several workers on one node listen on the same address with ``SO_REUSEPORT``: the kernel spreads new connections
over them, each worker has its own event loop, and they share the ledger file (``ledger.path``) and their queue
view (:mod:`lmfleet.gateway.routing.peers`); /metrics, whichever process answers, sums every process's metrics
(the first process owns their shared folder, :class:`~lmfleet.gateway.observe.metrics.SharedMetricsDir`);
breakers and cost meters are each process's own (docs/gateways.md). A worker is the same program as
``lmfleet gateway``, started by the first process with ``--workers 1 --reuse-port``; it ends when its parent does
(``PR_SET_PDEATHSIG``), and the parent stops it on shutdown (SIGTERM, then SIGKILL after the grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from lmfleet.cluster.connect import NoRayHead, connect, split_address
from lmfleet.cluster.join import present_ray_token
from lmfleet.config.models import FleetConfig
from lmfleet.engine.app import gateway_model_apps
from lmfleet.gateway import build_gateway
from lmfleet.gateway.front.access import GatewayConfigError
from lmfleet.gateway.build import check_ledger, preflight
from lmfleet.gateway.observe.metrics import SharedMetricsDir
from lmfleet.gateway.routing.fleet_watch import FleetWatch
from lmfleet.gateway.routing.live import LiveFleet
from lmfleet.gateway.routing.health import serve_status_fetcher
from lmfleet.gateway.routing.peers import PeerBoard, list_gateways, node_address
from lmfleet.gateway.routing.pollers import ray_metrics_fetcher
from lmfleet.gateway.front.server import quiet_gc, uvicorn_options
from lmfleet.store import StoreUnavailable
from lmfleet.serve.apps import DeployError, wait_until_running

log = logging.getLogger("lmfleet.serve")

WORKER_STOP_S = 15.0
WORKER_START_S = 120.0


# ---------------------------------------------------------------------------------------------
# the listening socket and the server loop
# ---------------------------------------------------------------------------------------------
def listen_socket(host: str, port: int, *, reuse_port: bool, listen: bool = True) -> socket.socket:
    """A TCP socket bound to host:port; ``reuse_port``: shared with other processes on the same port.
    ``listen=False``: bound only (the port is taken, no connection is accepted yet; uvicorn calls listen() when
    it starts serving), so a taken port fails at once instead of after minutes of waiting for the engines."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"gateway cannot listen on {host}:{port}: {e.strerror or e}") from None
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Server:
    """uvicorn.Server without its own signal handling (we own SIGINT/SIGTERM)."""

    def __new__(cls, config):
        import uvicorn

        class S(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return S(config)


class GatewayServer:
    """uvicorn serving the gateway app on an already bound socket."""

    def __init__(self, app: Any, fleet: FleetConfig, sock: socket.socket) -> None:
        import uvicorn


        self.sock = sock
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=10,
                                lifespan="on", **uvicorn_options(fleet.gateway))
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> bool:
        """Start serving; False when the server stopped at once (its error is logged)."""
        quiet_gc()  # before the app's lifespan starts the loop watchdog: this one pause is expected
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await asyncio.sleep(0.2)
        if self.task.done():
            with contextlib.suppress(BaseException):
                self.task.result()
            return False
        return True

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.task, timeout=15)
        with contextlib.suppress(OSError):
            self.sock.close()


def stop_event() -> asyncio.Event:
    """An event set on SIGINT/SIGTERM (call on the running loop)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def attach_peers(app: Any, host: str, port: int, role: str, period_s: float = 0.25) -> None:
    """Report this gateway to the cluster's registry and count the others' load (needs a connected Ray)."""
    gw = app.state.gateway
    gw.peers = PeerBoard({n: m.local.tracker for n, m in gw.models.items()}, host=host, port=port, role=role,
                         meters={n: m.local.meter for n, m in gw.models.items()}, routes=gw.models,
                         period_s=period_s)


def attach_fleet_watch(app: Any, fleet: FleetConfig,
                       follow: Callable[[int, FleetConfig], Awaitable[Any]] | None = None) -> None:
    """Follow the cluster's running-fleet version (needs a connected Ray): take each new one's live settings
    (:class:`LiveFleet`), then hand it to ``follow`` (``lmfleet serve``'s redeploys); ``/admin/state`` shows the
    version taken."""
    from lmfleet.cluster.fleet_store import FleetStore, RayKV

    gw = app.state.gateway
    store = FleetStore(RayKV())
    live = LiveFleet(fleet, gw.router, gw.providers, gw.clients, tenant_admin=app.state.tenant_admin,
                     health=gw.health, new_models=gw.new_model)

    async def take(version: int) -> None:
        stored = await asyncio.to_thread(store.read, version)
        if stored is not None:
            taken = await live.take_version(stored.fleet)
            if taken.applied:
                log.info("gateway: took version %d of the running fleet: %s", version,
                         ", ".join(c.path for c in taken.applied))
            if follow is not None:
                await follow(version, stored.fleet)

    gw.fleet_watch = FleetWatch(store.current_version, on_version=take)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed (uvicorn's own choice): the relay measured 0.3 ms less added TTFT and a few % more
    streams/s with it (benchmarks/bench_relay.py, docs/benchmarks.md); else asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# ---------------------------------------------------------------------------------------------
# worker processes
# ---------------------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux ``PR_SET_PDEATHSIG``).

    libc is loaded here, in the parent: the hook runs between fork and exec, where importing or loading a
    library could deadlock on a lock another thread held at fork time. The signal follows the *thread* that
    forked, so spawn workers from the main thread, never from ``asyncio.to_thread``."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: workers are still stopped by stop_workers
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def worker_command(config_path: Path | None, *, host: str, port: int, address: str, serve_url: str) -> list[str]:
    cmd = [sys.executable, "-m", "lmfleet.cli.main", "gateway", "--workers", "1", "--reuse-port",
           "--host", host, "--port", str(port), "--address", address, "--serve-url", serve_url, "--worker"]
    if config_path is not None:
        cmd += ["--config", str(config_path)]
    return cmd


def spawn_workers(n: int, config_path: Path | None, *, host: str, port: int, address: str,
                  serve_url: str, metrics: SharedMetricsDir | None) -> list[subprocess.Popen]:
    """Start ``n`` worker gateways on host:port (they share it with this process through SO_REUSEPORT) that write
    their metrics to ``metrics``."""
    cmd = worker_command(config_path, host=host, port=port, address=address, serve_url=serve_url)
    env = {**os.environ, "RAY_ADDRESS": address, **(metrics.env() if metrics is not None else {})}
    hook = _die_with_parent_hook()
    return [subprocess.Popen(cmd, env=env, preexec_fn=hook, stdin=subprocess.DEVNULL) for _ in range(n)]


async def wait_workers_listening(procs: list[subprocess.Popen], timeout_s: float,
                                 registered: Callable[[], set[int]],
                                 stopped: Callable[[], bool] = lambda: False) -> list[int]:
    """Wait until every worker registered itself in the cluster's registry (it does so as its server starts).
    Returns the pids that did not (dead, late, or we were told to stop)."""
    deadline = time.monotonic() + timeout_s
    pending = {p.pid for p in procs}
    while pending and time.monotonic() < deadline and not stopped():
        with contextlib.suppress(Exception):
            pending -= await asyncio.to_thread(registered)
        if pending and all(p.poll() is not None for p in procs if p.pid in pending):
            break  # every worker still missing has exited
        await asyncio.sleep(0.5)
    return sorted(pending)


def registered_pids() -> set[int]:
    """Pids of the gateways on this node that reported to the cluster's registry."""
    answer = list_gateways() or {"gateways": []}
    node = node_address()
    return {int(g.get("pid", -1)) for g in answer["gateways"] if g.get("node") == node}


def stop_workers(procs: list[subprocess.Popen], grace_s: float = WORKER_STOP_S,
                 metrics: SharedMetricsDir | None = None) -> int:
    """SIGTERM every worker, wait for them to drain, SIGKILL what is left, and drop their live gauges from
    ``metrics``. Returns how many had to be killed."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    killed = 0
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed += 1
        if metrics is not None:
            metrics.worker_gone(p.pid)
    return killed


def forget_ended_workers(procs: list[subprocess.Popen], metrics: SharedMetricsDir, forgotten: set[int]) -> None:
    """Drop the live gauges of workers that ended (crashed, killed) since the last call; ``forgotten``: their pids."""
    for p in procs:
        if p.pid not in forgotten and p.poll() is not None:
            metrics.worker_gone(p.pid)
            forgotten.add(p.pid)


async def watch_workers(procs: list[subprocess.Popen], metrics: SharedMetricsDir | None,
                        period_s: float = 5.0) -> None:
    """Until cancelled: a worker that ends before shutdown stops counting in the node's live gauges."""
    if metrics is None:
        return
    forgotten: set[int] = set()
    while True:
        forget_ended_workers(procs, metrics, forgotten)
        await asyncio.sleep(period_s)


def shared_metrics(workers: int) -> SharedMetricsDir | None:
    """The metrics folder of ``workers`` gateway processes, this one included: call it in the process that starts
    the others, before it builds its own gateway. None for a single process (in-process metrics: no files)."""
    if workers <= 1:
        return None
    metrics = SharedMetricsDir()
    metrics.use_here()
    return metrics


# ---------------------------------------------------------------------------------------------
# lmfleet gateway
# ---------------------------------------------------------------------------------------------
LOOPBACK = "127.0.0.1"


def local_addresses() -> set[str]:
    """This machine's own IP addresses (and ``localhost``)."""
    out = {"localhost", LOOPBACK, "::1"}
    with contextlib.suppress(Exception):
        import psutil

        for addrs in psutil.net_if_addrs().values():
            out.update(a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return out


def default_serve_url(serve_port: int, head_host: str | None, local: set[str]) -> str:
    """Serve's HTTP proxy runs on the head node. On the head itself use loopback: a local head's proxy listens
    there only. Elsewhere the head's address (its proxy must then listen on an interface other nodes reach)."""
    host = LOOPBACK if head_host is None or head_host in local else head_host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{serve_port}"


def run_gateway(fleet: FleetConfig, *, config_path: Path | None, host: str, port: int, address: str | None,
                serve_url: str | None, workers: int, reuse_port: bool = False, worker: bool = False,
                wait_timeout_s: float = 900.0, progress: Callable[[str], None] = print) -> int:
    """Run a gateway (and ``workers - 1`` more on the same port) for a fleet deployed by ``lmfleet serve``
    elsewhere in the cluster. ``address``: the Ray head (None: the cluster running on this machine). Returns the
    exit code: 0 after SIGINT/SIGTERM, 1 (no cluster, port taken, apps failed, ledger database unreachable),
    2 (settings that would leave it open), 130 (interrupted while starting)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    procs: list[subprocess.Popen] = []
    reuse_port = reuse_port or workers > 1
    metrics: SharedMetricsDir | None = None
    try:
        preflight(fleet, host)
        check_ledger(fleet)
        sock = listen_socket(host, port, reuse_port=reuse_port, listen=False)
        apps = gateway_model_apps(fleet, progress=progress if not worker else (lambda s: None))
        present_ray_token()
        try:
            connect(address or "auto", logging_level=logging.WARNING, configure_logging=True)
        except NoRayHead:  # names the address already
            raise
        except ConnectionError as e:
            raise ConnectionError(f"cannot join the Ray cluster at {address or 'auto (this machine)'}: {e}") from None
        import ray

        gcs = ray.get_runtime_context().gcs_address
        hp = split_address(gcs)
        url = serve_url or default_serve_url(fleet.gateway.serve_port, hp[0] if hp else None, local_addresses())
        if not worker:
            progress(f"lmfleet: gateway: joined the Ray cluster at {gcs}; models through Serve at {url}")
            metrics = shared_metrics(workers)  # after Ray is joined: no Ray process inherits the folder
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(_gateway_main(fleet, apps, sock, config_path=config_path, host=host, port=port,
                                            gcs=gcs, serve_url=url, workers=workers, worker=worker,
                                            wait_timeout_s=wait_timeout_s, progress=progress, procs=procs,
                                            metrics=metrics))
    except KeyboardInterrupt:
        return 130
    except GatewayConfigError as e:
        progress(f"lmfleet: error: {e}")
        return 2
    except StoreUnavailable as e:  # the ledger's database: at start, or gone by the time the gateway is built
        progress(f"lmfleet: error: {e} (check ledger.path / ledger.url and that the database is up)")
        return 1
    except (OSError, RuntimeError) as e:  # ConnectionError is an OSError
        progress(f"lmfleet: error: {e}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if procs:
            stop_workers(procs, metrics=metrics)
        if metrics is not None:
            metrics.close()
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


async def _gateway_main(fleet: FleetConfig, apps: list[Any], sock: socket.socket, *, config_path: Path | None,
                        host: str, port: int, gcs: str, serve_url: str, workers: int, worker: bool,
                        wait_timeout_s: float, progress: Callable[[str], None],
                        procs: list[subprocess.Popen], metrics: SharedMetricsDir | None) -> int:
    stop = stop_event()
    waiting = asyncio.create_task(asyncio.to_thread(
        wait_until_running, {a.name: a.app_name for a in apps}, wait_timeout_s,
        progress if not worker else (lambda s: None), stop.is_set))
    try:
        await waiting
    except DeployError as e:
        progress(f"lmfleet: error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    app = build_gateway(fleet, apps, serve_url=serve_url, host=host, fetch_status=serve_status_fetcher(),
                        fetch_engine_metrics=ray_metrics_fetcher())
    app.state.gateway.health.refresh_from(await asyncio.to_thread(serve_status_fetcher()))
    attach_peers(app, host, port, role="worker" if worker else "gateway", period_s=fleet.gateway.peers_period_s)
    attach_fleet_watch(app, fleet)
    server = GatewayServer(app, fleet, sock)
    if not await server.start():
        progress(f"lmfleet: error: the gateway on {host}:{port} stopped at once")
        return 1
    if not worker:
        if workers > 1:
            procs.extend(spawn_workers(workers - 1, config_path, host=host, port=port, address=gcs,
                                       serve_url=serve_url, metrics=metrics))
            late = await wait_workers_listening(procs, WORKER_START_S, registered_pids)
            if late:
                progress(f"lmfleet: warning: gateway worker(s) {late} not up after {WORKER_START_S:.0f} s")
        progress(f"lmfleet: gateway ready at http://{host}:{port}/v1 (pid {os.getpid()}, {workers} worker "
                 f"process(es)) serving: {', '.join(a.name for a in apps)}")
    watcher = asyncio.create_task(watch_workers(procs, metrics))
    await stop.wait()
    watcher.cancel()
    if not worker:
        progress("lmfleet: gateway shutting down...")
    await server.stop()
    return 0

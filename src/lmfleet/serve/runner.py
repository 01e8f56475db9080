"""``lmfleet serve``: connect to (or start) Ray, deploy every model on Ray Serve, run the gateway.

Lifecycle, in order::

    ray = connect_or_start()            # join --address / RAY_ADDRESS / cluster.address, else a local head
    apps = deploy(fleet)                # one Serve LLM application per model, started in parallel
    gateway listens at once (/health, /ready report progress); "ready" banner once every model runs
    gateway.workers > 1: that many - 1 more gateway processes on the same port (lmfleet.serve.gateway_proc),
                         all writing their metrics to one folder this process owns (/metrics sums them)
    SIGINT/SIGTERM -> gateways drain (workers: SIGTERM, SIGKILL after 15 s) -> metrics folder removed
                   -> our Serve apps deleted
                   -> Ray stopped if we started it
                   -> any process we started that is still alive is terminated, then killed

The last step exists because vLLM engine processes and Ray agents can outlive their parents.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmfleet import ray_private
from lmfleet.cluster.connect import LocalHead, connect, resolve_ray_address
from lmfleet.cluster.fleet_store import FleetStore, RayKV
from lmfleet.config.models import FleetConfig
from lmfleet.engine.app import bind_app, build_model_apps
from lmfleet.gateway import build_gateway
from lmfleet.gateway.front.access import GatewayConfigError
from lmfleet.gateway.build import check_ledger, preflight
from lmfleet.gateway.observe.metrics import SharedMetricsDir
from lmfleet.gateway.routing.health import serve_status_fetcher
from lmfleet.gateway.routing.pollers import ray_metrics_fetcher
from lmfleet.overflow.engine_stats import metrics_env
from lmfleet.store import StoreUnavailable
from lmfleet.serve.apps import DeployError, app_states, wait_until_running
from lmfleet.serve.gateway_proc import (
    GatewayServer,
    WORKER_START_S,
    attach_fleet_watch,
    attach_peers,
    listen_socket,
    loop_factory,
    registered_pids,
    shared_metrics,
    spawn_workers,
    stop_event,
    stop_workers,
    wait_workers_listening,
    watch_workers,
)
from lmfleet.serve.processes import ProcessReaper
from lmfleet.serve.rollout import ServeFollower
from lmfleet.serve.timing import Phases
from lmfleet.serve.proxy import (
    ProxyError,
    apply_env,
    check_haproxy,
    effective_env,
    end_node_haproxies,
    free_ports,
    haproxy_error,
    port_in_use,
    remove_node_files,
    serve_env,
    serve_http_host,
    uses_haproxy,
    wait_listening,
)

__all__ = ["DeployError", "app_states", "run_serve", "wait_until_running"]

log = logging.getLogger("lmfleet.serve")


HAPROXY_START_S = 90.0  # Serve's HAProxyManager starts HAProxy within seconds; a loaded 2-core machine is slower


# ---------------------------------------------------------------------------------------------
# Ray and Serve
# ---------------------------------------------------------------------------------------------
def ray_address(fleet: FleetConfig, cli_address: str | None) -> str | None:
    return resolve_ray_address(cli_address, fleet)


def prepare_serve_proxy(fleet: FleetConfig) -> None:
    """Set Ray Serve's proxy switches before anything imports Ray Serve (it reads them at import time);
    in HAProxy mode, fail now with one line if HAProxy cannot run."""
    apply_env(serve_env(fleet), os.environ)
    if uses_haproxy(fleet):
        try:
            check_haproxy()
        except ProxyError as e:
            raise DeployError(str(e)) from None


def connect_ray(fleet: FleetConfig, address: str | None, *, verbose: bool = False) -> bool:
    """Join the cluster at ``address`` or start a local head. Returns True when we started Ray.

    ``verbose``: the engines' and Ray's own log lines are copied to this terminal (else they stay in Ray's log
    folder, :func:`ray_logs_dir`)."""
    quiet = dict(logging_level=logging.INFO if verbose else logging.WARNING, configure_logging=True,
                 log_to_driver=verbose)
    # to the engines' replicas only (the job's runtime_env): the nodes' metrics agents keep Ray's default interval,
    # and with it their 20-s hold on a gauge that a busy replica exports late (at 1 s they would drop it after 2 s)
    engines = effective_env(metrics_env(), os.environ)
    if address:
        return connect(address, env_vars=effective_env(serve_env(fleet), os.environ) | engines, **quiet)
    cpus = fleet.cluster.num_cpus or max(8, os.cpu_count() or 1)
    # our own HAProxy side ports: Ray's fixed defaults (8404, 9101, 8500) collide between fleets on one machine
    # (never the gateway's configured ports: the serve port is bound by the same HAProxy, later)
    side = free_ports(frozenset({fleet.gateway.port, fleet.gateway.serve_port})) if uses_haproxy(fleet) else None
    env = effective_env(serve_env(fleet, side), os.environ)
    return connect(None, local=LocalHead(num_cpus=cpus, env=env), env_vars=engines, **quiet)


def ray_logs_dir() -> str | None:
    """This node's Ray log folder for the connected session (the engines' logs are under it), if known."""
    try:
        return ray_private.ray_logs_dir()
    except Exception:  # a private API: a Ray that moved it costs the hint, nothing else
        return None


def start_serve(fleet: FleetConfig, *, local_head: bool = True) -> None:
    """Start Serve with its proxy (HAProxy or Serve's own, per gateway.serve_proxy) on serve_port of the head."""
    from ray import serve


    if ray_private.serve_haproxy_enabled() != uses_haproxy(fleet):
        raise DeployError("Ray Serve was imported before lmfleet set RAY_SERVE_ENABLE_HA_PROXY; "
                          f"gateway.serve_proxy={fleet.gateway.serve_proxy!r} cannot take effect")
    port = fleet.gateway.serve_port
    host = serve_http_host(fleet, local_head=local_head)
    if host != "127.0.0.1":
        log.warning("HAProxy mode on a joined cluster: Serve's port %s and replica ports listen on all interfaces "
                    "without auth; firewall them (docs/multinode.md)", port)
    if local_head and port_in_use("127.0.0.1", port):
        raise DeployError(f"gateway.serve_port {port} is already in use on 127.0.0.1; choose another port")
    from ray.exceptions import RayError

    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port},
                    controller_options={"runtime_env": {"env_vars": effective_env(serve_env(fleet), os.environ)}})
    except RayError as e:  # e.g. Serve gave up on its proxy actor on a machine too loaded to start it in time
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DeployError(f"Ray Serve did not start ({type(e).__name__}: {first}); see Ray's serve logs") from None


def check_serve_proxy(fleet: FleetConfig, *, local_head: bool) -> None:
    """On a local head in HAProxy mode, wait until HAProxy listens on serve_port (it starts while engines load)."""
    port = fleet.gateway.serve_port
    if local_head and uses_haproxy(fleet) and not wait_listening("127.0.0.1", port, HAPROXY_START_S):
        raise DeployError(haproxy_error(f"nothing listens on 127.0.0.1:{port} {HAPROXY_START_S:.0f} s after Serve "
                                        "started (HAProxy's stderr: /tmp/haproxy-serve/<node id>/*.stderr.log)"))


def deploy(apps: list[Any]) -> None:
    from ray import serve
    from ray.serve.api import RunTarget


    from ray.serve.exceptions import RayServeException

    try:
        serve.run_many([RunTarget(bind_app(a), name=a.app_name, route_prefix=a.route_prefix) for a in apps],
                       wait_for_applications_running=False)
    except (RayServeException, ValueError) as e:  # Ray Serve (LLM) refused the application as built
        raise DeployError(f"Ray Serve refused the deployment of {[a.name for a in apps]}: {e}") from None


def deploy_into(apps: list[Any], more: list[Any]) -> None:
    """Deploy ``more`` (a new fleet version's models) and keep ``apps``, what this process tears down, current."""
    deploy(more)
    names = {a.name for a in more}
    apps[:] = [a for a in apps if a.name not in names] + list(more)


def delete_apps(app_names: list[str]) -> None:
    """Delete Serve applications (a removed model's): each waits for its replicas' graceful stop."""
    from ray import serve

    for name in app_names:
        serve.delete(name)


# ---------------------------------------------------------------------------------------------
# the gateway (assembled by lmfleet.gateway.build_gateway)
# ---------------------------------------------------------------------------------------------
async def _run(fleet: FleetConfig, apps: list[Any], host: str, port: int, progress: Callable[[str], None],
               deploy_timeout_s: float, workers: int, config_path: Path | None,
               procs: list[subprocess.Popen], phases: Phases, metrics: SharedMetricsDir | None) -> int:
    stop = stop_event()
    serve_url = f"http://127.0.0.1:{fleet.gateway.serve_port}"
    app = build_gateway(fleet, apps, serve_url=serve_url, host=host,
                        fetch_status=serve_status_fetcher(), fetch_engine_metrics=ray_metrics_fetcher())
    health = app.state.gateway.health
    attach_peers(app, host, port, role="serve", period_s=fleet.gateway.peers_period_s)
    follower = ServeFollower(fleet, lambda f: build_model_apps(f, progress=progress),
                             lambda more: deploy_into(apps, more), progress, delete=delete_apps,
                             models=app.state.gateway.models)
    attach_fleet_watch(app, fleet, follow=follower.follow)  # `lmfleet apply`: settings here, redeploys by follower
    try:
        sock = listen_socket(host, port, reuse_port=workers > 1)
    except OSError as e:
        raise DeployError(str(e)) from None
    server = GatewayServer(app, fleet, sock)
    if not await server.start():
        progress(f"lmfleet: error: the gateway on {host}:{port} stopped at once (see the log above)")
        return 1
    server_task = server.task
    url = f"http://{host}:{port}"
    progress(f"lmfleet: gateway listening on {url} (not ready until the engines are up; see {url}/ready)")

    engines_from = time.monotonic()
    wait = asyncio.create_task(asyncio.to_thread(
        wait_until_running, {a.name: a.app_name for a in apps}, deploy_timeout_s, progress, stop.is_set))
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({wait, stopper, server_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    watcher: asyncio.Task | None = None
    if wait in done:
        exc = wait.exception()
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            progress(f"lmfleet: error: {exc}")
            code = 1
        elif exc is None:
            phases.add("engines", time.monotonic() - engines_from)
            health.refresh_from(await asyncio.to_thread(serve_status_fetcher()))
            names = ", ".join(a.name for a in apps)
            progress(phases.line())
            progress(f"lmfleet: ready. OpenAI-compatible API at {url}/v1 serving: {names}")
            progress(f"lmfleet: try  curl {url}/v1/chat/completions -H 'content-type: application/json' "
                     f"-d '{{\"model\": \"{apps[0].name}\", \"messages\": [{{\"role\": \"user\", "
                     f"\"content\": \"What is the capital of France?\"}}]}}'")
            if workers > 1:
                import ray

                procs.extend(spawn_workers(workers - 1, config_path, host=host, port=port,
                                           address=ray.get_runtime_context().gcs_address, serve_url=serve_url,
                                           metrics=metrics))
                late = await wait_workers_listening(procs, WORKER_START_S, registered_pids, stop.is_set)
                watcher = asyncio.create_task(watch_workers(procs, metrics))
                up = workers - len(late)
                progress(f"lmfleet: {up} of {workers} gateway processes serve {url}"
                         + (f" (pids {late} not up after {WORKER_START_S:.0f} s)" if late else ""))
            conf = f" -c {config_path}" if config_path else ""
            progress(f"lmfleet: more gateways for this fleet, on any node of the cluster: lmfleet gateway{conf} "
                     f"--address {_gcs_address()} --port <port>")
            progress("lmfleet: Ctrl-C stops everything")
            done, _ = await asyncio.wait({stopper, server_task}, return_when=asyncio.FIRST_COMPLETED)
    if server_task in done and server_task.exception() is not None:
        progress(f"lmfleet: gateway failed: {server_task.exception()}")
        code = 1
    progress("lmfleet: shutting down...")
    if procs:  # the workers drain alongside this process
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
    await server.stop()
    stopper.cancel()
    if watcher is not None:
        watcher.cancel()
    if not wait.done():
        stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(wait, timeout=5)
    return code


def _gcs_address() -> str:
    import ray

    with contextlib.suppress(Exception):
        return ray.get_runtime_context().gcs_address
    return "<the head's HOST:PORT>"


def run_serve(fleet: FleetConfig, *, host: str, port: int, address: str | None,
              deploy_timeout_s: float = 900.0, progress: Callable[[str], None] = print,
              workers: int | None = None, config_path: Path | None = None, verbose: bool = False,
              phases: Phases | None = None) -> int:
    """Run the whole fleet until SIGINT/SIGTERM. Returns the process exit code.

    ``workers`` (default ``gateway.workers``): gateway processes on host:port; the extra ones are started after
    the ready banner (``lmfleet gateway --worker``, re-reading ``config_path``) and stopped before the teardown.
    ``phases``: where start-up time goes (the ready line names each step)."""

    workers = workers or fleet.gateway.workers
    phases = phases or Phases()
    config_path = config_path.resolve() if config_path else None  # workers and the hint below: any cwd
    procs: list[subprocess.Popen] = []
    metrics: SharedMetricsDir | None = None
    reaper = ProcessReaper()
    started_ray = False
    apps: list[Any] = []
    code = 1
    # a second Ctrl-C during start-up must still clean up, so SIGTERM behaves like SIGINT until the loop runs
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        preflight(fleet, host)  # a gateway that could not start must not cost minutes of deploying first
        check_ledger(fleet)
        prepare_serve_proxy(fleet)
        with phases.step("imports"):  # Ray Serve LLM (and vLLM under it): tens of seconds on a small machine
            import ray.serve.llm  # noqa: F401
        with phases.step("model"):
            apps = build_model_apps(fleet, progress=progress)
        addr = ray_address(fleet, address)
        progress(f"lmfleet: {'joining Ray cluster at ' + addr if addr else 'starting a local Ray head'}...")
        with phases.step("Ray"):
            try:
                started_ray = connect_ray(fleet, addr, verbose=verbose)
            except ConnectionError as e:  # nothing answers at the address given
                raise DeployError(str(e)) from None
        logs = ray_logs_dir()
        if logs and not verbose:
            progress(f"lmfleet: engine and Ray logs go to {logs} (--verbose shows them here)")
        reaper.snapshot()
        serve_from = time.monotonic()
        start_serve(fleet, local_head=started_ray)
        progress(f"lmfleet: Ray Serve's HTTP proxy on port {fleet.gateway.serve_port}: "
                 f"{'HAProxy (direct streaming)' if fleet.gateway.serve_proxy == 'haproxy' else 'Serve proxy'}")
        progress(f"lmfleet: deploying {len(apps)} model(s) on Ray Serve: {', '.join(a.name for a in apps)}")
        deploy(apps)
        phases.add("Serve", time.monotonic() - serve_from)
        stored = FleetStore(RayKV()).publish(fleet, source=f"serve {config_path or 'the embedded default fleet'}")
        progress(f"lmfleet: the cluster's running fleet is version {stored.version} (`lmfleet apply` compares with it)")
        check_serve_proxy(fleet, local_head=started_ray)
        reaper.snapshot()
        metrics = shared_metrics(workers)  # after Ray and Serve started: none of their processes inherits it
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            code = runner.run(_run(fleet, apps, host, port, progress, deploy_timeout_s, workers, config_path, procs,
                                   phases, metrics))
    except KeyboardInterrupt:
        progress("lmfleet: interrupted")
        code = 130
    except DeployError as e:
        progress(f"lmfleet: error: {e}")
        code = 1
    except GatewayConfigError as e:  # settings that would leave the gateway open
        progress(f"lmfleet: error: {e}")
        code = 2
    except StoreUnavailable as e:  # the ledger's database: at start, or gone by the time the gateway is built
        progress(f"lmfleet: error: {e} (check ledger.path / ledger.url and that the database is up)")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup must finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if procs:
            n = stop_workers(procs, metrics=metrics)
            if n:
                progress(f"lmfleet: killed {n} gateway worker(s) that did not stop in time")
        if metrics is not None:
            metrics.close()
        reaper.snapshot()
        _teardown(apps, started_ray, progress)
        n = reaper.reap()
        if n:
            progress(f"lmfleet: ended {n} leftover process(es) started by this run")
        progress("lmfleet: stopped")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return code


def _teardown(apps: list[Any], started_ray: bool, progress: Callable[[str], None]) -> None:
    try:
        import ray
        from ray import serve
    except ImportError:
        return
    if not ray.is_initialized():
        return
    node_id = None
    if started_ray:
        with contextlib.suppress(Exception):
            node_id = ray.get_runtime_context().get_node_id()
    try:
        if started_ray:
            serve.shutdown()
        else:
            for a in apps:
                with contextlib.suppress(Exception):
                    serve.delete(a.app_name)
    except Exception as e:
        progress(f"lmfleet: warning: Serve shutdown: {e}")
    with contextlib.suppress(Exception):
        ray.shutdown()
    if node_id:
        # HAProxy reloads spawn new processes; one started during shutdown can outlive its manager actor
        n = end_node_haproxies(node_id)
        if n:
            progress(f"lmfleet: ended {n} HAProxy process(es) left by Ray Serve")
        remove_node_files(node_id)
    sys.stdout.flush()

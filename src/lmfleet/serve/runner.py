"""``lmfleet serve``: connect to (or start) Ray, deploy every model on Ray Serve, run the gateway.

Lifecycle, in order::

    ray = connect_or_start()            # join --address / RAY_ADDRESS / cluster.address, else a local head
    apps = deploy(fleet)                # one Serve LLM application per model, started in parallel
    gateway listens at once (/health, /ready report progress); "ready" banner once every model runs
    SIGINT/SIGTERM -> gateway drains -> our Serve apps deleted -> Ray stopped if we started it
                   -> any process we started that is still alive is terminated, then killed

The last step exists because vLLM engine processes and Ray agents can outlive their parents.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from lmfleet.config.models import FleetConfig

log = logging.getLogger("lmfleet.serve")


class DeployError(RuntimeError):
    """A model's deployment failed; the message says which and why."""


# ---------------------------------------------------------------------------------------------
# processes we own
# ---------------------------------------------------------------------------------------------
@dataclass
class ProcessReaper:
    """Remembers every descendant process seen, and ends the survivors at shutdown (by pid)."""

    seen: dict[int, float] = field(default_factory=dict)  # pid -> create_time (guards pid reuse)

    def snapshot(self) -> None:
        try:
            for p in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(p.pid, p.create_time())
        except psutil.Error:
            pass

    def alive(self) -> list[psutil.Process]:
        out = []
        for pid, created in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def reap(self, grace_s: float = 5.0) -> int:
        self.snapshot()
        procs = self.alive()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, still = psutil.wait_procs(procs, timeout=grace_s)
        for p in still:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(still, timeout=grace_s)
        return len(procs)


# ---------------------------------------------------------------------------------------------
# Ray and Serve
# ---------------------------------------------------------------------------------------------
def ray_address(fleet: FleetConfig, cli_address: str | None) -> str | None:
    return cli_address or os.environ.get("RAY_ADDRESS") or fleet.cluster.address


def connect_ray(fleet: FleetConfig, address: str | None) -> bool:
    """Join the cluster at ``address`` or start a local head. Returns True when we started Ray."""
    import ray

    quiet = dict(log_to_driver=False, logging_level=logging.WARNING, configure_logging=True)
    if address:
        ray.init(address=address, **quiet)
        return False
    cpus = fleet.cluster.num_cpus or max(8, os.cpu_count() or 1)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=512 * 1024**2, **quiet)
    return True


def start_serve(fleet: FleetConfig) -> None:
    from ray import serve

    serve.start(proxy_location="HeadOnly",
                http_options={"host": "127.0.0.1", "port": fleet.gateway.serve_port})


def deploy(apps: list[Any]) -> None:
    from ray import serve
    from ray.serve.api import RunTarget

    from lmfleet.engine.app import bind_app

    from ray.serve.exceptions import RayServeException

    try:
        serve.run_many([RunTarget(bind_app(a), name=a.app_name, route_prefix=a.route_prefix) for a in apps],
                       wait_for_applications_running=False)
    except (RayServeException, ValueError) as e:  # Ray Serve (LLM) refused the application as built
        raise DeployError(f"Ray Serve refused the deployment of {[a.name for a in apps]}: {e}") from None


def app_states(app_names: list[str]) -> dict[str, tuple[str, str]]:
    """Serve application name -> (status, message)."""
    from ray import serve

    st = serve.status().applications
    out = {}
    for name in app_names:
        a = st.get(name)
        if a is None:
            out[name] = ("NOT_STARTED", "")
            continue
        msgs = [a.message] + [f"{d}: {o.message}" for d, o in a.deployments.items() if o.message]
        out[name] = (str(getattr(a.status, "value", a.status)), "\n".join(m for m in msgs if m))
    return out


def wait_until_running(app_names: dict[str, str], timeout_s: float, progress: Callable[[str], None],
                       stop: Callable[[], bool]) -> None:
    """Block until every app is RUNNING; raise DeployError on failure or timeout. ``app_names``: model -> app."""
    t0 = time.monotonic()
    last, last_at = "", 0.0
    while True:
        states = app_states(list(app_names.values()))
        failed = {m: states[a] for m, a in app_names.items() if states[a][0] == "DEPLOY_FAILED"}
        if failed:
            detail = "\n".join(f"  {m}: {msg[-3000:]}" for m, (_, msg) in failed.items())
            raise DeployError(f"deployment failed for {sorted(failed)}:\n{detail}")
        if all(states[a][0] == "RUNNING" for a in app_names.values()):
            return
        line = ", ".join(f"{m}: {states[a][0].lower()}" for m, a in app_names.items())
        elapsed = time.monotonic() - t0
        if line != last or elapsed - last_at >= 15:
            progress(f"lmfleet: [{elapsed:5.0f} s] waiting for engines ({line})")
            last, last_at = line, elapsed
        if elapsed > timeout_s:
            raise DeployError(f"models not running after {timeout_s:.0f} s ({line}); see Ray's serve logs")
        if stop():
            raise KeyboardInterrupt
        time.sleep(1.0)


def model_max_len(model_cfg, model_path: str) -> int | None:
    if model_cfg.engine.max_model_len:
        return model_cfg.engine.max_model_len
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        return cfg.get("max_position_embeddings")
    return None


# ---------------------------------------------------------------------------------------------
# the gateway
# ---------------------------------------------------------------------------------------------
def build_router(fleet: FleetConfig, apps: list[Any], serve_url: str, fetch_status, environ: dict[str, str]):
    import httpx

    from lmfleet.engine.app import engine_device
    from lmfleet.gateway.health import HealthBoard
    from lmfleet.gateway.metrics import GatewayMetrics
    from lmfleet.gateway.router import LocalModel, Provider, Router
    from lmfleet.gateway.tokens import load_tokenizer
    from lmfleet.overflow import CircuitBreaker, Ledger, LoadTracker, LocalCostMeter, local_capacity

    models = {}
    for a in apps:
        mc = fleet.model(a.name)
        cap = local_capacity(mc)
        uses_gpus = engine_device(mc) == "gpu"
        models[a.name] = LocalModel(
            cfg=mc, base_url=f"{serve_url}{a.route_prefix}/v1", max_model_len=model_max_len(mc, a.model_path),
            tokenizer=load_tokenizer(a.tokenizer_path),
            tracker=LoadTracker(cap, window_s=mc.overflow.signal_window_s), capacity=cap,
            meter=LocalCostMeter.for_model(mc, uses_gpus=uses_gpus), threshold_ms=mc.overflow.threshold_ms)
    providers = {}
    for p in fleet.providers:
        key = environ.get(p.api_key_env) if p.api_key_env else None
        if p.api_key_env and not key:
            log.warning("provider %s: environment variable %s is not set; sending no API key", p.name, p.api_key_env)
        limits = httpx.Limits(max_connections=p.max_concurrency or 1000, max_keepalive_connections=100)
        client = httpx.AsyncClient(timeout=httpx.Timeout(p.timeouts.total_s, connect=p.timeouts.connect_s),
                                   limits=limits)
        providers[p.name] = Provider(p, client, {"authorization": f"Bearer {key}"} if key else {},
                                     CircuitBreaker.from_config(p.breaker))
    local_client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                     limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))
    health = HealthBoard({a.name: a.app_name for a in apps}, fetch_status, fleet.gateway.health_poll_s)
    path = Path(fleet.ledger.path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(path)
    return Router(fleet, models, providers, local_client, health, GatewayMetrics(), ledger)


class _Server:
    """uvicorn.Server without its own signal handling (we own SIGINT/SIGTERM)."""

    def __new__(cls, config):
        import uvicorn

        class S(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return S(config)


async def _run(fleet: FleetConfig, apps: list[Any], host: str, port: int, started_ray: bool,
               progress: Callable[[str], None], deploy_timeout_s: float) -> int:
    import uvicorn

    from lmfleet.gateway.app import create_app, load_api_keys
    from lmfleet.gateway.health import serve_status_fetcher

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    serve_url = f"http://127.0.0.1:{fleet.gateway.serve_port}"
    router = build_router(fleet, apps, serve_url, serve_status_fetcher(), dict(os.environ))
    if fleet.gateway.engine_metrics_poll_s > 0:
        from lmfleet.overflow.engine_stats import EngineStatsPoller, ray_metrics_fetcher

        router.engine_stats = EngineStatsPoller({n: m.tracker for n, m in router.models.items()},
                                                ray_metrics_fetcher(), fleet.gateway.engine_metrics_poll_s)
    admin_key = os.environ.get(fleet.gateway.admin_key_env) if fleet.gateway.admin_key_env else None
    app = create_app(router, api_keys=load_api_keys(fleet.gateway, dict(os.environ)), admin_key=admin_key)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=10, lifespan="on")
    server = _Server(config)
    server_task = asyncio.create_task(server.serve())
    await asyncio.sleep(0.2)
    if server_task.done():
        server_task.result()
        return 1
    url = f"http://{host}:{port}"
    progress(f"lmfleet: gateway listening on {url} (not ready until the engines are up; see {url}/ready)")

    wait = asyncio.create_task(asyncio.to_thread(
        wait_until_running, {a.name: a.app_name for a in apps}, deploy_timeout_s, progress, stop.is_set))
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({wait, stopper, server_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if wait in done:
        exc = wait.exception()
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            progress(f"lmfleet: error: {exc}")
            code = 1
        elif exc is None:
            router.health.refresh_from(await asyncio.to_thread(serve_status_fetcher()))
            names = ", ".join(a.name for a in apps)
            progress(f"lmfleet: ready. OpenAI-compatible API at {url}/v1 serving: {names}")
            progress(f"lmfleet: try  curl {url}/v1/chat/completions -H 'content-type: application/json' "
                     f"-d '{{\"model\": \"{apps[0].name}\", \"messages\": [{{\"role\": \"user\", "
                     f"\"content\": \"What is the capital of France?\"}}]}}'")
            progress("lmfleet: Ctrl-C stops everything")
            done, _ = await asyncio.wait({stopper, server_task}, return_when=asyncio.FIRST_COMPLETED)
    if server_task in done and server_task.exception() is not None:
        progress(f"lmfleet: gateway failed: {server_task.exception()}")
        code = 1
    progress("lmfleet: shutting down...")
    server.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(server_task, timeout=15)
    stopper.cancel()
    if not wait.done():
        stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(wait, timeout=5)
    return code


def run_serve(fleet: FleetConfig, *, host: str, port: int, address: str | None,
              deploy_timeout_s: float = 900.0, progress: Callable[[str], None] = print) -> int:
    """Run the whole fleet until SIGINT/SIGTERM. Returns the process exit code."""
    from lmfleet.engine.app import build_model_apps

    reaper = ProcessReaper()
    started_ray = False
    apps: list[Any] = []
    code = 1
    # a second Ctrl-C during start-up must still clean up, so SIGTERM behaves like SIGINT until the loop runs
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        apps = build_model_apps(fleet, progress=progress)
        addr = ray_address(fleet, address)
        progress(f"lmfleet: {'joining Ray cluster at ' + addr if addr else 'starting a local Ray head'}...")
        started_ray = connect_ray(fleet, addr)
        reaper.snapshot()
        start_serve(fleet)
        progress(f"lmfleet: deploying {len(apps)} model(s) on Ray Serve: {', '.join(a.name for a in apps)}")
        deploy(apps)
        reaper.snapshot()
        code = asyncio.run(_run(fleet, apps, host, port, started_ray, progress, deploy_timeout_s))
    except KeyboardInterrupt:
        progress("lmfleet: interrupted")
        code = 130
    except DeployError as e:
        progress(f"lmfleet: error: {e}")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup must finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    sys.stdout.flush()

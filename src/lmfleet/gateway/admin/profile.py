"""The gateway's profiling routes (admin key; the auth middleware guards every /admin/* path).

    GET  /admin/profile/snapshot     histogram sums for the request anatomy: this gateway process's phases and
                                     every engine's (Ray's metrics pages)
    POST /admin/profile/start        {"models": [..] | null}: start vLLM's profiler on every replica
    POST /admin/profile/stop         {"session", "models", "window_s"}: stop it, gather the trace files from every
                                     node into this node's cache (<cache>/profiles/<session>/), list them
    GET  /admin/profile/files/<session>/<model>/<node>/<name>   one gathered file

Stop carries everything start returned, so a fleet with several gateway processes may answer the two calls in
different processes (they share the node's cache folder).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import FileResponse

from lmfleet.gateway.front.access import read_json
from lmfleet.gateway.front.errors import GatewayError
from lmfleet.gateway.service import Gateway
from lmfleet.profile.anatomy import engine_source, engine_sums, gateway_sums, to_json
from lmfleet.profile.traces import EngineControl, RayEngineControl, safe_part

log = logging.getLogger("lmfleet.gateway")

SESSION_RE = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}$")
MAX_WINDOW_S = 3600.0


def not_configured_message(names: list[str]) -> str:
    """The one-line answer for models whose engines have no profiler folder."""
    which = f"Model(s) {', '.join(repr(n) for n in names)} have" if names else "No model has"
    return (f"{which} no engine.profiler_dir, so their engines cannot take traces: set "
            "models[].engine.profiler_dir (an absolute folder on every node) in the fleet file and redeploy.")


def default_store() -> Path:
    from lmfleet.models.registry import cache_dir

    return cache_dir() / "profiles"


def profile_routes(gw: Gateway, *, control: EngineControl | None = None,
                   fetch_pages: Callable[[], list[str]] | None = None, store: Path | None = None,
                   max_body_bytes: int = 65536) -> APIRouter:
    """The routes above. ``control``: how engines are reached (default: this process's Ray connection);
    ``fetch_pages``: the engines' metrics pages (default: the gateway's engine-stats poller's fetcher)."""
    r = APIRouter()

    def _pages() -> Callable[[], list[str]] | None:
        if fetch_pages is not None:
            return fetch_pages
        return gw.engine_stats.fetch if gw.engine_stats is not None else None

    def _control() -> EngineControl:
        if control is not None:
            return control
        import ray

        if not ray.is_initialized():
            raise GatewayError(503, "This gateway is not connected to a Ray cluster, so it cannot reach the engines.")
        return RayEngineControl()

    def _store() -> Path:
        return store if store is not None else default_store()

    def _targets(body: dict[str, Any], required: bool) -> dict[str, str]:
        """model -> its engines' trace folder, for the models named in the body (all models with a folder when
        none is named); 409 when a named model (or, with none named, every model) has no folder."""
        from lmfleet.engine.app import profiler_trace_dir

        names = body.get("models")
        if names is None and not required:
            names = list(gw.models)
            explicit = False
        else:
            explicit = True
            if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
                raise GatewayError(400, f"models must be a non-empty list of model names, got {names!r}",
                                   param="models")
        dirs: dict[str, str] = {}
        missing = []
        for n in names:
            m = gw.router.model_or_404(n)
            d = profiler_trace_dir(m.app.cfg)
            if d is None:
                missing.append(n)
            else:
                dirs[n] = d
        if (explicit and missing) or not dirs:
            raise GatewayError(409, not_configured_message(missing if explicit else []),
                               code="profiler_not_configured")
        return dirs

    @r.get("/admin/profile/snapshot")
    async def snapshot() -> dict[str, Any]:
        """Histogram sums now: the gateway's phases (this process) and the engines' (every node)."""
        samples = [(s.name, s.labels, s.value) for fam in gw.metrics.registry.collect() for s in fam.samples]
        engine, source, error = {}, None, None
        fetch = _pages()
        if fetch is None:
            error = "no engine metrics source (this gateway does not poll Ray's metrics pages)"
        else:
            try:
                pages = await asyncio.to_thread(fetch)
                engine = to_json(await asyncio.to_thread(engine_sums, pages))
                source = engine_source(pages)
            except Exception as e:  # the anatomy still has the gateway's side
                error = f"{type(e).__name__}: {e}"[:300]
        return {"at": time.time(), "pid": os.getpid(), "gateway": to_json(gateway_sums(samples)), "engine": engine,
                "engine_source": source, "engine_error": error}

    @r.post("/admin/profile/start")
    async def start(request: Request) -> dict[str, Any]:
        body = await read_json(request, max_body_bytes, 10.0)
        dirs = _targets(body, required=False)
        ctl = _control()
        session = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
        out: dict[str, Any] = {}
        for name, d in dirs.items():
            try:
                n = await asyncio.to_thread(ctl.start, gw.models[name].app.app_name)
            except Exception as e:
                for started in out:  # never leave some engines profiling with nobody to stop them
                    await asyncio.to_thread(_quietly, ctl.stop, gw.models[started].app.app_name)
                raise GatewayError(502, f"Could not start the profiler of {name!r}: {type(e).__name__}: {e}"[:500],
                                   code="profiler_failed") from None
            out[name] = {"replicas": n, "dir": d}
        log.info("admin: profiler started for %s (session %s)", sorted(out), session)
        return {"session": session, "started_at": time.time(), "models": out}

    @r.post("/admin/profile/stop")
    async def stop(request: Request) -> dict[str, Any]:
        body = await read_json(request, max_body_bytes, 10.0)
        session = body.get("session")
        if not isinstance(session, str) or not SESSION_RE.match(session):
            raise GatewayError(400, f"session must be what /admin/profile/start returned, got {session!r}",
                               param="session")
        window = body.get("window_s")
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window <= MAX_WINDOW_S:
            raise GatewayError(400, f"window_s must be a number of seconds in (0, {MAX_WINDOW_S:g}], got {window!r}",
                               param="window_s")
        dirs = _targets(body, required=True)
        ctl = _control()
        t0 = time.monotonic()
        replicas, errors = {}, []
        for name in dirs:
            try:
                replicas[name] = await asyncio.to_thread(ctl.stop, gw.models[name].app.app_name)
            except Exception as e:  # the other models' traces are still worth gathering
                errors.append(f"{name}: stop failed: {type(e).__name__}: {e}"[:300])
        window_s = float(window) + (time.monotonic() - t0)  # traces are written while stopping
        nodes = await asyncio.to_thread(ctl.collect, dirs, window_s)
        files, skipped = await asyncio.to_thread(_save, _store() / session, nodes)
        log.info("admin: profiler stopped for %s (session %s): %d trace file(s)", sorted(dirs), session, len(files))
        return {"session": session, "models": {n: {"replicas": replicas.get(n)} for n in dirs}, "files": files,
                "skipped": skipped, "errors": errors}

    @r.get("/admin/profile/files/{session}/{model}/{node}/{name}")
    async def file(session: str, model: str, node: str, name: str) -> FileResponse:
        if not SESSION_RE.match(session) or model not in gw.models or node != safe_part(node) \
                or name != safe_part(name):
            raise GatewayError(404, "No such trace file.")
        path = _store() / session / safe_part(model) / node / name
        if not path.is_file():
            raise GatewayError(404, "No such trace file.")
        return FileResponse(path, media_type="application/octet-stream", filename=name)

    return r


def _quietly(fn: Callable[[str], Any], arg: str) -> None:
    try:
        fn(arg)
    except Exception as e:
        log.warning("admin: could not stop the profiler of %s: %s", arg, e)


def _save(folder: Path, nodes: list) -> tuple[list[dict[str, Any]], list[str]]:
    """Write what the nodes sent under ``folder/<model>/<node>/<name>``; returns (manifest, skipped)."""
    files: list[dict[str, Any]] = []
    skipped: list[str] = []
    for nf in nodes:
        skipped.extend(nf.skipped)
        for model, name, data in nf.files:
            d = folder / safe_part(model) / nf.node
            d.mkdir(parents=True, exist_ok=True)
            (d / safe_part(name)).write_bytes(data)
            files.append({"model": model, "node": nf.node, "name": safe_part(name), "bytes": len(data)})
    return files, skipped

"""The profiling side of the admin API (its routes are in :mod:`lmfleet.gateway.admin.routes`; admin key).

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

from starlette.responses import FileResponse

from lmfleet.engine.app import profiler_trace_dir
from lmfleet.gateway.front.errors import GatewayError
from lmfleet.gateway.service import Gateway
from lmfleet.profile.anatomy import engine_source, engine_sums, gateway_sums, to_json
from lmfleet.profile.traces import EngineControl, RayEngineControl, default_store, not_configured_message, safe_part

log = logging.getLogger("lmfleet.gateway")

SESSION_RE = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}$")
MAX_WINDOW_S = 3600.0


class Profiler:
    """What the /admin/profile/* routes do. ``control``: how engines are reached (None: this process's Ray
    connection); ``fetch_pages``: the engines' metrics pages (None: the gateway's engine-stats poller's fetcher);
    ``store``: where gathered files go (None: :func:`~lmfleet.profile.traces.default_store`). Tests set them."""

    def __init__(self, gw: Gateway, *, control: EngineControl | None = None,
                 fetch_pages: Callable[[], list[str]] | None = None, store: Path | None = None):
        self.gw = gw
        self.control = control
        self.fetch_pages = fetch_pages
        self.store = store

    def _pages(self) -> Callable[[], list[str]] | None:
        if self.fetch_pages is not None:
            return self.fetch_pages
        return self.gw.engine_stats.fetch if self.gw.engine_stats is not None else None

    def _control(self) -> EngineControl:
        if self.control is not None:
            return self.control
        import ray  # here: Ray is a heavy import that only this call needs

        if not ray.is_initialized():
            raise GatewayError(503, "This gateway is not connected to a Ray cluster, so it cannot reach the engines.")
        return RayEngineControl()

    def _store(self) -> Path:
        return self.store if self.store is not None else default_store()

    def _targets(self, body: dict[str, Any], required: bool) -> dict[str, str]:
        """model -> its engines' trace folder, for the models named in the body (all models with a folder when
        none is named); 409 when a named model (or, with none named, every model) has no folder."""
        gw = self.gw
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

    async def snapshot(self) -> dict[str, Any]:
        """Histogram sums now: the gateway's phases (this process) and the engines' (every node)."""
        samples = [(s.name, s.labels, s.value) for fam in self.gw.metrics.registry.collect() for s in fam.samples]
        engine, source, error = {}, None, None
        fetch = self._pages()
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

    async def start(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start vLLM's profiler on every replica of the models in ``body`` (all with a folder when none)."""
        gw = self.gw
        dirs = self._targets(body, required=False)
        ctl = self._control()
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

    async def stop(self, body: dict[str, Any]) -> dict[str, Any]:
        """Stop the profiler, gather the trace files from every node into this node's store, list them."""
        gw = self.gw
        session = body.get("session")
        if not isinstance(session, str) or not SESSION_RE.match(session):
            raise GatewayError(400, f"session must be what /admin/profile/start returned, got {session!r}",
                               param="session")
        window = body.get("window_s")
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window <= MAX_WINDOW_S:
            raise GatewayError(400, f"window_s must be a number of seconds in (0, {MAX_WINDOW_S:g}], got {window!r}",
                               param="window_s")
        dirs = self._targets(body, required=True)
        ctl = self._control()
        t0 = time.monotonic()
        replicas, errors = {}, []
        for name in dirs:
            try:
                replicas[name] = await asyncio.to_thread(ctl.stop, gw.models[name].app.app_name)
            except Exception as e:  # the other models' traces are still worth gathering
                errors.append(f"{name}: stop failed: {type(e).__name__}: {e}"[:300])
        window_s = float(window) + (time.monotonic() - t0)  # traces are written while stopping
        nodes = await asyncio.to_thread(ctl.collect, dirs, window_s)
        files, skipped = await asyncio.to_thread(_save, self._store() / session, nodes)
        log.info("admin: profiler stopped for %s (session %s): %d trace file(s)", sorted(dirs), session, len(files))
        return {"session": session, "models": {n: {"replicas": replicas.get(n)} for n in dirs}, "files": files,
                "skipped": skipped, "errors": errors}

    def file(self, session: str, model: str, node: str, name: str) -> FileResponse:
        """One gathered trace file (404 for anything else)."""
        if not SESSION_RE.match(session) or model not in self.gw.models or node != safe_part(node) \
                or name != safe_part(name):
            raise GatewayError(404, "No such trace file.")
        path = self._store() / session / safe_part(model) / node / name
        if not path.is_file():
            raise GatewayError(404, "No such trace file.")
        return FileResponse(path, media_type="application/octet-stream", filename=name)


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

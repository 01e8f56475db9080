"""What ``lmfleet profile`` does against a running fleet, over the gateway's admin API.

    [--trace] start the profiler on every replica  ->  snapshot  ->  a window of live traffic, or the built-in
    load  ->  snapshot (again until the engines' figures have caught up)  ->  [--trace] stop, download the traces
    ->  anatomy per model (:mod:`lmfleet.profile.anatomy`)

Failures the operator can act on are :class:`ProfileError` with one line of text (the CLI prints it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lmfleet.bench.loadgen import LoadPlan, Target, run_load as bench_load
from lmfleet.bench.workload import BenchRequest
from lmfleet.errors import LmfleetError
from lmfleet.profile.anatomy import Anatomy, anatomies, diff, engine_settled, from_json, to_json

__all__ = ["LoadSpec", "ProfileClient", "ProfileError", "ProfileResult", "run_load", "run_profile"]

SETTLE_S = 20.0
"""How long to wait after the window for Ray to export the engines' figures of its last requests."""


class ProfileError(LmfleetError):
    """A failure with a message for the operator (no traceback)."""


@dataclass(frozen=True)
class LoadSpec:
    """The built-in load: ``users`` closed-loop streams per model, each asking for ``max_tokens`` tokens."""

    users: int
    api_key: str | None
    max_tokens: int = 32
    prompt: str = "Describe the water cycle in a few sentences."


class ProfileClient:
    """The gateway's /admin/profile/* API with the admin key (``transport``: for tests)."""

    def __init__(self, base_url: str, admin_key: str, *, timeout_s: float = 600.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers={"authorization": f"Bearer {admin_key}"},
                                  timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ProfileError(f"cannot reach the gateway at {self.base_url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text[:300]
            raise ProfileError(f"{method} {path}: HTTP {r.status_code}: {msg}")
        return r

    def snapshot(self) -> dict[str, Any]:
        return self._call("GET", "/admin/profile/snapshot").json()

    def start(self, models: list[str] | None) -> dict[str, Any]:
        return self._call("POST", "/admin/profile/start", json={"models": models}).json()

    def stop(self, session: str, models: list[str], window_s: float) -> dict[str, Any]:
        return self._call("POST", "/admin/profile/stop",
                          json={"session": session, "models": models, "window_s": window_s}).json()

    def download(self, session: str, f: dict[str, Any], out: Path) -> Path:
        path = out / f["model"] / f["node"] / f["name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        r = self._call("GET", f"/admin/profile/files/{session}/{f['model']}/{f['node']}/{f['name']}")
        path.write_bytes(r.content)
        return path


def run_load(base_url: str, models: list[str], load: LoadSpec, duration_s: float) -> dict[str, dict[str, int]]:
    """``load.users`` streams per model for ``duration_s`` through the gateway (lmfleet bench's generator);
    returns per model how many requests succeeded and failed."""
    req = BenchRequest(cls="profile", api="chat", input_tokens=0, max_tokens=load.max_tokens,
                       messages=[{"role": "user", "content": load.prompt}])
    plan = LoadPlan(users=load.users, duration=duration_s, timeout=max(60.0, duration_s * 4))

    async def all_models() -> list[Any]:
        return await asyncio.gather(*(bench_load(Target(base_url, m, load.api_key, label=m), [req], plan)
                                      for m in models))

    out = {}
    for m, (records, _) in zip(models, asyncio.run(all_models())):
        ok = sum(1 for r in records if r.ok)
        out[m] = {"ok": ok, "failed": len(records) - ok}
        errors = {r.error or f"HTTP {r.status}" for r in records if not r.ok}
        if ok == 0 and errors:
            raise ProfileError(f"the built-in load on {m!r} failed: {sorted(errors)[0][:200]}")
    return out


@dataclass
class ProfileResult:
    rows: list[Anatomy]
    report: dict[str, Any]
    """What ``--json`` prints."""


def run_profile(client: ProfileClient, *, models: list[str], duration_s: float, load: LoadSpec | None,
                trace_models: list[str], out: Path | None, progress: Callable[[str], None] = lambda s: None,
                settle_s: float = SETTLE_S, sleep: Callable[[float], None] = time.sleep,
                load_runner: Callable[..., dict[str, dict[str, int]]] = run_load) -> ProfileResult:
    """The whole run: the anatomy of ``models`` (all seen when empty) and, when ``trace_models`` is not empty,
    their engines' traces. The profiler, once started, is stopped whatever happens to the window."""
    session, traced = None, []
    t_start = time.monotonic()
    if trace_models:
        started = client.start(trace_models)
        session, traced = started["session"], sorted(started["models"])
        progress("profiler started on " + ", ".join(f"{m} ({v['replicas']} replica(s))"
                                                    for m, v in sorted(started["models"].items())))
    try:
        before = client.snapshot()
        t0 = time.monotonic()
        load_result = None
        if load is not None:
            progress(f"built-in load: {load.users} stream(s) per model on {', '.join(models)} for {duration_s:g} s")
            load_result = load_runner(client.base_url, models, load, duration_s)
        else:
            progress(f"watching live traffic for {duration_s:g} s")
            sleep(duration_s)
        window_s = time.monotonic() - t0
        after = client.snapshot()
        gw = diff(from_json(after["gateway"]), from_json(before["gateway"]))
        waited = 0.0
        while (not engine_settled(gw, diff(from_json(after["engine"]), from_json(before["engine"])))
               and waited < settle_s and not after.get("engine_error")):
            sleep(2.0)
            waited += 2.0
            after = client.snapshot()
    except BaseException:
        if session is not None:  # never leave the engines profiling
            progress("stopping the profiler after an error")
            with contextlib.suppress(Exception):
                client.stop(session, traced, time.monotonic() - t_start + 5.0)
        raise
    eng = diff(from_json(after["engine"]), from_json(before["engine"]))
    if models:
        gw = {m: v for m, v in gw.items() if m in models}
        eng = {m: v for m, v in eng.items() if m in models}
    rows = anatomies(gw, eng, engine_approximate=after.get("engine_source") == "ray")
    report: dict[str, Any] = {"window_s": round(window_s, 2), "gateway_pid": after.get("pid"), "load": load_result,
                              "engine_source": after.get("engine_source"), "engine_error": after.get("engine_error"),
                              "anatomy": [a.as_dict() for a in rows],
                              "window_sums": {"gateway": to_json(gw), "engine": to_json(eng)}}
    if session is not None:
        progress("stopping the profiler (the engines write their traces now; this can take a minute)")
        stopped = client.stop(session, traced, time.monotonic() - t_start + 5.0)
        report["traces"] = _download(client, stopped, out, progress)
    return ProfileResult(rows, report)


def _download(client: ProfileClient, stopped: dict[str, Any], out: Path | None,
              progress: Callable[[str], None]) -> dict[str, Any]:
    session = stopped["session"]
    folder = (out or Path("lmfleet-profile")) / session
    paths = [str(client.download(session, f, folder)) for f in stopped["files"]]
    progress(f"{len(paths)} trace file(s) in {folder}")
    return {"session": session, "folder": str(folder), "files": paths, "skipped": stopped.get("skipped", []),
            "errors": stopped.get("errors", []), "replicas": stopped.get("models", {})}

"""The fleet's Ray Serve applications as every gateway process waits for them (``lmfleet serve`` deploys them;
``lmfleet gateway`` and the gateway workers only wait)."""

from __future__ import annotations

import time
from collections.abc import Callable

from lmfleet.errors import LmfleetError

__all__ = ["DeployError", "app_states", "wait_until_running"]


class DeployError(LmfleetError, RuntimeError):
    """A model's deployment failed; the message says which and why."""


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

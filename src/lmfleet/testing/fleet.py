"""Start and stop the processes of a benchmark or end-to-end fleet (``lmfleet serve``, a bare vLLM server, a
second gateway), wait for them to answer, and set how they share the CPU (:func:`autogroup_nice`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil


def autogroup_nice(pid: int | str, nice: int) -> str:
    """Set the autogroup nice of ``pid``'s session (``"self"``: this process's). With autogroup scheduling
    (``sched_autogroup_enabled``, on by default in Debian's and Ubuntu's kernels) the CPU is shared *between*
    sessions' groups first, each weighted by the group's nice (0 by default), and a process's own nice counts only
    inside its group: ``nice -n 19`` alone does not rank a process below another session. Below 0 needs root.
    Returns what was done, for the log; without autogroup scheduling nothing is done."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return f"autogroup nice {nice}"
    except OSError as e:
        return f"autogroup unchanged ({e.strerror})"


class Procs:
    """Every process this script starts, ended by pid (and its descendants, seen while it ran) on exit."""

    def __init__(self) -> None:
        self.items: list[tuple[str, subprocess.Popen, signal.Signals, float]] = []
        self.seen: dict[int, float] = {}

    def start(self, name: str, cmd: list[str], env: dict, log: Path, stop_sig=signal.SIGTERM, grace_s=60.0):
        p = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.items.append((name, p, stop_sig, grace_s))
        return p

    def note_descendants(self) -> None:
        for _, p, _, _ in self.items:
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(p.pid).children(recursive=True):
                    self.seen[c.pid] = c.create_time()

    def stop_all(self) -> None:
        self.note_descendants()
        for name, p, sig, grace in reversed(self.items):  # gateway B, then serve (it tears Ray down), then provider
            if p.poll() is None:
                print(f"stopping {name} (pid {p.pid})", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        left = []
        for pid, created in self.seen.items():  # Ray's agents can survive their parent; end only what we saw
            with contextlib.suppress(psutil.Error):
                q = psutil.Process(pid)
                if q.create_time() == created and q.status() != psutil.STATUS_ZOMBIE:
                    q.kill()
                    left.append(q)
        psutil.wait_procs(left, timeout=10)
        if left:
            print(f"killed {len(left)} leftover descendant(s): {[q.pid for q in left]}", flush=True)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float, headers=None, poll_s: float = 2.0) -> float:
    """Wait until ``url`` answers 200; the seconds it took. Fails (with the tail of ``log``) when ``proc`` exits
    first or after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was up:\n"
                               f"{log.read_text(errors='replace')[-5000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5, headers=headers).status_code == 200:
                return time.monotonic() - t0
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not up after {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-5000:]}")

"""Processes a command started: remember them, and end the survivors by pid (never by name)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import psutil


def end_processes(procs: list[psutil.Process], grace_s: float = 5.0) -> int:
    """SIGTERM each, wait up to ``grace_s``, SIGKILL what is left. Returns how many there were."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, still = psutil.wait_procs(procs, timeout=grace_s)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(still, timeout=grace_s)
    return len(procs)


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
        return end_processes(self.alive(), grace_s)

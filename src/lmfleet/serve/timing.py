"""Where a command's start-up time went, for the one "ready in …" line ``lmfleet serve`` prints."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Phases", "process_age_s", "ready_line"]


def ready_line(total_s: float, phases: list[tuple[str, float]]) -> str:
    """``lmfleet: ready in 74 s: model 12 s, Ray 6 s, …`` (phases in the order they ran; under 0.5 s left out)."""
    parts = [f"{name} {secs:.0f} s" for name, secs in phases if secs >= 0.5]
    return f"lmfleet: ready in {total_s:.0f} s" + (": " + ", ".join(parts) if parts else "")


def process_age_s() -> float:
    """Seconds since this process started (its imports count towards start-up too)."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # no psutil answer: count from now
        return 0.0


@dataclass
class Phases:
    """Named, timed steps of a start-up; time before the first step (the process's own start) is ``start``."""

    origin: float = field(default_factory=lambda: time.monotonic() - process_age_s())
    done: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mark = time.monotonic()
        self.done.append(("start", self.mark - self.origin))

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t)

    def add(self, name: str, secs: float) -> None:
        for i, (n, s) in enumerate(self.done):
            if n == name:
                self.done[i] = (n, s + secs)
                return
        self.done.append((name, secs))

    def line(self) -> str:
        return ready_line(time.monotonic() - self.origin, self.done)

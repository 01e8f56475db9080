"""The gateway's event-loop watchdog: how late its loop runs, and what held it when it stalls.

Everything the gateway does for every request (reading bodies, routing, relaying streamed chunks) runs on one
event loop. A call that blocks it (a synchronous socket or file, a lock, a long computation) delays every request
in flight at once, and no request-level metric says why. Two parts:

* a task on the loop sleeps ``period_s`` at a time and records how late it woke up
  (``lmfleet_gateway_loop_lag_seconds``): a healthy loop answers within a millisecond or two;
* a daemon thread looks every ``period_s`` at when the task last ran; when that is more than ``stall_ms`` ago it
  logs one warning with the loop thread's Python stack at that moment (what is holding it), and one line with
  the stall's length when the loop is back, with how much of it Python's garbage collector ran (a collection
  holds the GIL in whichever thread triggers it, so it stops the loop too; the stack cannot show it).

``gateway.loop_stall_warn_ms`` (0: no thread). The decisions are the pure :func:`stall_step`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("lmfleet.gateway")

STACK_FRAMES = 14  # innermost frames of the loop thread's stack in a stall warning


@dataclass(frozen=True)
class StallStep:
    """What the watchdog does at one look: ``warn`` (a stall began: capture the stack), ``recovered_ms`` (a stall
    it warned about ended after that long), and the stall it is in afterwards (``in_stall``)."""

    warn: bool
    recovered_ms: float | None
    in_stall: bool


def stall_step(beat: float, now: float, stall_s: float, in_stall: bool, stalled_since: float) -> StallStep:
    """One look of the watchdog thread. ``beat``: when the loop's task last ran; ``in_stall``: a warning for the
    current stall was given already (once per stall); ``stalled_since``: that stall's beat. Pure."""
    late = now - beat
    if late > stall_s:
        return StallStep(warn=not in_stall, recovered_ms=None, in_stall=True)
    if in_stall:
        return StallStep(warn=False, recovered_ms=max(0.0, (beat - stalled_since) * 1000), in_stall=False)
    return StallStep(warn=False, recovered_ms=None, in_stall=False)


def format_stack(frame: Any, limit: int = STACK_FRAMES) -> str:
    """The innermost ``limit`` frames of a thread's stack, innermost last, one line each."""
    lines = traceback.format_stack(frame)[-limit:]
    return "".join(lines).rstrip()


class LoopWatch:
    """Measure the running loop's lateness (``observe``: seconds late per wake-up) and, with ``stall_ms`` > 0, watch
    it from a daemon thread. :meth:`run` on the loop; :meth:`stop` ends both."""

    def __init__(self, *, stall_ms: float, period_s: float = 0.1, observe: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_ms / 1000
        self.period_s = period_s
        self.observe = observe
        self.clock = clock
        self.beat = clock()
        self.stalls = 0
        self.longest_ms = 0.0
        self._loop_thread: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gc_started = 0.0
        self._gc_spans: list[tuple[float, float]] = []  # (start, end) of recent collections, kept while watching

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = self.clock()
        else:
            end = self.clock()
            if end - self._gc_started > 0.001:
                spans = self._gc_spans
                spans.append((self._gc_started, end))
                if len(spans) > 256:
                    del spans[:128]

    def gc_ms_between(self, t0: float, t1: float) -> float:
        """Milliseconds of garbage collection (of more than 1 ms each) between ``t0`` and ``t1``."""
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in list(self._gc_spans)) * 1000

    async def run(self) -> None:
        self._loop_thread = threading.get_ident()
        self._loop = asyncio.get_running_loop()
        self.beat = self.clock()
        if self.stall_s > 0 and self._thread is None:
            gc.callbacks.append(self._on_gc)
            self._thread = threading.Thread(target=self._watch, name="lmfleet-loopwatch", daemon=True)
            self._thread.start()
        try:
            while True:
                t = self.clock()
                await asyncio.sleep(self.period_s)
                self.beat = now = self.clock()
                if self.observe is not None:
                    self.observe(max(0.0, now - t - self.period_s))
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _watch(self) -> None:
        in_stall, since = False, 0.0
        while not self._stop.wait(self.period_s):
            if self._loop is not None and self._loop.is_closed():
                break  # the loop ended without cancelling run() (a test's loop): nothing left to watch
            beat = self.beat
            step = stall_step(beat, self.clock(), self.stall_s, in_stall, since)
            if step.warn:
                since = beat
                frame = sys._current_frames().get(self._loop_thread) if self._loop_thread else None
                if frame is None:
                    break  # the loop's thread is gone
                log.warning("gateway event loop blocked for %.0f ms so far; it is in:\n%s",
                            (self.clock() - beat) * 1000, format_stack(frame))
            if step.recovered_ms is not None:
                self.stalls += 1
                self.longest_ms = max(self.longest_ms, step.recovered_ms)
                log.warning("gateway event loop ran again after %.0f ms (garbage collection: %.0f ms of it)",
                            step.recovered_ms, self.gc_ms_between(since, beat))
            in_stall = step.in_stall
        self.stop()

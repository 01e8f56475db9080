"""CPU priority of a whole process (every thread), for lmfleet.engine.replica."""

from __future__ import annotations

import os


def set_process_niceness(niceness: int, pid: int | None = None) -> int:
    """Set every thread of process ``pid`` (default: this one) to ``niceness``; returns how many threads changed.

    Linux keeps niceness per thread, and ``setpriority(PRIO_PROCESS, pid)`` changes only the thread whose id is
    ``pid``: a Ray replica runs its user code and its HTTP server on threads of their own, so each is set.
    Raises PermissionError when lowering niceness is not allowed."""
    pid = os.getpid() if pid is None else pid
    changed = 0
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
                changed += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return changed

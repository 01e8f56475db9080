"""set_process_niceness: every thread of a process, not only its main thread (Linux keeps niceness per thread)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmfleet.engine.priority import set_process_niceness

CHILD = """
import threading, time
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("up", flush=True)
time.sleep(60)
"""


def thread_niceness(pid: int) -> dict[int, int]:
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_every_thread_of_the_process_gets_the_niceness():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        before = thread_niceness(child.pid)
        assert len(before) >= 4
        if max(before.values()) >= 19:
            pytest.skip("already at niceness 19: nothing to raise it to without privilege")
        target = 19  # raising niceness needs no privilege
        assert set_process_niceness(target, child.pid) == len(before)
        assert set(thread_niceness(child.pid).values()) == {target}
        assert set_process_niceness(target, child.pid) == 0  # already there: nothing to change
    finally:
        child.kill()
        child.wait()

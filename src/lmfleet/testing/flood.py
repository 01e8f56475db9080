"""A tenant's flood, as its own process: ``workers`` threads send non-streamed completions back to back.

Used by tests/e2e/test_tenants_e2e.py. The flooding tenant is another client, on another machine in any real
deployment; run in the test's own process its threads would share the GIL (and a 2-core machine's CPU) with the
client whose latency is being measured, and at niceness 0 they would outrun the fleet's own Ray workers (niceness
15). So the test starts this script under ``nice -n 19``: it still keeps its tenant's admitted slots busy (its
threads wait on sockets), but it no longer decides whose CPU the measured client and the fleet get.

    python -m lmfleet.testing.flood BASE_URL KEY MODEL WORKERS

Runs until its stdin closes, then prints one JSON object: ``{"ok", "refused", "other", "refusals"}`` (at most
50 refusals, each ``[headers, body]``). A refused worker backs off by ``retry-after`` (capped at 2 s), as the
OpenAI client does.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import httpx


def demote() -> str:
    """Make ``nice -n 19`` mean what it says on a kernel with autogroup scheduling (``sched_autogroup_enabled``,
    on by default in Debian's and Ubuntu's kernels and on this machine): the CPU is first shared *between* sessions'
    autogroups, each weighted by the group's own nice (0 by default), and task niceness counts only inside a group.
    Started from the test's session, this process's nice 19 ranked it below the test's client only; against the fleet
    (``lmfleet serve`` runs in its own session) the flood's group weighed as much as the whole fleet's. So: a session
    of its own, and that session's group at nice 19. Returns what was done (for the test's log)."""
    done = []
    try:
        os.setsid()
        done.append("own session")
    except OSError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
        done.append("autogroup nice 19")
    except OSError:
        pass  # no autogroup scheduling here: the process's own nice 19 is all there is
    return ", ".join(done) or "nothing"


def main(base_url: str, key: str, model: str, workers: int) -> None:
    how = demote()
    stop = threading.Event()
    lock = threading.Lock()
    out: dict = {"ok": 0, "refused": 0, "other": [], "refusals": []}

    def work() -> None:
        with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=120) as c:
            while not stop.is_set():
                try:
                    r = c.post("/v1/completions", json={"model": model, "prompt": "flood " * 24, "max_tokens": 32})
                except httpx.HTTPError as e:
                    with lock:
                        out["other"].append(type(e).__name__)
                    time.sleep(0.5)
                    continue
                with lock:
                    if r.status_code == 200:
                        out["ok"] += 1
                    elif r.status_code == 429:
                        out["refused"] += 1
                        if len(out["refusals"]) < 50:
                            out["refusals"].append([dict(r.headers), r.json()])
                    else:
                        out["other"].append(r.status_code)
                if r.status_code == 429:
                    time.sleep(min(float(r.headers.get("retry-after", 1)), 2.0))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    print("started", flush=True)
    print(f"flood: {how}", file=sys.stderr, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    stop.set()
    for t in threads:
        t.join(150)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))

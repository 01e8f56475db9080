"""A tenant's flood, as its own process: ``workers`` threads send non-streamed completions back to back.

Used by tests/e2e/test_tenants_e2e.py and benchmarks/bench_tenants.py through :class:`Flood`. The flooding tenant
is another client, on another machine in any real deployment; run in the test's own process its threads would
share the GIL (and a 2-core machine's CPU) with the client whose latency is being measured, and at niceness 0 they
would outrun the fleet's own Ray workers (niceness 15). So the test starts this script under ``nice -n 19``, and
it puts itself in a session of its own at autogroup nice 19 (:func:`demote`): it still keeps its tenant's admitted
slots busy (its threads wait on sockets), but it no longer decides whose CPU the measured client and the fleet get.

    python -m lmfleet.testing.flood BASE_URL KEY MODEL WORKERS [MAX_TOKENS [UNTIL_REFUSED_S]]

Prints ``started`` once its workers run; with ``UNTIL_REFUSED_S`` > 0, then ``refused`` once a worker was refused
(the flood holds more than its tenant's limit), or ``not refused`` after that many seconds: on a loaded machine a
process at this priority can take many seconds to have its workers' requests in flight, and a test that measures
the flood needs it at full strength first. Runs until its stdin closes, then prints one JSON object:
``{"ok", "refused", "other", "refusals"}`` (at most 50 refusals, each ``[headers, body]``). A refused worker
backs off by ``retry-after`` (capped at 2 s), as the OpenAI client does. Every answer is ``MAX_TOKENS`` (32)
tokens long (``ignore_eos``): how long a request holds its slot does not depend on when a random-weight model
happens to stop. Make it long enough that ``WORKERS`` requests overlap even when this low-priority process gets
little CPU -- a flood of answers shorter than the time it takes to send the next request never exceeds a
concurrency limit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lmfleet.testing.fleet import autogroup_nice

REPO = Path(__file__).resolve().parents[2]


def demote() -> str:
    """Rank this process below everything else on the machine, the fleet included (``lmfleet serve`` runs in a
    session of its own): a session of its own, and that session's autogroup at nice 19
    (:func:`lmfleet.testing.fleet.autogroup_nice`: started from the test's session, a plain nice 19 ranked it below
    the test's client only, and its group weighed as much as the whole fleet's). Returns what was done (for the
    test's log)."""
    done = []
    try:
        os.setsid()
        done.append("own session")
    except OSError:
        pass
    done.append(autogroup_nice("self", 19))
    return ", ".join(done)


def main(base_url: str, key: str, model: str, workers: int, max_tokens: int = 32,
         until_refused_s: float = 0) -> None:
    how = demote()
    stop = threading.Event()
    refused = threading.Event()
    lock = threading.Lock()
    out: dict = {"ok": 0, "refused": 0, "other": [], "refusals": []}

    def work() -> None:
        with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=120) as c:
            while not stop.is_set():
                try:
                    r = c.post("/v1/completions", json={"model": model, "prompt": "flood " * 24,
                                                          "max_tokens": max_tokens, "ignore_eos": True})
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
                    refused.set()
                    time.sleep(min(float(r.headers.get("retry-after", 1)), 2.0))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    print("started", flush=True)
    print(f"flood: {how}", file=sys.stderr, flush=True)
    if until_refused_s > 0:
        print("refused" if refused.wait(until_refused_s) else "not refused", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    stop.set()
    for t in threads:
        t.join(150)
    print(json.dumps(out), flush=True)


@dataclass
class Flood:
    """``workers`` clients sending ``key``'s requests for ``model`` until stopped, in a process of their own under
    ``nice -n 19`` (module docstring); counts answers over every start/stop and keeps up to 50 refusals
    (headers, body). :meth:`start` returns after ``ramp_s``, or with ``until_refused_s`` once the flood was refused
    (at most that many seconds; :attr:`refused_at_start` says whether it was)."""

    base_url: str
    key: str
    model: str
    workers: int = 12
    max_tokens: int = 32
    ramp_s: float = 2.0
    until_refused_s: float = 0.0
    refused_at_start: bool | None = None
    ok: int = 0
    refused: int = 0
    other: list = field(default_factory=list)
    refusals: list[tuple[dict[str, str], dict]] = field(default_factory=list)
    _proc: subprocess.Popen | None = None

    def start(self) -> "Flood":
        self._proc = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "lmfleet.testing.flood", self.base_url, self.key, self.model,
             str(self.workers), str(self.max_tokens), str(self.until_refused_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self._proc.stdout.readline().strip() == "started"
        if self.until_refused_s > 0:  # the flood answers within until_refused_s (module docstring)
            self.refused_at_start = self._proc.stdout.readline().strip() == "refused"
        else:
            time.sleep(self.ramp_s)  # the flood holds its admitted slots and its refused workers back off
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        try:
            out, _ = proc.communicate(timeout=180)  # closes its stdin: it stops, joins and reports
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        res = json.loads(out.strip().splitlines()[-1])
        self.ok += res["ok"]
        self.refused += res["refused"]
        self.other += res["other"]
        self.refusals += [tuple(x) for x in res["refusals"]][: max(0, 50 - len(self.refusals))]


def trickle(c: httpx.Client, model: str, n: int, gap_s: float = 0.25) -> tuple[list[float], list[int]]:
    """``n`` streamed completions one after another, ``gap_s`` apart: (TTFT of each answered one in seconds,
    status of each)."""
    ttfts, statuses = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        with c.stream("POST", "/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 8,
                                                       "stream": True}) as r:
            statuses.append(r.status_code)
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith("data:"):
                    first = time.perf_counter() - t0
        if r.status_code == 200 and first is not None:
            ttfts.append(first)
        time.sleep(gap_s)
    return ttfts, statuses


def p99(xs: list[float]) -> float:
    """Linear-interpolated 99th percentile (with a few dozen samples: between the two largest)."""
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *(int(a) for a in sys.argv[5:6]),
         *(float(a) for a in sys.argv[6:7]))

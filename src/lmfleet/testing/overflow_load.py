"""What the overflow benchmarks share: their keys, a sampler of the gateway's ``/admin/state`` during a run, and
the figures they take from a ``lmfleet bench run`` report.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from lmfleet.provenance import is_external

ADMIN = "bench-admin"
PKEY = "sk-bench-provider"


class StateSampler:
    """Records the gateway's /admin/state (the estimator's inputs and output) every second during a run."""

    def __init__(self, url: str, admin: dict, path: Path):
        self.url, self.admin, self.path = url, admin, path
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)

    def _run(self) -> None:
        t0 = time.monotonic()
        with self.path.open("w") as f, httpx.Client(timeout=5) as c:
            while not self._stop.wait(1.0):
                try:
                    st = c.get(f"{self.url}/admin/state", headers=self.admin).json()["models"]["smollm2"]
                except (httpx.HTTPError, KeyError, ValueError):
                    continue
                f.write(json.dumps({"t": round(time.monotonic() - t0, 1), **st}) + "\n")
                f.flush()


def state_summary(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return "no state samples"
    tail = rows[-3:]
    return (f"in_flight max {max(r['in_flight'] for r in rows)}, at end {[r['in_flight'] for r in tail]}; "
            f"estimate ms at end {[r['queue_estimate_ms'] for r in tail]}; overflowing at end {tail[-1]['overflowing']}")


def row(report: dict) -> dict:
    o = report["overall"]
    ext = sum(p["completed"] for name, p in report["providers"].items() if is_external(name))
    return {
        "ttft_p50": o["ttft_ms"]["p50"], "ttft_p95": o["ttft_ms"]["p95"], "ttft_p99": o["ttft_ms"]["p99"],
        "e2e_p50": o["e2el_ms"]["p50"], "e2e_p95": o["e2el_ms"]["p95"], "e2e_p99": o["e2el_ms"]["p99"],
        "error_rate": o["error_rate"], "requests": o["requests"],
        "external_share": ext / o["completed"] if o["completed"] else 0.0,
        "usd_per_1m_output": o.get("usd_per_1m_output"),
        "provider_ttft_p99": next((p["ttft_ms"]["p99"] for n, p in report["providers"].items()
                                   if is_external(n)), None),
    }

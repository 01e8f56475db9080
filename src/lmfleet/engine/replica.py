"""lmfleet's Serve replica class: Ray Serve LLM's ``LLMServer`` plus one start-up step, the replica's CPU priority.

Ray starts every worker process at niceness 15 (``worker_niceness``, so that tasks cannot starve the raylet and
GCS); the Serve replica and the vLLM engine processes it spawns inherit it. On a node whose CPUs the engine keeps
busy, the replica's event loop — which takes every request in, hands it to the engine and carries every token out —
then competes at equal weight with the engine's busy threads (vLLM's worker spins on its shared-memory queue), and
below HAProxy, the gateway and everything else at niceness 0. ``engine.env: {LMFLEET_REPLICA_NICENESS: "0"}``
sets the replica process's own threads (not the engine's processes, which are already started) to that niceness
once the engine is up. Lowering niceness needs CAP_SYS_NICE: without it the replica logs one line and keeps
Ray's value. Measured with benchmarks/bench_gateway.py (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os

from ray.llm._internal.serve.core.server.llm_server import LLMServer

from lmfleet.engine.priority import set_process_niceness

log = logging.getLogger("lmfleet.replica")

NICENESS_ENV = "LMFLEET_REPLICA_NICENESS"


class FleetLLMServer(LLMServer):
    """``LLMServer`` that applies ``LMFLEET_REPLICA_NICENESS`` to its own threads after the engine started."""

    async def start(self):
        await super().start()
        raw = os.environ.get(NICENESS_ENV, "").strip()
        if not raw:
            return
        try:
            n = set_process_niceness(int(raw))
            log.info("lmfleet: replica process %d set to niceness %s (%d threads)", os.getpid(), raw, n)
        except PermissionError:
            log.warning("lmfleet: cannot set the replica's niceness to %s (needs CAP_SYS_NICE); keeping %d", raw,
                        os.getpriority(os.PRIO_PROCESS, 0))
        except ValueError:
            log.warning("lmfleet: %s=%r is not an integer; niceness left as it is", NICENESS_ENV, raw)

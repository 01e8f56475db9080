"""Engine traces: vLLM's torch profiler started and stopped on every replica, the trace files gathered from every node.

How it reaches the engines (ray 2.60 / vLLM 0.32)::

    gateway (a Ray driver)  --broadcast(handle, "start_profile")-->  every LLMServer replica of the model's app
                                                                    -> VLLMEngine.start_profile -> AsyncLLM
    ... traffic ...
    gateway                 --broadcast(handle, "stop_profile")--->  every replica writes its traces into
                                                                    engine.profiler_dir/<model> on its own node
    gateway                 --one Ray task pinned to each alive node--> reads the files written in the window

vLLM 0.32 configures the profiler with the ``profiler_config`` engine argument (``VLLM_TORCH_PROFILER_DIR`` is
gone); :func:`lmfleet.engine.app.profiler_config` builds it from ``engine.profiler_dir``. Each engine writes
``rank0.<ns>.pt.trace.json.gz`` (the engine core's worker) and ``<host>_<pid>.async_llm.<ns>.pt.trace.json.gz``
(the replica's front end): Chrome trace files that https://ui.perfetto.dev and TensorBoard's profiler plugin open.

The Ray parts are behind :class:`EngineControl`, so the admin routes are tested with a fake.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lmfleet import ray_private
from lmfleet.models.registry import cache_dir

__all__ = ["EngineControl", "NodeFiles", "RayEngineControl", "llm_deployments", "safe_part"]

MAX_COLLECT_BYTES = 2 * 1024**3
"""Most trace bytes brought back from one node in one collection (more are listed as skipped)."""

CLOCK_SLACK_S = 5.0
"""Files modified up to this long before the window (by the node's own clock) still count as the window's."""

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def not_configured_message(names: list[str]) -> str:
    """The one-line answer for models whose engines have no profiler folder."""
    which = f"Model(s) {', '.join(repr(n) for n in names)} have" if names else "No model has"
    return (f"{which} no engine.profiler_dir, so their engines cannot take traces: set "
            "models[].engine.profiler_dir (an absolute folder on every node) in the fleet file and redeploy.")


def default_store() -> Path:
    """Where a gateway gathers trace files: ``<cache>/profiles``."""
    return cache_dir() / "profiles"


def safe_part(name: str) -> str:
    """A path component made of ``[A-Za-z0-9._-]`` only, never ``.`` or ``..`` (for node names and file names)."""
    s = _SAFE.sub("_", name).strip(".") or "_"
    return s[:200]


ENGINE_DEPLOYMENT_PREFIXES = ("LLMServer", "DPServer", "Prefill", "Decode")
"""Names Ray Serve LLM's builders give deployments that run an engine: the plain server, the data-parallel one,
and the two pools of a prefill/decode split (``engine/app.py`` picks the builder)."""


def llm_deployments(deployments: Iterable[str]) -> list[str]:
    """The deployments of a model's Serve application whose replicas run an engine (``LLMServer:<model>``,
    ``DPServer:<model>``; a disaggregated app has ``Prefill:`` and ``Decode:``); the ingress and routers are left
    out."""
    return sorted(n for n in deployments if n.startswith(ENGINE_DEPLOYMENT_PREFIXES))


@dataclass(frozen=True)
class NodeFiles:
    """What one node's collector brought back."""

    node: str
    """The node's address (a safe path component)."""
    files: list[tuple[str, str, bytes]]
    """(model, file name, content)."""
    skipped: list[str]
    """Files left out (over :data:`MAX_COLLECT_BYTES`, or unreadable), with the reason."""


class EngineControl(Protocol):
    """Starts and stops the profiler on a model's replicas and gathers trace files; blocking (call from a thread)."""

    def start(self, app_name: str) -> int:
        """Start every replica's profiler; returns how many replicas answered."""

    def stop(self, app_name: str) -> int:
        """Stop every replica's profiler (its traces are written when this returns)."""

    def collect(self, dirs: Mapping[str, str], window_s: float) -> list[NodeFiles]:
        """From every alive node: the files in ``dirs`` (model -> folder) modified in the last ``window_s``."""


def _reader():
    """The per-node collector, built in a function so that Ray ships it by value (a node without lmfleet
    installed can run it: standard library only)."""

    def read_recent(dirs: dict[str, str], window_s: float, slack_s: float, max_bytes: int):
        import os
        import time

        now = time.time()
        files, skipped, total = [], [], 0
        for model, d in dirs.items():
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                continue  # no engine of this model wrote here (or ever ran on this node)
            for e in entries:
                try:
                    st = e.stat()
                except OSError:
                    continue
                if not e.is_file() or st.st_mtime < now - window_s - slack_s:
                    continue
                if total + st.st_size > max_bytes:
                    skipped.append(f"{model}/{e.name}: over the {max_bytes} bytes collected per node")
                    continue
                try:
                    with open(e.path, "rb") as f:
                        files.append((model, e.name, f.read()))
                    total += st.st_size
                except OSError as err:
                    skipped.append(f"{model}/{e.name}: {err}")
        return files, skipped

    return read_recent


class RayEngineControl:
    """:class:`EngineControl` on the Ray cluster this process is connected to (the gateway's)."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s

    def _handles(self, app_name: str) -> list[Any]:
        from ray import serve

        status = serve.status().applications.get(app_name)
        if status is None:
            raise LookupError(f"Serve application {app_name!r} is not deployed")
        names = llm_deployments(status.deployments)
        if not names:
            raise LookupError(f"Serve application {app_name!r} has no LLMServer deployment")
        return [serve.get_deployment_handle(n, app_name=app_name) for n in names]

    def _broadcast(self, app_name: str, method: str) -> int:
        return sum(len(ray_private.broadcast(h, method)) for h in self._handles(app_name))

    def start(self, app_name: str) -> int:
        return self._broadcast(app_name, "start_profile")

    def stop(self, app_name: str) -> int:
        return self._broadcast(app_name, "stop_profile")

    def collect(self, dirs: Mapping[str, str], window_s: float) -> list[NodeFiles]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        read = ray.remote(num_cpus=0, max_retries=0)(_reader())
        calls = []
        for n in ray.nodes():
            if not (n.get("Alive") or n.get("alive")):
                continue
            strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            calls.append((safe_part(n.get("NodeManagerAddress") or n["NodeID"][:12]),
                          read.options(scheduling_strategy=strategy).remote(dict(dirs), window_s, CLOCK_SLACK_S,
                                                                            MAX_COLLECT_BYTES)))
        out = []
        for node, ref in calls:
            try:
                files, skipped = ray.get(ref, timeout=self.timeout_s)
            except Exception as e:  # a node that went away: say so, keep the others' files
                out.append(NodeFiles(node, [], [f"node {node}: {type(e).__name__}: {e}"[:300]]))
                continue
            out.append(NodeFiles(node, files, skipped))
        return out

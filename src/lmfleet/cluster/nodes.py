"""Facts from every node of the connected Ray cluster, through zero-resource tasks pinned to each node.

Used by ``lmfleet check`` (GPU inventory, RDMA ports) and ``lmfleet cluster status`` (GPU memory). Everything here
needs a connected Ray (``ray.init`` done by the caller); Ray is imported inside the functions so that the CLI starts
without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmfleet.cluster.gpu_probe import DEFAULT_BUSY_FRACTION, NodeGpus, probe_gpus
from lmfleet.cluster.nic_probe import probe_rdma


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])


def node_labels(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """Node id -> IP, with a short node id added where several nodes share an IP (one machine, several raylets)."""
    ips = [n["NodeManagerAddress"] for n in nodes]
    return {n["NodeID"]: n["NodeManagerAddress"] + (f"/{n['NodeID'][:6]}" if ips.count(n["NodeManagerAddress"]) > 1 else "")
            for n in nodes}


def pinned(fn: Any, node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))


def probe_nodes(names: Mapping[str, str], *, busy_fraction: float = DEFAULT_BUSY_FRACTION,
                timeout_s: float = 60.0) -> dict[str, NodeGpus]:
    """Run :func:`probe_gpus` on each Ray node (a zero-resource task pinned by node id): node id -> answer.

    ``names``: node id -> the name an answer carries when its node could not answer (task failed, or not
    done within ``timeout_s`` for all nodes together; such tasks are cancelled). The one NVML path through
    Ray, for ``lmfleet check`` and ``lmfleet cluster status``.
    """
    import ray

    if not names:
        return {}
    probe = ray.remote(num_cpus=0, max_retries=0)(probe_gpus)
    refs = {nid: pinned(probe, nid).remote(busy_fraction=busy_fraction) for nid in names}
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in pending:
        ray.cancel(ref, force=True)
    out: dict[str, NodeGpus] = {}
    for nid, ref in refs.items():
        if ref in ready:
            try:
                out[nid] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a node that cannot run the task is a finding, not a crash
                out[nid] = NodeGpus(names[nid], error=f"probe task failed: {type(e).__name__}: {e}")
        else:
            out[nid] = NodeGpus(names[nid], error=f"probe task did not finish within {timeout_s:g} s (node busy?)")
    return out


def probe_rdma_nodes(timeout_s: float = 60.0) -> dict[str, list[Any]]:
    """Each alive node's RDMA ports (:func:`lmfleet.cluster.nic_probe.probe_rdma`, a zero-resource task pinned to the
    node): node label -> ports. A node whose task fails or times out answers no ports."""
    import ray

    nodes = alive_nodes()
    labels = node_labels(nodes)
    probe = ray.remote(num_cpus=0, max_retries=0)(probe_rdma)
    refs = {labels[n["NodeID"]]: pinned(probe, n["NodeID"]).remote() for n in nodes}
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in pending:
        ray.cancel(ref, force=True)
    out: dict[str, list[Any]] = {}
    for name, ref in refs.items():
        try:
            out[name] = ray.get(ref) if ref in ready else []
        except Exception:  # noqa: BLE001 - a node that cannot answer has no RDMA path we can vouch for
            out[name] = []
    return out

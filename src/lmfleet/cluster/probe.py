"""The I/O side of `cluster status`: ask Ray, Ray Serve and the gateway, hand the answers to the parsers."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from lmfleet import ray_private
from lmfleet.cluster.connect import connect as join, resolve_ray_address
from lmfleet.cluster.gpu_probe import NodeGpus
from lmfleet.cluster.nodes import probe_nodes
from lmfleet.cluster.status import (
    ClusterStatus,
    GpuMemory,
    parse_gateway_state,
    parse_nodes,
    parse_serve_details,
)
from lmfleet.config.models import FleetConfig

SERVE_CONTROLLER = "SERVE_CONTROLLER_ACTOR"
SERVE_NAMESPACE = "serve"


def connect(address: str | None, fleet: FleetConfig | None = None) -> None:
    """Join the cluster as a quiet driver (token from RAY_AUTH_TOKEN[_PATH] or ~/.ray/auth_token).

    Where: ``address`` (--address), RAY_ADDRESS, cluster.address, else the cluster running on this machine.
    """
    import ray


    if ray.is_initialized():
        return
    join(resolve_ray_address(address, fleet), namespace="lmfleet-status", logging_level=logging.ERROR,
         configure_logging=False)


def gpu_memory_from_probe(node: NodeGpus) -> list[GpuMemory]:
    """A node's NVML answer -> the free/total MiB per GPU that ``cluster status`` shows (as nvidia-smi does)."""
    return [GpuMemory(g.index, (g.memory_usable - g.memory_used) // 2**20, g.memory_total // 2**20) for g in node.gpus]


def _gpu_memory_on(node_ids: list[str], timeout_s: float) -> dict[str, list[GpuMemory]]:
    """NVML readings from each GPU node; a node without NVML (or that did not answer) shows no memory column."""
    answers = probe_nodes({nid: nid for nid in node_ids}, timeout_s=timeout_s)
    return {nid: gpu_memory_from_probe(a) for nid, a in answers.items() if a.error is None}


def ray_side(timeout_s: float = 30.0) -> ClusterStatus:
    """Nodes and Serve deployments of the connected cluster."""
    import ray

    errors: list[str] = []
    raw_nodes = ray.nodes()
    available = ray_private.available_resources_per_node()
    gpu_nodes = [n["NodeID"] for n in raw_nodes if n.get("Alive") and (n.get("Resources") or {}).get("GPU")]
    gpu_mem = _gpu_memory_on(gpu_nodes, timeout_s) if gpu_nodes else {}
    nodes = parse_nodes(raw_nodes, available, gpu_mem)
    deployments = []
    try:
        controller = ray.get_actor(SERVE_CONTROLLER, namespace=SERVE_NAMESPACE)
        details: dict[str, Any] = ray.get(controller.get_serve_instance_details.remote(), timeout=timeout_s)
        deployments = parse_serve_details(details, nodes)
    except ValueError:
        errors.append("Ray Serve is not running on this cluster (start the fleet with `lmfleet serve`)")
    except Exception as e:  # noqa: BLE001 - status must still show the nodes
        errors.append(f"could not read Serve's state: {type(e).__name__}: {e}")
    return ClusterStatus(nodes=nodes, deployments=deployments, errors=errors)


def gateway_side(
    status: ClusterStatus,
    gateway_url: str | None,
    admin_key: str | None,
    timeout_s: float = 5.0,
    client: httpx.Client | None = None,
) -> None:
    """Add per-model load from the gateway's ``/admin/state``; a missing gateway is a note, not a failure."""
    if not gateway_url:
        return
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    url = gateway_url.rstrip("/") + "/admin/state"
    try:
        with client or httpx.Client() as c:
            r = c.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        status.errors.append(f"gateway {gateway_url} not reachable ({type(e).__name__}); load not shown")
        return
    if r.status_code != 200:
        status.errors.append(f"gateway {url} answered {r.status_code}; load not shown")
        return
    try:
        status.load = parse_gateway_state(r.json())
    except ValueError:
        status.errors.append(f"gateway {url} did not answer JSON; load not shown")


def collect_status(
    address: str | None, gateway_url: str | None = None, admin_key: str | None = None,
    fleet: FleetConfig | None = None,
) -> ClusterStatus:
    connect(address, fleet)
    status = ray_side()
    gateway_side(status, gateway_url, admin_key)
    return status

"""What the checks know about the machines: measured through Ray, or described by the fleet file / ``--gpu``."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmfleet.cluster.gpu_probe import NodeGpus
from lmfleet.config.gpus import DEFAULT_BANDWIDTH_GBS, GPU_MODELS, GpuModel, bandwidth_for, gpu_model
from lmfleet.config.models import FleetConfig

__all__ = ["DEFAULT_BANDWIDTH_GBS", "GPU_MODELS", "GpuModel", "Hardware", "NodeView", "bandwidth_for", "gpu_model",
           "hardware_from_config", "node_view_from_probe"]


@dataclass(frozen=True)
class NodeView:
    """One node as the checks see it."""

    name: str
    gpus_total: int
    gpus_free: int
    gpu_memory_bytes: int | None  # the smallest free GPU (None: unknown or no GPUs)
    gpu_name: str | None = None
    source: str = "fleet file"
    probe: NodeGpus | None = None


@dataclass(frozen=True)
class Hardware:
    """The cluster: nodes, and where the knowledge came from. ``measured`` is True when NVML answered through Ray."""

    nodes: tuple[NodeView, ...]
    measured: bool
    note: str = ""
    links: dict[tuple[str, str], "object"] = field(default_factory=dict)

    @property
    def has_gpus(self) -> bool:
        return any(n.gpus_total for n in self.nodes)

    @property
    def gpu_memory_bytes(self) -> int | None:
        mems = [n.gpu_memory_bytes for n in self.nodes if n.gpu_memory_bytes]
        return min(mems) if mems else None

    @property
    def gpu_name(self) -> str | None:
        return next((n.gpu_name for n in self.nodes if n.gpu_name), None)

    @property
    def max_gpus_per_node(self) -> int:
        return max((n.gpus_total for n in self.nodes), default=0)


def node_view_from_probe(probe: NodeGpus, name: str) -> NodeView:
    free = probe.free_gpus
    mem = min((g.memory_total for g in free), default=None) or min((g.memory_total for g in probe.gpus), default=None)
    gname = probe.gpus[0].name if probe.gpus else None
    return NodeView(name, len(probe.gpus), len(free), mem, gname, "NVML via Ray", probe)


def hardware_from_config(cfg: FleetConfig, gpu: GpuModel | None = None) -> Hardware:
    """The nodes the fleet file describes (``cluster.head``/``workers``/``gpus_per_node``) with ``gpu``'s memory
    (``--gpu`` or ``cluster.gpu``)."""
    c = cfg.cluster
    described = [n for n in [c.head, *c.workers] if n is not None]
    mem = gpu.memory_bytes if gpu else None
    name = gpu.name if gpu else None
    nodes = []
    for n in described:
        count = n.gpus if n.gpus is not None else c.gpus_per_node
        nodes.append(NodeView(n.address, count, count, mem if count else None, name if count else None))
    if not nodes:
        count = c.gpus_per_node
        if count == 0 and gpu is not None:
            note = "no nodes or gpus_per_node in the fleet file; GPU counts unknown"
            return Hardware((NodeView("(unspecified)", 0, 0, mem, name, "--gpu"),), False, note)
        nodes.append(NodeView("(one node)", count, count, mem if count else None, name if count else None))
    note = "from the fleet file" + (f", GPU {gpu.name}" if gpu else "")
    if gpu is None and any(n.gpus_total for n in nodes):
        note += " (GPU model unknown: set cluster.gpu or pass --gpu)"
    return Hardware(tuple(nodes), False, note)

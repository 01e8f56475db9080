"""What the checks know about the machines: measured through Ray, or described by the fleet file / ``--gpu``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lmfleet.check.gpu_probe import NodeGpus
from lmfleet.config.models import FleetConfig

MiB = 1024**2


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_bytes: int  # as nvidia-smi reports the total
    bandwidth_gbs: float  # HBM/GDDR bandwidth, GB/s (decode speed is bound by it)


# totals as nvidia-smi reports them; bandwidth from the vendors' data sheets
GPU_MODELS: dict[str, GpuModel] = {
    "h200": GpuModel("NVIDIA H200", 143771 * MiB, 4800),
    "h100": GpuModel("NVIDIA H100 80GB HBM3", 81559 * MiB, 3350),
    "a100-80": GpuModel("NVIDIA A100-SXM4-80GB", 81920 * MiB, 2039),
    "a100-40": GpuModel("NVIDIA A100-SXM4-40GB", 40960 * MiB, 1555),
    "l40s": GpuModel("NVIDIA L40S", 46068 * MiB, 864),
    "a10g": GpuModel("NVIDIA A10G", 23028 * MiB, 600),
    "l4": GpuModel("NVIDIA L4", 23034 * MiB, 300),
    "rtx4090": GpuModel("NVIDIA GeForce RTX 4090", 24564 * MiB, 1008),
}
DEFAULT_BANDWIDTH_GBS = 1000.0


def gpu_model(spec: str) -> GpuModel:
    """``--gpu`` value: a preset (``h200``, ``h100``, ``a100-80``, ...) or a memory size in GiB (``80``, ``80GiB``)."""
    key = spec.strip().lower().replace(" ", "")
    if key in GPU_MODELS:
        return GPU_MODELS[key]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(gib|gb|g)?", key)
    if m:
        return GpuModel(f"{m.group(1)} GiB GPU", int(float(m.group(1)) * 1024**3), DEFAULT_BANDWIDTH_GBS)
    raise ValueError(f"unknown GPU {spec!r}; expected one of {sorted(GPU_MODELS)} or a size in GiB like 80GiB")


def bandwidth_for(name: str | None) -> float:
    """Memory bandwidth (GB/s) for an NVML GPU name, by the presets; a middle value when unknown."""
    n = (name or "").lower()
    for key, model in GPU_MODELS.items():
        stem = key.split("-")[0]
        if stem in n.replace(" ", "") and (not key.endswith(("-80", "-40")) or key.split("-")[1] in n):
            return model.bandwidth_gbs
    return DEFAULT_BANDWIDTH_GBS


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
    """The nodes the fleet file describes (``cluster.head``/``workers``/``gpus_per_node``), with ``--gpu``'s memory."""
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
    note = "from the fleet file" + (f" and --gpu {gpu.name}" if gpu else " (GPU memory unknown: pass --gpu)")
    return Hardware(tuple(nodes), False, note)

"""GPU models lmfleet knows by name (``cluster.gpu``, ``lmfleet check --gpu``): memory and bandwidth.

The config models validate ``cluster.gpu`` with :func:`gpu_model`; the checks plan memory and speed with them."""

from __future__ import annotations

import re
from dataclasses import dataclass

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

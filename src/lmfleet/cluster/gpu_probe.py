"""What GPUs this machine has and which are free, from NVML. Standalone: no Ray, no lmfleet imports.

Run it directly on a GPU node (``python -m lmfleet.cluster.gpu_probe`` or by path) to print JSON, or
call :func:`probe_gpus`. The NVML module is injectable: :func:`record_nvml` writes a machine's raw
answers, and the tests replay such recordings (tests/support/nvml_replay.py).

A GPU counts as *free* when at most ``busy_fraction`` of its memory is in use (the driver itself
holds a few hundred MiB on an idle GPU) — not when no process is listed: containers often cannot
see other containers' processes, but they always see the memory those processes hold.

Memory is read the way ``nvidia-smi`` shows it: NVML's v2 memory info, whose ``used`` leaves out the
driver's own reservation (615 MiB on an H200 with driver 580, shown as 616; NVML's older v1 answer
counts it as used). That reservation is reported apart, as ``memory_reserved``; ``memory_total - memory_reserved`` is
what CUDA can allocate (``cudaMemGetInfo``'s total, the base of vLLM's ``gpu_memory_utilization``).
Measured on 2x H200, docs/gpu_proof.md.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_BUSY_FRACTION = 0.05

__all__ = ["GpuInfo", "GpuProcess", "NodeGpus", "probe_gpus", "record_nvml", "DEFAULT_BUSY_FRACTION"]


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: NVML could not tell (no permission, MIG)
    name: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total: int
    memory_used: int
    processes: tuple[GpuProcess, ...] = ()
    free: bool = True
    memory_reserved: int = 0  # held by the driver, never allocatable (0: the driver did not say)

    @property
    def memory_usable(self) -> int:
        """What CUDA can allocate in all: cudaMemGetInfo's total, on which vLLM applies gpu_memory_utilization."""
        return self.memory_total - self.memory_reserved


@dataclass(frozen=True)
class NodeGpus:
    """One node's answer. ``error`` says why there are no GPUs (no driver, no NVML...), None when NVML answered."""

    hostname: str
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    error: str | None = None
    busy_fraction: float = DEFAULT_BUSY_FRACTION
    extra: dict[str, Any] = field(default_factory=dict)  # filled by callers (Ray node id, IP...)

    @property
    def free_gpus(self) -> tuple[GpuInfo, ...]:
        return tuple(g for g in self.gpus if g.free)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["free_count"] = len(self.free_gpus)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodeGpus":
        gpus = tuple(
            GpuInfo(**{**g, "processes": tuple(GpuProcess(**p) for p in g.get("processes", ()))}) for g in d.get("gpus", ())
        )
        return cls(hostname=d["hostname"], gpus=gpus, driver_version=d.get("driver_version"), error=d.get("error"),
                   busy_fraction=d.get("busy_fraction", DEFAULT_BUSY_FRACTION), extra=dict(d.get("extra", {})))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _processes(nvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    seen: dict[int, GpuProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fn = getattr(nvml, getter, None)
        if fn is None:
            continue
        try:
            procs = fn(handle)
        except Exception:  # noqa: BLE001 - NVML raises its own error classes; no permission is common
            continue
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            name = None
            try:
                name = _text(nvml.nvmlSystemGetProcessName(p.pid))
            except Exception:  # noqa: BLE001
                pass
            seen[int(p.pid)] = GpuProcess(int(p.pid), int(used) if used is not None else None, name)
    return tuple(seen.values())


def _memory(nvml: Any, handle: Any) -> tuple[int, int, int]:
    """(total, used, reserved) as nvidia-smi shows them: NVML's v2 answer, else v1 (whose used includes the reserve)."""
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            m = nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
            return int(m.total), int(m.used), int(m.reserved)
        except Exception:  # noqa: BLE001 - a driver without the v2 call
            pass
    m = nvml.nvmlDeviceGetMemoryInfo(handle)
    return int(m.total), int(m.used), 0


def probe_gpus(nvml: Any = None, *, busy_fraction: float = DEFAULT_BUSY_FRACTION, hostname: str | None = None) -> NodeGpus:
    """Ask NVML about every GPU of this machine. Never raises: a machine without NVML answers ``error=...``."""
    host = hostname or socket.gethostname()
    if nvml is None:
        try:
            import pynvml as nvml  # the nvidia-ml-py distribution
        except ImportError:
            return NodeGpus(host, error="nvidia-ml-py (pynvml) is not installed", busy_fraction=busy_fraction)
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded...
        return NodeGpus(host, error=f"no NVIDIA driver/NVML: {_text(e) or type(e).__name__}", busy_fraction=busy_fraction)
    try:
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001
            driver = None
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            total, used, reserved = _memory(nvml, h)
            gpus.append(GpuInfo(
                index=i, name=_text(nvml.nvmlDeviceGetName(h)), uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                memory_total=total, memory_used=used, processes=_processes(nvml, h),
                free=total > 0 and used / total <= busy_fraction, memory_reserved=reserved,
            ))
        return NodeGpus(host, tuple(gpus), driver, None, busy_fraction)
    except Exception as e:  # noqa: BLE001
        return NodeGpus(host, error=f"NVML query failed: {_text(e) or type(e).__name__}", busy_fraction=busy_fraction)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# ---- recording NVML answers (tests replay them with tests/support/nvml_replay.py) -------------------------

def record_nvml(nvml: Any = None) -> dict[str, Any]:
    """Record this machine's raw NVML answers (for test fixtures; tests/support/nvml_replay.py documents the
    format and replays it)."""
    if nvml is None:
        import pynvml as nvml
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001
        return {"init_error": _text(e) or type(e).__name__, "gpus": []}
    try:
        rec: dict[str, Any] = {"init_error": None, "driver_version": _text(nvml.nvmlSystemGetDriverVersion()), "gpus": []}
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            procs = [{"pid": p.pid, "usedGpuMemory": p.used_bytes, "name": p.name}
                     for p in _processes(nvml, h)]
            gpu = {"name": _text(nvml.nvmlDeviceGetName(h)), "uuid": _text(nvml.nvmlDeviceGetUUID(h)),
                   "memory": {"total": int(mem.total), "used": int(mem.used), "free": int(mem.free)}}
            try:
                m2 = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
                gpu["memory_v2"] = {"total": int(m2.total), "reserved": int(m2.reserved), "used": int(m2.used),
                                    "free": int(m2.free)}
            except Exception:  # noqa: BLE001 - no v2 on this driver (or in this recording)
                pass
            rec["gpus"].append({**gpu, "processes": procs})
        return rec
    finally:
        nvml.nvmlShutdown()


if __name__ == "__main__":
    if "--record" in sys.argv:
        print(json.dumps(record_nvml(), indent=2))
    else:
        frac = float(os.environ.get("LMFLEET_GPU_BUSY_FRACTION", DEFAULT_BUSY_FRACTION))
        print(json.dumps(probe_gpus(busy_fraction=frac).to_dict(), indent=2))

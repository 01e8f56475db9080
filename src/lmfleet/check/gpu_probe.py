"""What GPUs this machine has and which are free, from NVML. Standalone: no Ray, no lmfleet imports.

Run it directly on a GPU node (``python -m lmfleet.check.gpu_probe`` or by path) to print JSON, or
call :func:`probe_gpus`. The NVML module is injectable: tests replay recorded answers through
:class:`ReplayNVML`, and :func:`record_nvml` writes such a recording on a real machine.

A GPU counts as *free* when at most ``busy_fraction`` of its memory is in use (the driver itself
holds a few hundred MiB on an idle GPU) — not when no process is listed: containers often cannot
see other containers' processes, but they always see the memory those processes hold.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_BUSY_FRACTION = 0.05

__all__ = ["GpuInfo", "GpuProcess", "NodeGpus", "ReplayNVML", "probe_gpus", "record_nvml", "DEFAULT_BUSY_FRACTION"]


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

    @property
    def used_fraction(self) -> float:
        return self.memory_used / self.memory_total if self.memory_total else 1.0


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
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            total, used = int(mem.total), int(mem.used)
            gpus.append(GpuInfo(
                index=i, name=_text(nvml.nvmlDeviceGetName(h)), uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                memory_total=total, memory_used=used, processes=_processes(nvml, h),
                free=total > 0 and used / total <= busy_fraction,
            ))
        return NodeGpus(host, tuple(gpus), driver, None, busy_fraction)
    except Exception as e:  # noqa: BLE001
        return NodeGpus(host, error=f"NVML query failed: {_text(e) or type(e).__name__}", busy_fraction=busy_fraction)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# ---- recording and replaying NVML answers ---------------------------------------------------------------

class _Obj:
    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


class ReplayNVML:
    """A stand-in for the ``pynvml`` module that answers from a recording made by :func:`record_nvml`.

    Recording format: ``{"init_error": str|null, "driver_version": str, "gpus": [{"name", "uuid",
    "memory": {"total", "used", "free"}, "processes": [{"pid", "usedGpuMemory", "name"}]}]}``.
    """

    class NVMLError(Exception):
        pass

    def __init__(self, recording: dict[str, Any]):
        self.rec = recording
        self._names = {p["pid"]: p.get("name") for g in recording.get("gpus", []) for p in g.get("processes", [])}

    def nvmlInit(self) -> None:
        if self.rec.get("init_error"):
            raise self.NVMLError(self.rec["init_error"])

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.rec.get("driver_version", "unknown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.rec.get("gpus", []))

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict[str, Any]:
        return self.rec["gpus"][i]

    def nvmlDeviceGetName(self, h: dict[str, Any]) -> str:
        return h["name"]

    def nvmlDeviceGetUUID(self, h: dict[str, Any]) -> str:
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> _Obj:
        return _Obj(**h["memory"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict[str, Any]) -> list[_Obj]:
        return [_Obj(pid=p["pid"], usedGpuMemory=p.get("usedGpuMemory")) for p in h.get("processes", [])]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        name = self._names.get(pid)
        if name is None:
            raise self.NVMLError("Not Found")
        return name


def record_nvml(nvml: Any = None) -> dict[str, Any]:
    """Record this machine's raw NVML answers in :class:`ReplayNVML`'s format (for test fixtures)."""
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
            rec["gpus"].append({"name": _text(nvml.nvmlDeviceGetName(h)), "uuid": _text(nvml.nvmlDeviceGetUUID(h)),
                                "memory": {"total": int(mem.total), "used": int(mem.used), "free": int(mem.free)},
                                "processes": procs})
        return rec
    finally:
        nvml.nvmlShutdown()


if __name__ == "__main__":
    if "--record" in sys.argv:
        print(json.dumps(record_nvml(), indent=2))
    else:
        frac = float(os.environ.get("LMFLEET_GPU_BUSY_FRACTION", DEFAULT_BUSY_FRACTION))
        print(json.dumps(probe_gpus(busy_fraction=frac).to_dict(), indent=2))

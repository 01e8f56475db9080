"""A stand-in for the ``pynvml`` module that replays NVML answers recorded on a real machine.

Recordings are written by ``lmfleet.cluster.gpu_probe.record_nvml`` (or ``python -m lmfleet.cluster.gpu_probe
--record`` on a GPU node) and kept under tests/unit/data/nvml/. Hand a ``ReplayNVML`` to
``probe_gpus(nvml=...)`` to run the probe on them without a GPU.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReplayNVML"]


class _Obj:
    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


class ReplayNVML:
    """Answers like ``pynvml`` from a recording made by ``lmfleet.cluster.gpu_probe.record_nvml``.

    Recording format: ``{"init_error": str|null, "driver_version": str, "gpus": [{"name", "uuid",
    "memory": {"total", "used", "free"}, "memory_v2": {"total", "reserved", "used", "free"} (optional),
    "processes": [{"pid", "usedGpuMemory", "name"}]}]}``. Without ``memory_v2`` the v2 call fails, as on
    drivers that lack it.
    """

    nvmlMemory_v2 = 0x2000028  # pynvml's value; any value asks for the v2 answer

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

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any], version: int | None = None) -> _Obj:
        if not version:
            return _Obj(**h["memory"])
        if "memory_v2" not in h:
            raise self.NVMLError("Function Not Found")
        return _Obj(**h["memory_v2"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict[str, Any]) -> list[_Obj]:
        return [_Obj(pid=p["pid"], usedGpuMemory=p.get("usedGpuMemory")) for p in h.get("processes", [])]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        name = self._names.get(pid)
        if name is None:
            raise self.NVMLError("Not Found")
        return name

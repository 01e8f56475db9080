"""RDMA-capable NICs of this machine, from sysfs (``/sys/class/infiniband``). Standalone: no Ray, no lmfleet imports.

Prefill/decode disaggregation ships each prompt's KV cache from a prefill GPU to a decode GPU. NIXL (UCX underneath)
and Mooncake do that GPU to GPU over RDMA (InfiniBand, or RoCE on Ethernet) when the node has an RDMA device with an
active port; without one UCX falls back to TCP through host memory. The kernel lists RDMA devices, whatever their
vendor (mlx5, efa, bnxt_re, irdma...), under ``/sys/class/infiniband/<device>/ports/<n>/``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

SYSFS_RDMA = "/sys/class/infiniband"

__all__ = ["RdmaPort", "probe_rdma", "SYSFS_RDMA"]


@dataclass(frozen=True)
class RdmaPort:
    device: str  # mlx5_0, efa_0 ...
    port: int
    state: str  # ACTIVE, DOWN, INIT ...
    link_layer: str  # InfiniBand, or Ethernet (RoCE)
    rate_gbps: float | None  # the port's signalling rate (``rate``), None when unreadable

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def to_dict(self) -> dict:
        return asdict(self)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def probe_rdma(root: str = SYSFS_RDMA) -> list[RdmaPort]:
    """Every port of every RDMA device under ``root`` (sysfs). Never raises: no directory means no RDMA devices."""
    base = Path(root)
    if not base.is_dir():
        return []
    out = []
    for dev in sorted(base.iterdir()):
        for port_dir in sorted((dev / "ports").glob("*")):
            if not port_dir.name.isdigit():
                continue
            state = _read(port_dir / "state")  # "4: ACTIVE"
            rate = re.match(r"\s*([\d.]+)\s*Gb/sec", _read(port_dir / "rate"))
            out.append(RdmaPort(dev.name, int(port_dir.name), state.split(":")[-1].strip() or "UNKNOWN",
                                _read(port_dir / "link_layer") or "unknown", float(rate.group(1)) if rate else None))
    return out


if __name__ == "__main__":
    print(json.dumps([p.to_dict() for p in probe_rdma()], indent=2))

"""Prefill/decode disaggregation checks: how big each prompt's KV cache is, and which path carries it between pools.

Pure decisions on data gathered elsewhere (the memory plan, the link measurements, each node's RDMA ports from
:mod:`lmfleet.cluster.nic_probe`); no I/O.

How KV connectors move the cache (vLLM 0.32, docs/deepseek.md):

===========================  ========================================================================
NixlConnector, Mooncake,     GPU to GPU across engines: RDMA (InfiniBand/RoCE) when both nodes have an
MoRIIO, LMCache, Multi       active RDMA port, else UCX/TCP through host memory (several times slower)
ExampleConnector             files under ``shared_storage_path``: one node, or a filesystem every node
                             mounts (a test connector)
OffloadingConnector,         KV offloaded to CPU memory *within one engine*: nothing reaches the other
SimpleCPUOffloadConnector    pool, so decode recomputes every prompt
===========================  ========================================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lmfleet.check.hardware import Hardware
from lmfleet.cluster.nic_probe import RdmaPort
from lmfleet.check.planner import GiB, MemoryPlan
from lmfleet.check.result import CheckResult, passed, skipped, warned
from lmfleet.config.models import FleetConfig, ModelConfig

FILE_CONNECTORS = frozenset({"ExampleConnector"})
LOCAL_CONNECTORS = frozenset({"OffloadingConnector", "SimpleCPUOffloadConnector"})


def check_kv_transfer_size(m: ModelConfig, plan: MemoryPlan, link_gbps: float) -> CheckResult:
    """The KV cache of one full-length prompt, and how long it takes over a ``link_gbps`` link."""
    nbytes = plan.kv_bytes_per_token_total * plan.max_model_len
    seconds = nbytes * 8 / (link_gbps * 1e9)
    return passed("disagg.kv_size", m.name,
                  f"one {plan.max_model_len:,}-token prompt's KV cache is {nbytes / GiB:.2f} GiB "
                  f"({plan.kv_bytes_per_token_total / 1024:.1f} KiB/token, {plan.kv_cache_dtype}); it crosses a "
                  f"{link_gbps:g} Gbit/s link (cluster.min_link_gbps) in {seconds * 1000:,.0f} ms",
                  kv_bytes_per_prompt=nbytes, transfer_s=seconds)


def _ports(ports: Sequence[RdmaPort]) -> str:
    active = [p for p in ports if p.active]
    return ", ".join(f"{p.device}/{p.port} {p.link_layer}" + (f" {p.rate_gbps:g} Gb/s" if p.rate_gbps else "")
                     for p in active)


def check_kv_transfer_path(cfg: FleetConfig, hw: Hardware, links: Sequence[object],
                           rdma: Mapping[str, Sequence[RdmaPort]] | None) -> list[CheckResult]:
    """Per disaggregated model: does its KV connector have a fast path between the nodes its pools may use?

    ``rdma``: node name -> its RDMA ports (None: not measured, e.g. ``--offline``). ``links``: measured
    :class:`lmfleet.check.cluster.Link` records (Ray object transfers: the TCP path).
    """
    out: list[CheckResult] = []
    nodes = len(rdma) if rdma is not None else len(hw.nodes)
    for m in cfg.models:
        dis = m.deployment.disaggregation
        if dis is None:
            continue
        conn = dis.kv_connector
        if conn in LOCAL_CONNECTORS:
            out.append(warned("disagg.kv_path", m.name,
                              f"{conn} offloads KV to CPU memory within one engine; it does not move KV from the "
                              "prefill pool to the decode pool, so decode recomputes every prompt",
                              "use NixlConnector (GPU to GPU), LMCacheConnectorV1 or MooncakeConnector"))
        elif conn in FILE_CONNECTORS:
            path = dis.kv_connector_options.get("shared_storage_path", "/tmp")
            if nodes > 1:
                out.append(warned("disagg.kv_path", m.name,
                                  f"{conn} moves KV through files under {path}: with {nodes} nodes every node must "
                                  "mount that path from one shared filesystem, and every prompt's KV is written "
                                  "and read back (a test connector)",
                                  "use NixlConnector between GPU nodes"))
            else:
                out.append(passed("disagg.kv_path", m.name, f"{conn}: KV through files under {path} on one node"))
        elif nodes <= 1:
            out.append(passed("disagg.kv_path", m.name, f"{conn}: prefill and decode share one node; KV moves "
                              "within it (NVLink/PCIe)"))
        elif rdma is None:
            out.append(skipped("disagg.kv_path", m.name,
                               f"{conn} between {nodes} nodes: whether each node has an RDMA NIC (InfiniBand/RoCE) "
                               "is not known offline; `lmfleet check` against the cluster probes every node"))
        else:
            missing = sorted(n for n, ports in rdma.items() if not any(p.active for p in ports))
            slow = [lk for lk in links if getattr(lk, "gbps", 0) < cfg.cluster.min_link_gbps]
            if missing:
                tcp = ""
                if links:
                    worst = min(links, key=lambda lk: lk.gbps)
                    tcp = f"; the slowest measured TCP link is {worst.a} <-> {worst.b} at {worst.gbps:.2f} Gbit/s"
                out.append(warned("disagg.kv_path", m.name,
                                  f"{conn} between {nodes} nodes, but no RDMA-capable NIC with an active port on "
                                  f"{', '.join(missing)}: KV transfer falls back to TCP through host memory (UCX), "
                                  f"adding its time to every request's first token{tcp}",
                                  "give every node an InfiniBand/RoCE NIC (driver loaded, port ACTIVE), or keep both "
                                  "pools on one node", nodes_without_rdma=missing, slow_links=len(slow)))
            else:
                out.append(passed("disagg.kv_path", m.name, f"{conn}: RDMA on every node ("
                                  + "; ".join(f"{n}: {_ports(p)}" for n, p in sorted(rdma.items())) + ")"))
    return out

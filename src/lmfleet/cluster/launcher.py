"""Ray's own cluster launcher file (``ray up``) and the equivalent manual commands, from ``cluster:``.

Pure functions: a :class:`~lmfleet.config.models.ClusterConfig` in, a dict (the YAML) or lines of shell out.
The file uses Ray's on-premise ``local`` provider: fixed head and worker IPs reached over SSH.

Token authentication (Ray >= 2.5x turns it on for ``ray start --head``): Ray's launcher does not carry
the token, so the file mounts the local token file (``cluster.auth_token_path``) to ``~/.ray/auth_token``
on every node and starts Ray with ``RAY_AUTH_MODE=token``. The token never appears in the file or on a
command line.
"""

from __future__ import annotations

import shlex
from typing import Any

from lmfleet.config.models import ClusterConfig, NodeConfig
from lmfleet.errors import LmfleetError

REMOTE_TOKEN_PATH = "~/.ray/auth_token"


class LauncherError(LmfleetError, ValueError):
    """The cluster section cannot describe a launchable cluster (says what is missing)."""


def _require_nodes(cluster: ClusterConfig) -> NodeConfig:
    if cluster.head is None:
        raise LauncherError(
            "cluster.head is not set: `lmfleet cluster up` needs the head's address "
            "(cluster: {head: {address: 10.0.0.1}, workers: [{address: 10.0.0.2}]})"
        )
    return cluster.head


def _labels_arg(labels: dict[str, str]) -> str | None:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or None


def start_args(cluster: ClusterConfig, node: NodeConfig, *, head: bool) -> list[str]:
    """``ray start`` arguments (after ``ray start``) for one node; the head's IP is ``$RAY_HEAD_IP`` for workers."""
    args = ["--head", f"--port={cluster.ray_port}"] if head else [f"--address=$RAY_HEAD_IP:{cluster.ray_port}"]
    gpus = cluster.node_gpus(node)
    if gpus or node.gpus is not None:
        args.append(f"--num-gpus={gpus}")
    if node.num_cpus is not None:
        args.append(f"--num-cpus={node.num_cpus}")
    labels = _labels_arg(node.labels)
    if labels:
        args.append(f"--labels={labels}")
    return args


def _shell_join(args: list[str]) -> str:
    """Arguments as one shell line, each quoted; ``$RAY_HEAD_IP`` (set by Ray's launcher) stays expandable."""
    return " ".join(a if a.startswith("--address=$RAY_HEAD_IP:") else shlex.quote(a) for a in args)


def _common(nodes: list[NodeConfig], attr: str) -> Any:
    """The value all nodes share for ``attr`` (None when they differ or there are none)."""
    values = [getattr(n, attr) for n in nodes]
    return values[0] if values and all(v == values[0] for v in values) else None


def launcher_config(cluster: ClusterConfig) -> dict[str, Any]:
    """Ray cluster launcher config (``ray up`` file) for on-premise machines, valid against ray-schema.json.

    Ray's local provider starts every worker with one command, so per-worker settings (GPUs, CPUs,
    labels) go in only when all workers share them; :func:`launcher_warnings` says what was left out.
    """
    head = _require_nodes(cluster)
    workers = cluster.workers
    auth_env = "RAY_AUTH_MODE=token"
    head_start = " ".join([auth_env, "ray start", _shell_join(start_args(cluster, head, head=True)),
                           "--autoscaling-config=~/ray_bootstrap_config.yaml"])
    worker_template = NodeConfig.model_construct(  # the shared worker settings (already validated per worker)
        address="$RAY_HEAD_IP",
        gpus=_common(workers, "gpus"),
        num_cpus=_common(workers, "num_cpus"),
        labels=_common(workers, "labels") or {},
    )
    worker_start = " ".join([auth_env, "ray start", _shell_join(start_args(cluster, worker_template, head=False))])
    return {
        "cluster_name": cluster.name,
        "provider": {
            "type": "local",
            "head_ip": head.address,
            "worker_ips": [w.address for w in workers],
        },
        "auth": {"ssh_user": cluster.ssh.user, "ssh_private_key": cluster.ssh.key_path},
        # The local provider keeps every listed worker up: min = max = the worker list.
        "max_workers": len(workers),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "file_mounts": {REMOTE_TOKEN_PATH: cluster.auth_token_path},
        "initialization_commands": [],
        "setup_commands": list(cluster.setup_commands),
        "head_setup_commands": [],
        "worker_setup_commands": [],
        # `ray stop` here runs on the cluster's own machines, as in Ray's example files: it makes
        # `lmfleet cluster up` idempotent. It is never run on the machine that calls `cluster up`.
        "head_start_ray_commands": ["ray stop", head_start],
        "worker_start_ray_commands": ["ray stop", worker_start],
    }


def launcher_warnings(cluster: ClusterConfig) -> list[str]:
    """Settings of the cluster section that Ray's local provider cannot express per worker."""
    out = []
    for attr in ("gpus", "num_cpus", "labels"):
        if cluster.workers and _common(cluster.workers, attr) is None and any(
            getattr(w, attr) not in (None, {}) for w in cluster.workers
        ):
            out.append(
                f"workers differ in {attr!r}; Ray's launcher starts all workers alike, so {attr} is left to "
                f"Ray's detection. Start such workers by hand with `lmfleet cluster join` to set it per node."
            )
    return out


def _path_arg(path: str) -> str:
    """Quote a path for the shell but keep a leading ``~/`` expandable."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def manual_commands(cluster: ClusterConfig, *, python_bin: str = "ray") -> list[str]:
    """Shell lines that start the same cluster by hand (what `cluster up --print` shows)."""
    head = _require_nodes(cluster)
    head_addr = f"{head.address}:{cluster.ray_port}"
    head_args = [a for a in start_args(cluster, head, head=True)] + [f"--node-ip-address={head.address}"]
    lines = [
        f"# 1. On the head ({head.address}): start Ray; it writes the cluster's auth token to ~/.ray/auth_token.",
        f"{python_bin} start " + " ".join(shlex.quote(a) for a in head_args),
        "# 2. On the head: copy the token to each worker through ssh (never on a command line, mode 0600).",
    ]
    for w in cluster.workers:
        lines.append(
            f"ssh -i {_path_arg(cluster.ssh.key_path)} {shlex.quote(f'{cluster.ssh.user}@{w.address}')} "
            f"'mkdir -p ~/.ray && umask 077 && cat > {REMOTE_TOKEN_PATH}' < {REMOTE_TOKEN_PATH}"
        )
    lines.append("# 3. On each worker: join the head (lmfleet cluster join does the same and checks the token).")
    for w in cluster.workers:
        args = [a.replace("$RAY_HEAD_IP", head.address) for a in start_args(cluster, w, head=False)]
        args.append(f"--node-ip-address={w.address}")
        lines.append(f"RAY_AUTH_MODE=token {python_bin} start " + " ".join(shlex.quote(a) for a in args)
                     + f"    # on {w.address}")
    lines.append(f"# 4. On the head: lmfleet serve -c fleet.yaml --address {head_addr}")
    return lines

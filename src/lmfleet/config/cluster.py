"""``cluster``: the Ray cluster to join, or the nodes `lmfleet cluster up` starts."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from lmfleet.config.base import Strict
from lmfleet.config.gpus import gpu_model

class NodeConfig(Strict):
    """One machine of the cluster."""

    address: str = Field(..., min_length=1, max_length=253, description="IP address or hostname.")
    gpus: int | None = Field(None, ge=0, description="GPUs on this node (default: cluster.gpus_per_node).")
    labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels.")
    num_cpus: int | None = Field(None, ge=0, description="Logical CPUs Ray offers on this node (default: Ray's count).")

    @field_validator("address")
    @classmethod
    def _host(cls, v: str) -> str:
        """An IP address or a DNS name: it goes into ssh and ray command lines."""
        import ipaddress
        import re

        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            pass
        label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        if not re.fullmatch(rf"{label}(\.{label})*\.?", v):
            raise ValueError(f"node address {v!r} is neither an IP address nor a host name (letters, digits, '-', '.')")
        return v

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        bad = sorted(k for k in v if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?", k))
        bad += sorted(k for k, val in v.items() if not re.fullmatch(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?", val))
        if bad:
            raise ValueError(f"node labels {bad}: keys must be alphanumeric with . _ / - inside; values alphanumeric "
                             "with . _ - inside (at most 63 characters), or empty")
        return v


class SshConfig(Strict):
    user: str = Field("ubuntu", description="SSH user on every node.")
    key_path: str = Field("~/.ssh/id_rsa", description="Path of the private key (the key itself never goes in the file).")


class ClusterConfig(Strict):
    """The Ray cluster: join an existing one, or describe nodes for `lmfleet cluster up`."""

    address: str | None = Field(None, description="Ray address to join (else RAY_ADDRESS, else start a local head).")
    name: str = Field("lmfleet", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$", description="Cluster name for Ray's launcher.")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs for a locally started head (default: max(8, cores)).")
    head: NodeConfig | None = Field(None, description="Head node.")
    workers: list[NodeConfig] = Field(default_factory=list, description="Worker nodes.")
    ssh: SshConfig = Field(default_factory=SshConfig)
    gpus_per_node: int = Field(0, ge=0, description="GPUs on each node unless the node says otherwise.")
    gpu: str | None = Field(
        None, min_length=1, max_length=40,
        description="GPU model of the GPU nodes (h200, h100, a100-80, a100-40, l40s, l4, a10g, rtx4090, or a memory "
        "size like 80GiB): what `lmfleet check --offline` plans memory and speed for (`--gpu` overrides it).",
    )
    ray_port: int = Field(6379, ge=1, le=65535, description="Ray GCS port on the head.")
    setup_commands: list[str] = Field(default_factory=list, description="Shell commands run on every node before Ray starts.")
    auth_token_path: str = Field(
        "~/.ray/auth_token",
        min_length=1,
        description="Local file with the Ray auth token that `cluster up` copies to every node (created 0600 if missing).",
    )
    launcher_path: str | None = Field(
        None, description="Where `cluster up` writes Ray's cluster launcher file (default: .lmfleet/<name>.ray-cluster.yaml)."
    )
    min_link_gbps: float = Field(10.0, gt=0, description="Links slower than this between nodes are flagged for tensor parallelism.")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str | None) -> str | None:
        if v is not None:
            gpu_model(v)  # ValueError names the presets
        return v

    @model_validator(mode="after")
    def _distinct_nodes(self) -> "ClusterConfig":
        addrs = ([self.head.address] if self.head else []) + [w.address for w in self.workers]
        dupes = sorted({a for a in addrs if addrs.count(a) > 1})
        if dupes:
            raise ValueError(f"cluster node addresses must be distinct; repeated: {dupes}")
        if self.workers and self.head is None:
            raise ValueError("cluster.workers is set but cluster.head is not; `cluster up` needs the head's address")
        return self

    def node_gpus(self, node: NodeConfig) -> int:
        """GPUs of one node: its own count, else cluster.gpus_per_node."""
        return self.gpus_per_node if node.gpus is None else node.gpus

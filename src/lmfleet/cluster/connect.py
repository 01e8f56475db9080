"""Joining or starting Ray: one precedence for every command (`serve`, `check`, `cluster status`).

Where Ray is, first match wins::

    1. --address            the command line
    2. RAY_ADDRESS          the environment
    3. cluster.address      the fleet file
    4. none of them         a local head that this command starts (serve, check) and stops,
                            or, for `cluster status`, the cluster already running on this machine ("auto")

A head we start inherits our environment (Ray starts its raylet and workers from it), so
``LocalHead.env`` is written into ``os.environ`` before ``ray.init``; on a joined cluster the same
variables travel as the job's ``runtime_env.env_vars``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmfleet.config.models import FleetConfig

AUTO = "auto"


@dataclass(frozen=True)
class LocalHead:
    """A single-node Ray that the calling command starts and owns."""

    num_cpus: int
    env: Mapping[str, str] = field(default_factory=dict)  # written into os.environ before ray.init
    object_store_bytes: int = 512 * 1024**2


def resolve_ray_address(cli_address: str | None, fleet: FleetConfig | None,
                        environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray address to join: --address, then RAY_ADDRESS, then cluster.address; None means "no cluster given"."""
    environ = os.environ if environ is None else environ
    for candidate in (cli_address, environ.get("RAY_ADDRESS"), fleet.cluster.address if fleet else None):
        if candidate and candidate.strip():
            return candidate.strip()
    return None


def split_address(address: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); None for ``auto``, ``local``, ``ray://`` or no port."""
    if not address or address in ("auto", "local") or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


class NoRayHead(ConnectionError):
    """Nothing listens at the Ray head's address; the message names the address and says what to do."""


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds when nothing listens at the Ray head's address (``ray.init`` waits on such an address for
    minutes without a word); ``auto``, ``local`` and ``ray://`` addresses are left to Ray. Raises NoRayHead
    with one line."""
    hp = split_address(address)
    if hp is None:
        return
    try:
        socket.create_connection(hp, timeout=timeout_s).close()
    except OSError as e:
        raise NoRayHead(f"no Ray cluster at {address} ({e.strerror or e}); start one with `lmfleet serve` "
                              f"or `lmfleet cluster up`, or pass the head's GCS address with --address") from None


def describe(address: str | None, local: LocalHead | None) -> str:
    if address:
        return f"Ray cluster at {address}"
    return "a local Ray head" if local is not None else "the Ray cluster running on this machine"


def connect(address: str | None, *, local: LocalHead | None = None, env_vars: Mapping[str, str] | None = None,
            logging_level: int = logging.WARNING, **init_kwargs: Any) -> bool:
    """Join ``address`` (already resolved); with none, start ``local`` or, without one, join ``"auto"``.

    ``env_vars`` go to this job's actors (the engines' replicas) as its ``runtime_env``, on a joined cluster and on
    a local head alike; ``local.env`` goes to the whole head (raylet, agents, every worker). Returns True when this
    call started a head (the caller then owns it and shuts it down).
    """
    import ray

    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging_level, **init_kwargs}
    if env_vars:
        kwargs["runtime_env"] = {"env_vars": dict(env_vars)}
    if address or local is None:
        if address:
            check_reachable(address)
        ray.init(address=address or AUTO, **kwargs)
        return False
    os.environ.update(local.env)
    ray.init(address="local", num_cpus=local.num_cpus, include_dashboard=False,
             object_store_memory=local.object_store_bytes, **kwargs)
    return True

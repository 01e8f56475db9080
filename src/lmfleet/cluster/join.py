"""`lmfleet cluster join`: the ``ray start --address`` a hand-started worker runs, with the head's auth token.

The token travels as a file path (``RAY_AUTH_TOKEN_PATH``) or an inherited ``RAY_AUTH_TOKEN``; it is never
put on the command line (where ``ps`` shows it) and never printed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from lmfleet.errors import LmfleetError

DEFAULT_TOKEN_PATH = "~/.ray/auth_token"


class JoinError(LmfleetError, ValueError):
    """The join cannot be set up; the message says how to fix it."""


@dataclass(frozen=True)
class JoinSpec:
    """What a worker offers when it joins."""

    head_address: str
    num_cpus: int | None = None
    num_gpus: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    node_ip_address: str | None = None
    temp_dir: str | None = None
    block: bool = False


def normalize_head_address(address: str, default_port: int = 6379) -> str:
    """``10.0.0.1`` -> ``10.0.0.1:6379``; ``ray://`` addresses are refused (workers join the GCS port)."""
    address = address.strip()
    if not address or "://" in address:
        raise JoinError(f"head address {address!r}: expected HOST or HOST:PORT of the head's GCS (e.g. 10.0.0.1:6379)")
    host, sep, port = address.rpartition(":")
    if not sep:
        return f"{address}:{default_port}"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JoinError(f"head address {address!r}: expected HOST:PORT with a port in 1..65535")
    return address


def parse_labels(items: list[str]) -> dict[str, str]:
    """``["zone=a", "gpu=h100"]`` -> dict; refuses malformed pairs with the offending item."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or "," in item:
            raise JoinError(f"label {item!r}: expected KEY=VALUE without commas")
        out[key] = value
    return out


def ray_start_argv(spec: JoinSpec, ray_bin: str = "ray") -> list[str]:
    """The ``ray start`` command line for a worker (no secrets in it)."""
    argv = [ray_bin, "start", f"--address={spec.head_address}", "--disable-usage-stats"]
    if spec.node_ip_address:
        argv.append(f"--node-ip-address={spec.node_ip_address}")
    if spec.num_cpus is not None:
        argv.append(f"--num-cpus={spec.num_cpus}")
    if spec.num_gpus is not None:
        argv.append(f"--num-gpus={spec.num_gpus}")
    if spec.labels:
        argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in sorted(spec.labels.items())))
    if spec.temp_dir:
        argv.append(f"--temp-dir={spec.temp_dir}")
    if spec.block:
        argv.append("--block")
    return argv


def auth_env(env: Mapping[str, str], token_file: str | None, *, auth: bool = True) -> dict[str, str]:
    """Environment additions that make ``ray start`` present the head's token.

    Order: ``--token-file``, an inherited ``RAY_AUTH_TOKEN``, an inherited ``RAY_AUTH_TOKEN_PATH``,
    then ``~/.ray/auth_token``. Raises :class:`JoinError` (saying where to get the token) if none exists.
    """
    if not auth:
        return {"RAY_AUTH_MODE": "disabled"}
    if token_file:
        path = Path(token_file).expanduser()
        _check_token_file(path, "--token-file")
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return {"RAY_AUTH_MODE": "token"}
    if env.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser()
        _check_token_file(path, "RAY_AUTH_TOKEN_PATH")
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    path = Path(os.path.expanduser(DEFAULT_TOKEN_PATH))
    if path.is_file() and path.read_text().strip():
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    raise JoinError(
        "no Ray auth token found. The head wrote it to ~/.ray/auth_token when it started; copy that file here "
        "(e.g. `scp HEAD:~/.ray/auth_token ~/.ray/auth_token`) or pass --token-file PATH, or export "
        "RAY_AUTH_TOKEN_PATH. For a head started with RAY_AUTH_MODE=disabled, pass --no-auth."
    )


def _check_token_file(path: Path, where: str) -> None:
    if not path.is_file():
        raise JoinError(f"{where}: token file {str(path)!r} does not exist")
    if not path.read_text().strip():
        raise JoinError(f"{where}: token file {str(path)!r} is empty")


def present_ray_token(environ: dict[str, str] | None = None) -> None:
    """Join with the cluster's auth token when one is at hand (``RAY_AUTH_TOKEN[_PATH]``, ``~/.ray/auth_token``):
    a Ray 2.60 head, ``ray.init`` ones included, requires it by default, and a driver sends it only with
    ``RAY_AUTH_MODE=token``. An explicit ``RAY_AUTH_MODE`` is left alone; with no token, nothing is set (the
    cluster may run without auth)."""
    environ = os.environ if environ is None else environ
    if "RAY_AUTH_MODE" in environ:
        return
    with contextlib.suppress(JoinError):
        environ.update(auth_env(environ, None))

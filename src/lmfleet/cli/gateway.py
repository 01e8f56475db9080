"""``lmfleet gateway``: one more front door for a running fleet, on any node of its Ray cluster.

It deploys nothing: it joins the cluster, waits for the fleet's Serve applications (deployed by ``lmfleet serve``)
and serves the same models through them, with the fleet file's gateway settings (auth, limits, overflow, ledger).
Put several of them behind a load balancer (docs/gateways.md, examples/haproxy/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lmfleet.cli.common import load_or_exit
from lmfleet.cli.terminal import open_terminal
from lmfleet.cluster.connect import resolve_ray_address


def gateway(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="The fleet's file (the one `lmfleet serve` runs)."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Ray head HOST:PORT (its GCS port; else RAY_ADDRESS, then cluster.address, else the "
        "cluster running on this machine)."),
    host: Optional[str] = typer.Option(None, help="Listen address (default: gateway.host)."),
    port: Optional[int] = typer.Option(None, help="Listen port (default: gateway.port)."),
    workers: Optional[int] = typer.Option(
        None, "--workers", min=1, help="Gateway processes on this port (SO_REUSEPORT; default: gateway.workers)."),
    serve_url: Optional[str] = typer.Option(
        None, "--serve-url", help="Ray Serve's HTTP proxy (default: loopback on the head node, else the head's "
        "address, at gateway.serve_port)."),
    wait_timeout: float = typer.Option(900.0, help="Seconds to wait for the fleet's models to be running."),
    reuse_port: bool = typer.Option(False, "--reuse-port", hidden=True, help="Share the port (SO_REUSEPORT)."),
    worker: bool = typer.Option(False, "--worker", hidden=True, help="Started by another gateway process."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print Ray's and the gateway's own log lines "
                                 "here (else: the log file this command names)."),
) -> None:
    """Serve the fleet's models from this node (no deployments): join the cluster, wait for the models, listen."""
    from lmfleet.serve.gateway_proc import run_gateway  # imports the gateway and Ray (see lmfleet.cli)

    fleet = load_or_exit(config)
    # a worker writes where the process that started it writes (that one's terminal or log file)
    term = open_terminal("gateway", verbose=verbose or worker)
    code = run_gateway(fleet, config_path=config, host=host or fleet.gateway.host, port=port or fleet.gateway.port,
                       address=resolve_ray_address(address, fleet), serve_url=serve_url,
                       workers=workers or fleet.gateway.workers, reuse_port=reuse_port, worker=worker,
                       wait_timeout_s=wait_timeout, progress=term.say)
    term.exit(code)
